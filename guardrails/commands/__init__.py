"""Subcommands of the `guardrails` command, one module each (see `guardrails.cli`)."""
