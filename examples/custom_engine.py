"""A plain-torch "engine" guarded in code: a module hook, a decorator and a token-id site.

    python examples/custom_engine.py

A toy language model (embedding -> linear head) decodes greedily for three requests. An fp16
overflow is injected into request 1's hidden state, so its logits turn NaN. Guards:
- `guards.attach_module(model.head, "model.logits")`: a forward hook on the LM head. This site
  is configured detect-only (`sanitize = false`) and counts -inf too: it reports what the
  model produced, before any mask, and leaves the tensor alone.
- `@guards.guard_output("sampler.logits")`: the function that masks the logits for the
  sampler is guarded on the way out: NaN healed, rows flagged and counted.
- `guards.token_site(...)`: sampled ids outside the vocabulary are flagged and replaced.
Every attach returns something with `.remove()`. To act on the row flags (end a request whose
row is NO_VALID_TOKEN), call the site directly: `flags = guards.site("sampler.logits")(logits)`.
"""

from __future__ import annotations

import torch
from torch import nn

import guardrails as gr

VOCAB, HIDDEN = 64, 16


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def overflow(_module: nn.Module, _inputs: object, hidden: torch.Tensor) -> torch.Tensor:
    """Request 1's activations leave the float16 range (+-inf): NaN logits after the head."""
    hidden = hidden.clone()
    hidden[1] = (hidden[1].float() * 1e9).to(torch.float16)
    return hidden


def main() -> int:
    torch.manual_seed(0)
    settings = gr.GuardSettings(
        environ={},  # this example ignores GUARDRAILS_* so that its output is fixed
        sites={"model.logits": {"sanitize": False, "count_neginf": True}},
    )
    guards = gr.Guardrails(settings)
    model = TinyLM().to(torch.float16).eval()
    banned = torch.zeros(VOCAB, dtype=torch.bool)
    banned[-4:] = True  # a bad-words mask: -inf here is legitimate, never counted as bad

    head_hook = guards.attach_module(model.head, "model.logits")

    @guards.guard_output("sampler.logits")
    def sampler_logits(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens).float().masked_fill(banned, float("-inf"))

    ids_site = guards.token_site("sampler.token_ids", vocab_size=VOCAB)
    injected = model.embed.register_forward_hook(overflow)

    tokens = torch.tensor([5, 9, 13])
    generated: list[list[int]] = [[], [], []]
    with torch.inference_mode():
        for _step in range(4):
            tokens = sampler_logits(tokens).argmax(-1)
            ids_site(tokens)
            for row, token in enumerate(tokens.tolist()):
                generated[row].append(token)

    for handle in (injected, head_hook, sampler_logits):
        handle.remove()
    for row, ids in enumerate(generated):
        print(f"request {row}: {ids}")
    print(f"{'site':<18} {'kind':<20} count")
    for (site, kind), value in sorted(guards.counts().items()):
        print(f"{site:<18} {kind:<20} {value}")
    guards.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
