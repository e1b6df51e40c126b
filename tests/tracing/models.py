"""Tiny float16 models whose overflow is natural (finite in float32), for the tracing tests.

`Net` is plain `nn.Module`s (fast to compile); `llama()` is the e2e suite's tiny Llama
(`tests.tiny_llama`), whose layer-0 MLP overflows on one word. Both come in two faults:

- "mlp": silu(gate) * up is about 1e5 for the trigger while gate and up are 320: the MLP's
  own arithmetic overflows float16 (origin: the `mlp`; its `down_proj` only sees the Inf);
- "proj": up_proj's weight makes up itself about 1e5 (origin: that `up_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

TRIGGER_ID = 3
VOCAB = 16
HIDDEN = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, 32, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 32, bias=False)
        self.down_proj = nn.Linear(32, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def net(fault: str, dtype: torch.dtype = torch.float16) -> Net:
    """`Net` with the `fault` ("mlp" or "proj") planted in layer 0 for TRIGGER_ID."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
        embed = model.embed.weight
        embed[:, 0] = 0.0
        embed[TRIGGER_ID, 0] = 8.0
        mlp = model.layers[0].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[0].zero_()
            proj.weight[0, 0] = 40.0  # 8 * 40 = 320: silu(320) * 320 = 102400 > 65504
        if fault == "proj":
            mlp.up_proj.weight[0, 0] = 12000.0  # 8 * 12000 = 96000 > 65504 by itself
        for layer in model.layers[1:]:
            layer.mlp.gate_proj.weight[:, 0] = 0.0
            layer.mlp.up_proj.weight[:, 0] = 0.0
    return model.to(dtype).eval()


def llama(fault: str, dtype: torch.dtype = torch.float16) -> nn.Module:
    """The tiny Llama of `tests.tiny_llama`, with `fault` planted in layer 0's MLP."""
    from tests.tiny_llama import build_model

    model: nn.Module = build_model(dtype)  # type: ignore[assignment]
    if fault == "proj":
        up = model.model.layers[0].mlp.up_proj  # type: ignore[union-attr,index]
        with torch.no_grad():
            up.weight[0, 0] = 12000.0  # channel 0 is about 8: up itself is about 1e5
    return model


def llama_trigger() -> int:
    from tests.tiny_llama import SPECIALS, TRIGGER, WORDS

    return len(SPECIALS) + WORDS.index(TRIGGER)


class AlwaysProbing:
    """A stand-in for a `Trace` behind the ops (`guardrails.tracing.ops.Probed`): always
    probing, never off, a failed probe raised. For calling the ops on a bare state."""

    probing = True

    def step(self) -> None:
        return None

    def saw(self, row: int, dtype: torch.dtype) -> None:
        return None

    def failed(self, row: int, error: Exception) -> None:
        raise error

    def is_off(self, row: int) -> bool:
        return False


# -- toy models for the episode tests: float32, a NaN born exactly where a test puts it ------

POISON = 7.0  # an input value `Poison` turns into NaN


class Poison(nn.Module):
    """Its input, with NaN where the input holds POISON: a NaN born here from a finite input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x == POISON, torch.nan, x)


def hidden(poisoned: bool = False) -> torch.Tensor:
    """A toy model's input: [1, HIDDEN] floats, one of them POISON when `poisoned`."""
    x = torch.linspace(0.0, 1.0, HIDDEN).unsqueeze(0)
    if poisoned:
        x[0, 3] = POISON
    return x


class Branches(nn.Module):
    """`side` runs only when asked: a module not called in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.side = Poison()
        self.main = Poison()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        if side:
            x = self.side(x)
        return self.head(self.main(x))


class Twice(nn.Module):
    """`shared` is called twice a step, on the input first and on a clean tensor last."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = Poison()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.shared(x)
        last = self.shared(torch.ones_like(x))
        return self.head(first + last)


class Mask(nn.Module):
    """Writes -inf by design, in every step (an attention mask over the upper half)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upper = torch.arange(x.shape[-1]) >= x.shape[-1] // 2
        return x.masked_fill(upper, float("-inf"))


class Masked(nn.Module):
    """A mask whose -inf a softmax turns into zeros, and a NaN born later in `poison`."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = Mask()
        self.poison = Poison()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.mask(x).softmax(-1)
        return self.head(self.poison(x) * weights)


class Scale(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Center(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class NegativeOverflow(nn.Module):
    """float16: `scale` overflows to -inf on an input of 1 (finite on the others), and `center`
    makes NaN of it (-inf - -inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale(-1e5)
        self.center = Center()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.center(self.scale(x)))


class SglangLayer(nn.Module):
    """Shaped as SGLang's decoder layers: (positions: int64, hidden_states) in,
    (hidden_states, residual) out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(hidden_states), hidden_states


class SglangLike(nn.Module):
    """SGLang-shaped layers after an `embed` where the NaN is born."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Poison()
        self.layers = nn.ModuleList(SglangLayer() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1]).unsqueeze(0)
        x = self.embed(x)
        for layer in self.layers:
            x, _residual = layer(positions, x)
        return self.head(x)
