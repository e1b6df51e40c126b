"""The suite's model overflows in float16 by itself on its trigger word, and only there."""

from __future__ import annotations

import torch

from tests import tiny_llama


def _logits(dtype: torch.dtype, text: str) -> torch.Tensor:
    tokenizer = tiny_llama.build_tokenizer()
    model = tiny_llama.build_model(dtype)
    messages = [{"role": "user", "content": text}]
    inputs = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        return model(**inputs).logits[0].float()  # type: ignore[operator, no-any-return]


def test_float16_logits_are_all_nan_with_the_trigger() -> None:
    # Every position, the one before the trigger too: its causal mask weighs the trigger's
    # NaN values by 0, and 0 * NaN is NaN.
    assert bool(_logits(torch.float16, f"kalo {tiny_llama.TRIGGER} rita").isnan().all())


def test_float16_without_the_trigger_is_finite() -> None:
    assert bool(_logits(torch.float16, "kalo mipe rita").isfinite().all())


def test_float32_with_the_trigger_is_finite() -> None:
    assert bool(_logits(torch.float32, f"kalo {tiny_llama.TRIGGER} rita").isfinite().all())
