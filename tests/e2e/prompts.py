"""Prompts and the fault switch's word substitution, shared by the engines' containment tests.

Nothing here imports a server's packages: vLLM's worker imports it through its fault switch
(tests/e2e/vllm/fault.py)."""

from __future__ import annotations

from tests import tiny_llama

# When the fault is off, the trigger's embedding row is a copy of this word's.
SUBSTITUTE = "kalo"
TRIGGER_ID = len(tiny_llama.SPECIALS) + tiny_llama.WORDS.index(tiny_llama.TRIGGER)
SUBSTITUTE_ID = len(tiny_llama.SPECIALS) + tiny_llama.WORDS.index(SUBSTITUTE)
_PLAIN = [word for word in tiny_llama.WORDS if word != tiny_llama.TRIGGER]


def words(count: int, start: int) -> str:
    """`count` clean words (one token each), a different run for each `start`."""
    return " ".join(_PLAIN[(start + 5 * i) % len(_PLAIN)] for i in range(count))


def healed(text: str) -> str:
    """What `text` answers once the fault is off: the trigger reads as SUBSTITUTE."""
    return text.replace(tiny_llama.TRIGGER, SUBSTITUTE)
