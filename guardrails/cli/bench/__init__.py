"""`guardrails bench`: `command` parses and prints, `measure` times the guard against the
SGLang-style sanitizer and one read of the logits (also used by `benchmarks/gpu_check.sh`)."""

from __future__ import annotations

from guardrails.cli.bench.command import register

__all__ = ["register"]
