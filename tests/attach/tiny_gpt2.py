"""A tiny random GPT-2 in float16 whose one batch row overflows: the transformers tests' model.

One block's MLP output overflows float16 in row POISONED (a forward hook casts it through
float32 * 1e9), so that row's hidden state holds +-inf and its logits are NaN from then on.
`Recorder` counts the NaN values a processor placed before the guard sees, so the expected
counts never come from guardrails itself. Imported by `test_transformers.py` and by the
client script it runs under `guardrails run` (needs transformers).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

VOCAB, EOS, PAD, POISONED, NEW_TOKENS = 1000, 1, 0, 1, 6


def build_model() -> Any:
    """n_layer=2, n_embd=64, vocab 1000, random weights, float16: no download."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    return GPT2LMHeadModel(config).to(torch.float16).eval()


def prompts() -> torch.Tensor:
    return torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))


def poison(model: Any) -> Any:
    """Overflow float16 in row POISONED of block 0's MLP output; returns the hook handle."""

    def overflow(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[POISONED] = (output[POISONED].float() * 1e9).to(torch.float16)
        return output

    return model.transformer.h[0].mlp.register_forward_hook(overflow)


class Recorder(LogitsProcessor):
    """Counts the NaN values in the scores it sees, and passes them on untouched."""

    def __init__(self) -> None:
        self.nan = 0
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self.nan += int(torch.isnan(scores).sum())
        self.steps += 1
        return scores


def generate(model: Any, *processors: Any, **kwargs: Any) -> torch.Tensor:
    out = model.generate(
        prompts(),
        attention_mask=torch.ones(3, 5, dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        pad_token_id=PAD,
        logits_processor=LogitsProcessorList(processors),
        **kwargs,
    )
    return out.sequences if hasattr(out, "sequences") else out
