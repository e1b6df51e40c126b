"""A small serving loop that shows guardrails at work (`guardrails demo`, `make demo`).

A tiny decoder-only transformer in float16 (random weights, built here: nothing downloaded)
generates for several concurrent requests with continuous batching. Faults are injected at a
configurable rate, the way they happen in real servers:

- `overflow`: one request's MLP activations overflow float16, so its logits turn all NaN;
- `glitch`: a few NaN/+Inf entries in one row, as from a bad kernel;
- `overmask`: a grammar mask that leaves one row no valid token (all -inf);
- `oob`: a faulty sampler returns an id outside the vocabulary;
- `draft`: a degenerate speculative draft branch puts +Inf/NaN into the verify logits.

Guards sit at `sampler.logits`, `sampler.token_ids` and `eagle.verify`. Rows flagged
NO_VALID_TOKEN or OOB_TOKEN abort just their request; healed rows keep generating. Without
guards (`--no-guard`) the same loop crashes in the sampler or streams garbage.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch import nn

from guardrails.flags import RowFlag

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["DemoConfig", "DemoResult", "TinyDecoder", "run_demo"]

FAULTS = ("overflow", "glitch", "overmask", "oob", "draft")
_ABORT = int(RowFlag.NO_VALID_TOKEN | RowFlag.OOB_TOKEN)


@dataclass
class DemoConfig:
    requests: int = 48
    concurrency: int = 8
    max_new_tokens: int = 24
    vocab: int = 32000
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    fault_rate: float = 0.04  # probability per step of each fault kind
    spec_every: int = 4  # a speculative verify step every N decode steps
    temperature: float = 0.8
    seed: int = 0
    guard: bool = True


@dataclass
class DemoResult:
    steps: int = 0
    tokens: int = 0
    finished: int = 0
    aborted: int = 0
    rows_healed: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    guard_seconds: float = 0.0
    step_seconds: float = 0.0
    crashed: str | None = None
    garbage_tokens: int = 0


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        attended: torch.Tensor = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + attended
        mixed: torch.Tensor = self.mlp(self.ln2(x))
        return x + mixed


class TinyDecoder(nn.Module):
    """A pre-LN decoder-only transformer; logits for the last `positions` positions."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: int = 1) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(length))
        mask = torch.full((length, length), -math.inf, dtype=x.dtype).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x[:, -positions:]))  # type: ignore[no-any-return]


@dataclass
class _Request:
    rid: int
    tokens: list[int]
    budget: int
    generated: int = 0


def run_demo(
    config: DemoConfig,
    guards: Guardrails | None,
    *,
    progress: Callable[[DemoResult, int], None] | None = None,
) -> DemoResult:
    """Serve `config.requests` requests; returns what happened (never raises on a crash)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    max_len = 16 + config.max_new_tokens + 2
    model = TinyDecoder(config.vocab, config.d_model, config.layers, config.heads, max_len)
    model = model.half().eval()
    overflow_rows: list[int] = []

    def overflow_hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> torch.Tensor:
        # An fp16 overflow in one request's activations: inf here, NaN after LayerNorm.
        if overflow_rows:
            out = out.clone()
            out[overflow_rows] = out[overflow_rows] * 6e4 * 6e4
        return out

    first_block: _Block = model.blocks[0]  # type: ignore[assignment]  # ModuleList is untyped
    first_block.mlp.register_forward_hook(overflow_hook)

    sites: dict[str, Any] = {}
    if guards is not None:
        sites["logits"] = guards.site("sampler.logits")
        sites["ids"] = guards.token_site("sampler.token_ids", vocab_size=config.vocab)
        sites["verify"] = guards.site("eagle.verify")

    result = DemoResult()
    queue = [
        _Request(i, [rng.randrange(config.vocab) for _ in range(rng.randint(4, 12))], 0)
        for i in range(config.requests)
    ]
    for request in queue:
        request.budget = rng.randint(config.max_new_tokens // 2, config.max_new_tokens)
    queue.reverse()
    active: list[_Request] = []

    def guarded(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        site = sites.get(name)
        if site is None:
            return None
        start = time.perf_counter()
        flags = site(tensor)
        result.guard_seconds += time.perf_counter() - start
        return flags  # type: ignore[no-any-return]

    def fault(kind: str) -> int | None:
        # Draft faults can only strike on verify steps: scale them to the same rate per step.
        rate = config.fault_rate * (config.spec_every if kind == "draft" else 1)
        if active and rng.random() < rate:
            result.injected[kind] += 1
            return rng.randrange(len(active))
        return None

    with torch.inference_mode():
        while queue or active:
            while queue and len(active) < config.concurrency:
                active.append(queue.pop())
            step_start = time.perf_counter()
            try:
                abort = _step(config, model, active, result, guarded, fault, rng, overflow_rows)
            except (RuntimeError, IndexError) as exc:
                result.crashed = f"step {result.steps}: {type(exc).__name__}: {exc}"
                break
            finally:
                result.step_seconds += time.perf_counter() - step_start
            result.steps += 1
            keep: list[_Request] = []
            for row, request in enumerate(active):
                if row in abort:
                    result.aborted += 1
                elif request.generated >= request.budget:
                    result.finished += 1
                else:
                    keep.append(request)
            active = keep
            if progress is not None:
                progress(result, len(queue) + len(active))
    return result


def _step(
    config: DemoConfig,
    model: TinyDecoder,
    active: list[_Request],
    result: DemoResult,
    guarded: Callable[[str, torch.Tensor], torch.Tensor | None],
    fault: Callable[[str], int | None],
    rng: random.Random,
    overflow_rows: list[int],
) -> set[int]:
    """One decode step for every active request; returns the rows to abort."""
    width = max(len(r.tokens) for r in active)
    batch = torch.tensor([[0] * (width - len(r.tokens)) + r.tokens for r in active])
    abort: set[int] = set()

    row = fault("overflow")
    overflow_rows[:] = [] if row is None else [row]
    logits = model(batch)[:, -1]  # [rows, vocab] float16
    overflow_rows[:] = []

    row = fault("glitch")
    if row is not None:
        cols = torch.randint(config.vocab, (3,))
        logits[row, cols[:2]] = math.nan
        logits[row, cols[2]] = math.inf
    # A grammar mask: some requests may only use part of the vocabulary...
    logits[::3, config.vocab // 2 :] = -math.inf
    # ...and an over-eager one leaves a request nothing at all.
    row = fault("overmask")
    if row is not None:
        logits[row] = -math.inf

    flags = guarded("logits", logits)
    if flags is not None:
        abort.update(_rows(flags, _ABORT))
        result.rows_healed += int((flags != 0).sum())
    else:
        # Unguarded greedy decoding would silently pick a NaN's index: count that garbage.
        result.garbage_tokens += int(logits.isnan().any(-1).sum())

    probs = torch.softmax(logits.float() / config.temperature, dim=-1)
    ids = torch.multinomial(probs, 1).squeeze(1)
    row = fault("oob")
    if row is not None:
        ids[row] = config.vocab + 5  # a faulty sampler
    id_flags = guarded("ids", ids)
    if id_flags is not None:
        abort.update(_rows(id_flags, _ABORT))
    model.embed(ids)  # the next step's lookup: an out-of-vocab id fails here unguarded

    if result.steps % config.spec_every == 0:
        draft = ids.clone()
        verify = model(torch.cat([batch, draft[:, None]], 1), positions=2)  # [rows, 2, vocab]
        row = fault("draft")
        if row is not None:
            verify[row, 1, : config.vocab // 4] = math.inf
            verify[row, 1, config.vocab // 4 :] = math.nan
        guarded("verify", verify)
        accept = verify[:, 1].float().argmax(-1)
    else:
        accept = None

    for i, request in enumerate(active):
        if i in abort:
            continue
        request.tokens.append(int(ids[i]))
        request.generated += 1
        result.tokens += 1
        if accept is not None and request.generated < request.budget and rng.random() < 0.5:
            request.tokens.append(int(accept[i]))
            request.generated += 1
            result.tokens += 1
    return abort


def _rows(flags: torch.Tensor, mask: int) -> list[int]:
    return [i for i, v in enumerate(flags.tolist()) if v & mask]


def progress_bar(total: int, stream: TextIO = sys.stderr) -> Callable[[DemoResult, int], None]:
    """A one-line progress bar for a terminal (plain lines when not a TTY)."""
    interactive = stream.isatty()
    last = [0.0]

    def show(result: DemoResult, remaining: int) -> None:
        done = total - remaining
        now = time.monotonic()
        if not interactive and done != total and now - last[0] < 2.0:
            return
        last[0] = now
        filled = int(30 * done / max(total, 1))
        line = (
            f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} requests  "
            f"step {result.steps}  tokens {result.tokens}  healed {result.rows_healed}  "
            f"aborted {result.aborted}"
        )
        stream.write(("\r" + line) if interactive else line + "\n")
        if interactive and done == total:
            stream.write("\n")
        stream.flush()

    return show
