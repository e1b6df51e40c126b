"""Integrations with the code that hosts guardrails.

- `transformers`: `GuardLogitsProcessor`, a transformers `LogitsProcessor` (imports
  transformers; nothing else here does).
- `launcher`: what `guardrails run -- COMMAND` installs in every Python process it starts
  (`_bootstrap/` holds its `sitecustomize`).
- Engine adapters (SGLang, vLLM) belong here too.

May import everything below it (service, sites, settings, attach); nothing imports it but the
CLI. Importing this package imports none of its modules.
"""
