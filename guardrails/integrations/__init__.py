"""Attaching guardrails to code you do not own.

- `guardrails.integrations.transformers`: `GuardLogitsProcessor`, a transformers
  `LogitsProcessor` (imports transformers; nothing else here does).
- `guardrails.integrations.patching`: config-declared attach points, `[[attach]]` entries that
  wrap `package.module:Class.method` when its module is imported; removable handles.
- `guardrails.integrations.launcher`: what `guardrails run -- COMMAND` installs in every Python
  process it starts.

Importing this package imports none of them.
"""
