"""Compiled code keeps the guard: `torch.compile` (inductor on the CPU) gives the values, flags
and counts of the eager call, for every site kind and dtype, with no graph break.

Each compiled case is checked against the same call made eagerly at an identical, separate
`Guardrails` instance on a copy of the same tensor: the eager call is what the rest of the
contract tests hold to the oracle.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from guardrails import Guardrails, RowFlag
from guardrails.testing import fresh_guardrails

LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TOKEN_DTYPES = [torch.int64, torch.int32]
LOGITS_KINDS = ("nan", "posinf", "all_nan", "all_neginf", "neginf_mask", "clean")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _bits(x: torch.Tensor) -> torch.Tensor:
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(view) if x.is_floating_point() else x


def _logits_case(shape: tuple[int, ...], dtype: torch.dtype, kind: str, row: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((shape, kind, row)) % 2**31)
    x = torch.randn(shape, generator=gen).to(dtype)
    rows = x.view(-1, shape[-1])
    row %= rows.shape[0]
    if kind == "nan":
        rows[row, [1, shape[-1] - 1]] = math.nan
    elif kind == "posinf":
        rows[row, 2] = math.inf
    elif kind == "all_nan":
        rows[row] = math.nan
    elif kind == "all_neginf":
        rows[row] = -math.inf
    elif kind == "neginf_mask":
        rows[row, : shape[-1] // 2] = -math.inf
    return x


def _pair(**settings: object) -> tuple[Guardrails, Guardrails]:
    return fresh_guardrails(**settings), fresh_guardrails(**settings)  # type: ignore[arg-type]


def _same_counts(compiled: Guardrails, eager: Guardrails) -> None:
    assert compiled.counts() == eager.counts()


def test_the_issue_snippet_flags_heals_and_counts_under_compile() -> None:
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x * 2.0
        flags = site(x)
        return torch.softmax(x, -1), flags

    compiled = torch.compile(step)
    for row in range(3):
        x = torch.randn(4, 64)
        x[row, 3] = math.nan
        probs, flags = compiled(x)
        expected = [0, 0, 0, 0]
        expected[row] = int(RowFlag.NAN)
        assert flags.tolist() == expected
        assert not probs.isnan().any()
        assert float(probs[row, 3]) == 0.0  # NaN became -inf: never sampled
    assert guards.count("sampler.logits", "nan") == 3
    assert guards.count("sampler.logits", "rows_nonfinite") == 3
    assert guards.count("sampler.logits", "calls") == 3


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
def test_compiled_logits_step_equals_the_eager_call(dtype: torch.dtype) -> None:
    compiled_guards, eager_guards = _pair(sites={"sampler.logits": {"count_neginf": True}})
    site = compiled_guards.site("sampler.logits")
    eager_site = eager_guards.site("sampler.logits")

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 1.0  # the guarded tensor is an intermediate, as engine logits are
        flags = site(y)
        return y, flags

    compiled = torch.compile(step)
    shapes = [(4, 96), (5, 96), (7, 96), (2, 3, 40), (1, 96)]
    for index, (shape, kind) in enumerate(
        (shape, kind) for shape in shapes for kind in LOGITS_KINDS
    ):
        x = _logits_case(shape, dtype, kind, row=index)
        out, flags = compiled(x.clone())
        expected = x.clone()
        expected_flags = eager_site(expected).clone()
        assert torch.equal(_bits(out), _bits(expected)), (shape, kind)
        assert torch.equal(flags, expected_flags), (shape, kind)
    _same_counts(compiled_guards, eager_guards)
    assert compiled_guards.count("sampler.logits", "calls") == len(shapes) * len(LOGITS_KINDS)


@pytest.mark.parametrize("sanitize", [True, False], ids=["sanitize", "detect_only"])
def test_compiled_call_heals_the_callers_tensor_in_place(sanitize: bool) -> None:
    guards = fresh_guardrails(sanitize=sanitize)
    site = guards.site("sampler.logits")
    compiled = torch.compile(lambda x: site(x), fullgraph=True)
    x = torch.randn(3, 50)
    x[1, 7], x[2, 9] = math.nan, math.inf
    original = x.clone()
    flags = compiled(x)
    assert flags.tolist() == [0, int(RowFlag.NAN), int(RowFlag.POSINF)]
    if sanitize:
        assert x[1, 7] == -math.inf
        assert math.isfinite(float(x[2, 9]))
        assert x[2, 9] > x[2].masked_fill(torch.arange(50) == 9, -math.inf).max()
    else:
        assert torch.equal(x.isnan(), original.isnan())
        assert x[2, 9] == math.inf


@pytest.mark.parametrize("dtype", TOKEN_DTYPES, ids=str)
def test_compiled_token_step_equals_the_eager_call(dtype: torch.dtype) -> None:
    compiled_guards, eager_guards = _pair()
    site = compiled_guards.token_site("sampler.token_ids", vocab_size=100)
    eager_site = eager_guards.token_site("sampler.token_ids", vocab_size=100)

    def step(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flags = site(ids)
        return ids + 0, flags

    compiled = torch.compile(step)
    cases = [
        torch.tensor([3, 150, 7], dtype=dtype),
        torch.tensor([-1, 2, 99, 100], dtype=dtype),
        torch.tensor([[1, 2], [400, 3], [5, -6]], dtype=dtype),
        torch.tensor(120, dtype=dtype),
        torch.tensor([4, 5], dtype=dtype),
    ]
    for ids in cases:
        out, flags = compiled(ids.clone())
        expected = ids.clone()
        assert torch.equal(flags, eager_site(expected).clone()), ids
        assert torch.equal(out, expected), ids
    _same_counts(compiled_guards, eager_guards)
    assert compiled_guards.count("sampler.token_ids", "oob_token") == 6


def test_fullgraph_compiles_with_no_graph_break() -> None:
    guards = fresh_guardrails()
    logits_site = guards.site("sampler.logits")
    token_site = guards.token_site("sampler.token_ids", vocab_size=64)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flags = logits_site(x)
        ids = x.argmax(-1)
        return ids, flags, token_site(ids)

    x = torch.randn(4, 64)
    x[0] = math.nan
    explained = torch._dynamo.explain(step)(x.clone())
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    ids, flags, id_flags = torch.compile(step, fullgraph=True)(x)
    assert flags.tolist()[0] == int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)
    assert id_flags.tolist() == [0, 0, 0, 0]
    assert int(ids[0]) == 0  # the uniform row's first entry: argmax of all zeros


def test_compiled_calls_add_host_time_from_the_ops_eager_run() -> None:
    """The clock is read after the compile branch: nothing of it is traced (no graph break
    under fullgraph), and each run of the compiled op times the eager call it makes."""
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")
    compiled = torch.compile(lambda x: site(x), fullgraph=True)
    compiled(torch.randn(4, 32))
    spent = guards.host_time.spent
    first = spent["site:sampler.logits"]
    assert first > 0
    compiled(torch.randn(4, 32))
    assert spent["site:sampler.logits"] > first
    assert site.calls == 2


def test_dynamic_shapes_cover_every_batch_size_with_one_graph() -> None:
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")
    compiled = torch.compile(lambda x: site(x), dynamic=True, fullgraph=True)
    for rows in range(2, 10):
        x = torch.randn(rows, 32)
        x[rows - 1, 0] = math.nan
        assert compiled(x).tolist() == [0] * (rows - 1) + [int(RowFlag.NAN)]
    assert counters["stats"]["unique_graphs"] == 1
    # torch specialises size 1 even under dynamic=True: one graph more, and no other.
    assert compiled(torch.full((1, 32), math.nan)).tolist() == [
        int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)
    ]
    assert counters["stats"]["unique_graphs"] <= 2
    assert guards.count("sampler.logits", "nan") == 8 + 32


def test_changing_batch_sizes_recompile_at_most_once() -> None:
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")
    compiled = torch.compile(lambda x: site(x))
    for rows in (1, 2, 3, 5, 8, 13, 21, 34):
        compiled(torch.randn(rows, 48))
    # The first shape compiles static, the second marks the batch dynamic; no more after.
    assert counters["stats"]["unique_graphs"] <= 2
    assert guards.count("sampler.logits", "calls") == 8


def test_reduce_overhead_mode_keeps_values_flags_and_counts() -> None:
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flags = site(x)
        return x.softmax(-1), flags

    compiled = torch.compile(step, mode="reduce-overhead")
    for row in range(4):
        x = torch.randn(4, 40)
        x[row] = math.nan
        probs, flags = compiled(x)
        assert flags.tolist()[row] == int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)
        assert not probs.isnan().any()
    assert guards.count("sampler.logits", "rows_no_valid_token") == 4


def test_compiled_call_in_inference_mode_heals_inference_tensors() -> None:
    guards = fresh_guardrails()
    site = guards.site("sampler.logits")
    compiled = torch.compile(lambda x: site(x))
    with torch.inference_mode():
        x = torch.randn(2, 16)
        x[0, 1] = math.nan
        flags = compiled(x)
    assert flags.tolist() == [int(RowFlag.NAN), 0]
    assert x[0, 1] == -math.inf


def test_a_logits_dtype_the_site_refuses_raises_type_error_under_compile() -> None:
    site = fresh_guardrails(sites={"sampler.logits": {"dtypes": ["float32"]}}).site(
        "sampler.logits"
    )
    tensor = torch.zeros(3, 4, dtype=torch.float16)
    with pytest.raises(TypeError, match="not accepted"):
        torch.compile(lambda x: site(x))(tensor)
    assert torch.equal(tensor, torch.zeros(3, 4, dtype=torch.float16))


def test_zero_dim_logits_fail_while_tracing_with_the_eager_value_error() -> None:
    site = fresh_guardrails().site("sampler.logits")
    tensor = torch.tensor(math.nan)
    # torch._dynamo reports an error of a fake implementation as its own TorchRuntimeError,
    # quoting the ValueError the eager call raises.
    with pytest.raises(RuntimeError, match=r"ValueError.*must have a vocab dimension, got a 0-d"):
        torch.compile(lambda x: site(x))(tensor)
    assert tensor.isnan()


def test_a_token_id_tensor_of_a_float_dtype_raises_type_error_under_compile() -> None:
    site = fresh_guardrails().token_site("sampler.token_ids", vocab_size=8)
    with pytest.raises(TypeError, match="integer tensor"):
        torch.compile(lambda ids: site(ids))(torch.zeros(3))


def test_a_disabled_site_stays_a_no_op_under_compile() -> None:
    guards = fresh_guardrails(enabled=False)
    site = guards.site("sampler.logits")
    x = torch.full((2, 8), math.nan)
    assert torch.compile(lambda x: site(x), fullgraph=True)(x) is None
    assert x.isnan().all()


def test_the_op_refuses_a_key_that_names_no_live_site() -> None:
    from guardrails.sites import ops

    guards = fresh_guardrails()
    key = guards.site("sampler.logits")._op_key
    x = torch.full((2, 8), math.nan)
    assert ops.guard_logits_(x, key).tolist() == [int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)] * 2
    del guards
    gc.collect()
    # A key whose site was dropped: guarding with nothing behind it would be a silent no-op.
    with pytest.raises(RuntimeError, match="no longer exists"):
        ops.guard_logits_(torch.full((2, 8), math.nan), key)


@pytest.mark.cuda
def test_reduce_overhead_on_cuda_replays_the_kernel_with_exact_device_counts() -> None:
    pytest.importorskip("triton")
    compiled_guards, eager_guards = _pair(reporting={"every_calls": 1_000_000})
    site = compiled_guards.site("sampler.logits", device="cuda", capacity=8)
    eager_site = eager_guards.site("sampler.logits", device="cuda", capacity=8)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 1.0
        flags = site(y)
        return y.softmax(-1), flags

    compiled = torch.compile(step, mode="reduce-overhead")
    for i in range(12):  # warm-up, recording, then replays of the CUDA graph
        x = torch.randn(8, 4096, device="cuda")
        x[i % 8, : i + 1] = math.nan
        x[(i + 3) % 8, 5] = math.inf
        probs, flags = compiled(x.clone())
        expected = x.clone()
        expected_flags = eager_site(expected).clone()
        assert torch.equal(flags, expected_flags)
        assert torch.equal(probs, expected.softmax(-1))
    torch.cuda.synchronize()
    compiled_counts = {k: v for k, v in compiled_guards.counts().items() if k[1] != "calls"}
    eager_counts = {k: v for k, v in eager_guards.counts().items() if k[1] != "calls"}
    assert compiled_counts == eager_counts
    # Calls are counted where the op runs in Python: not on graph replays.
    assert 1 <= compiled_guards.count("sampler.logits", "calls") <= 12


@pytest.mark.parametrize(("site_vocab", "call_vocab"), [(1000, 100), (100, 1000)])
@pytest.mark.parametrize("options", [{}, {"fullgraph": True, "dynamic": True}])
def test_a_compiled_token_call_guards_against_the_vocabulary_it_passes(
    site_vocab: int, call_vocab: int, options: dict[str, bool]
) -> None:
    # Every `vocab_size_from` patch passes the vocabulary per call (issue 21, defect 1).
    compiled_guards, eager_guards = _pair()
    site = compiled_guards.token_site("sampler.token_ids", vocab_size=site_vocab)
    eager_site = eager_guards.token_site("sampler.token_ids", vocab_size=site_vocab)

    def step(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return site(ids, logits.shape[-1])

    compiled = torch.compile(step, **options)
    ids = torch.tensor([5, 150, 999])
    flags = compiled(ids, torch.zeros(3, call_vocab))
    expected = torch.tensor([5, 150, 999])
    assert torch.equal(flags, eager_site(expected, call_vocab).clone())
    assert torch.equal(ids, expected)
    if call_vocab == 100:
        assert ids.tolist() == [5, 0, 0]  # 150 and 999 are outside [0, 100)
    else:
        assert ids.tolist() == [5, 150, 999]  # all valid in [0, 1000)
    _same_counts(compiled_guards, eager_guards)


@pytest.mark.parametrize("op", ["logits", "token_ids"])
def test_the_ops_pass_torch_library_opcheck(op: str) -> None:
    from guardrails.sites import ops

    guards = fresh_guardrails()
    if op == "logits":
        key = guards.site("sampler.logits")._op_key
        x = torch.randn(4, 16)
        x[1, 3] = math.nan
        torch.library.opcheck(ops.guard_logits_, (x, key))
    else:
        key = guards.token_site("sampler.token_ids", vocab_size=16)._op_key
        torch.library.opcheck(ops.guard_token_ids_, (torch.tensor([1, 40, 3]), key, 16))
