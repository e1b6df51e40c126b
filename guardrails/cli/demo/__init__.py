"""`guardrails demo`: `command` parses and prints, `loop` serves requests on a tiny float16
decoder with injected faults, guarded or not."""

from __future__ import annotations

from guardrails.cli.demo.command import register

__all__ = ["register"]
