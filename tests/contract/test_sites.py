"""The site API, by example: names and kinds, flags and counts per call, modes (disabled,
async assert, per-site sanitize), autograd and inference tensors, the default instance,
closing, threads. What each call does to the values is held to the oracle in
`test_logits_contract.py`; rejected inputs are fuzzed in `test_site_inputs.py`; token-id
sites are `test_token_ids.py`."""

from __future__ import annotations

import math

import pytest
import torch

import guardrails as gr
from guardrails.testing import fresh_guardrails, inject_, reset_default


def _logits(rows: int = 4, vocab: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)


# -- sites --------------------------------------------------------------------------------


def test_same_name_returns_the_same_site(guards: gr.Guardrails) -> None:
    assert guards.site("sampler.logits") is guards.site("sampler.logits")
    assert guards.token_site("sampler.token_ids", vocab_size=8) is guards.token_site(
        "sampler.token_ids", vocab_size=8
    )


def test_a_name_keeps_its_kind(guards: gr.Guardrails) -> None:
    guards.site("sampler.logits")
    with pytest.raises(ValueError, match="logits site"):
        guards.token_site("sampler.logits", vocab_size=8)
    guards.token_site("sampler.token_ids", vocab_size=8)
    with pytest.raises(ValueError, match="token-id site"):
        guards.site("sampler.token_ids")
    with pytest.raises(ValueError, match="vocab_size=8"):
        guards.token_site("sampler.token_ids", vocab_size=9)


@pytest.mark.parametrize("name", ["", "has space", "x" * 101, "new\nline", 3])
def test_invalid_site_names_are_rejected(guards: gr.Guardrails, name: object) -> None:
    with pytest.raises(ValueError, match="invalid site name"):
        guards.site(name)  # type: ignore[arg-type]


def test_custom_site_names_work_with_the_default_enable_list(guards: gr.Guardrails) -> None:
    x = _logits()
    inject_(x, rows=[0])
    flags = guards.site("my-engine.lm_head:0")(x)
    assert flags is not None
    assert flags[0] == gr.RowFlag.NAN


def test_flags_are_one_uint8_per_row_of_any_leading_shape(guards: gr.Guardrails) -> None:
    x = torch.randn(2, 3, 16)
    x[1, 2, 5] = math.inf
    flags = guards.site("sampler.logits")(x)
    assert flags is not None
    assert flags.shape == (6,)
    assert flags.dtype == torch.uint8
    assert flags.tolist() == [0, 0, 0, 0, 0, int(gr.RowFlag.POSINF)]


def test_one_dimensional_logits_are_one_row(guards: gr.Guardrails) -> None:
    x = torch.full((8,), math.nan)
    flags = guards.site("sampler.logits")(x)
    assert flags is not None
    assert flags.tolist() == [gr.RowFlag.NAN | gr.RowFlag.NO_VALID_TOKEN]
    assert bool((x == 0).all())


def test_clean_call_after_a_dirty_one_returns_zero_flags(guards: gr.Guardrails) -> None:
    site = guards.site("sampler.logits")
    dirty = _logits(rows=8)
    inject_(dirty, rows=[1, 7])
    assert site(dirty).tolist().count(0) == 6  # type: ignore[union-attr]
    assert site(_logits(rows=4)).tolist() == [0] * 4  # type: ignore[union-attr]
    assert site(_logits(rows=8)).tolist() == [0] * 8  # type: ignore[union-attr]


def test_buffers_grow_for_larger_batches(guards: gr.Guardrails) -> None:
    site = guards.site("sampler.logits")
    x = _logits(rows=1000, vocab=4)
    inject_(x, rows=[999], kind="posinf")
    flags = site(x)
    assert flags is not None
    assert flags.shape == (1000,)
    assert flags[999] == gr.RowFlag.POSINF


def test_counts_accumulate_exactly_over_calls(guards: gr.Guardrails) -> None:
    site = guards.site("sampler.logits")
    total_nan = 0
    for step in range(20):
        x = _logits(rows=6, vocab=128)
        total_nan += inject_(x, rows=[step % 6], count=step % 4)
        site(x)
    assert guards.count("sampler.logits", "nan") == total_nan
    assert guards.count("sampler.logits", "calls") == 20


def test_empty_batch_is_a_no_op(guards: gr.Guardrails) -> None:
    flags = guards.site("sampler.logits")(torch.empty(0, 32))
    assert flags is not None
    assert flags.shape == (0,)
    assert guards.count("sampler.logits", "rows_nonfinite") == 0


def test_zero_vocab_rows_have_no_valid_token(guards: gr.Guardrails) -> None:
    flags = guards.site("sampler.logits")(torch.empty(3, 0))
    assert flags is not None
    assert flags.tolist() == [int(gr.RowFlag.NO_VALID_TOKEN)] * 3
    assert guards.count("sampler.logits", "rows_no_valid_token") == 3


def test_float64_logits_are_guarded(guards: gr.Guardrails) -> None:
    x = _logits(dtype=torch.float64)
    x[0, 0] = math.inf
    guards.site("sampler.logits")(x)
    assert x[0, 0] == 1e30


# -- bad input (the other rejections are fuzzed in test_site_inputs.py) -------------------


def test_tensor_on_another_device_than_the_site_is_a_value_error() -> None:
    # (A site can no longer be pinned to the meta device, the one other device every machine
    # has: the tensor is on meta here.)
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits", device="cpu")
        with pytest.raises(ValueError, match="created for device cpu; got a tensor on meta"):
            site(torch.full((2, 4), math.nan, device="meta"))


# -- host time ------------------------------------------------------------------------------


def test_every_call_adds_its_host_time_under_its_sites_part() -> None:
    with fresh_guardrails() as guards:
        logits = guards.site("sampler.logits")
        tokens = guards.token_site("sampler.token_ids", vocab_size=8)
        spent = guards.host_time.spent
        assert "site:sampler.logits" not in spent  # a site that has not run spent nothing
        logits(torch.zeros(2, 8))
        tokens(torch.zeros(2, dtype=torch.int64))
        first = spent["site:sampler.logits"], spent["site:sampler.token_ids"]
        assert min(first) > 0
        logits(torch.full((2, 8), math.nan))  # dirty: the kernel's time too
        tokens(torch.tensor([3, 99]))
        assert spent["site:sampler.logits"] > first[0]
        assert spent["site:sampler.token_ids"] > first[1]


def test_a_disabled_site_spends_no_host_time() -> None:
    with fresh_guardrails(disabled_sites=["sampler.*"]) as guards:
        site = guards.site("sampler.logits")
        tokens = guards.token_site("sampler.token_ids", vocab_size=8)
        site(torch.zeros(2, 8))
        tokens(torch.zeros(2, dtype=torch.int64))
        assert not any(part.startswith("site:") for part in guards.host_time.spent)


# -- modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"enabled": False},
        {"disabled_sites": ["sampler.*"]},
        {"enabled_sites": ["eagle.verify"]},
    ],
)
def test_disabled_site_returns_none_and_leaves_tensor_untouched(
    settings: dict[str, object],
) -> None:
    with fresh_guardrails(**settings) as guards:
        site = guards.site("sampler.logits")
        assert isinstance(site, gr.DisabledSite)
        x = torch.full((2, 4), math.nan)
        assert site(x) is None
        assert bool(x.isnan().all())
        assert site(torch.zeros(3, dtype=torch.int64)) is None  # not even looked at
        assert guards.counts() == {}


def test_async_assert_raises_with_the_site_name_after_counting() -> None:
    with fresh_guardrails(async_assert=True) as guards:
        x = _logits()
        inject_(x, rows=[2], count=3)
        with pytest.raises(RuntimeError, match=r"'sampler\.logits'"):
            guards.site("sampler.logits")(x)
        assert guards.count("sampler.logits", "nan") == 3
        guards.site("sampler.logits")(_logits())  # clean calls pass


def test_async_assert_covers_rows_with_no_valid_token() -> None:
    with (
        fresh_guardrails(async_assert=True) as guards,
        pytest.raises(RuntimeError, match="no valid"),
    ):
        guards.site("sampler.logits")(torch.full((2, 4), -math.inf))


def test_async_assert_ignores_neginf_masks() -> None:
    with fresh_guardrails(
        async_assert=True, sites={"model.logits": {"count_neginf": True}}
    ) as guards:
        x = _logits()
        x[:, :10] = -math.inf
        flags = guards.site("model.logits")(x)
        assert flags is not None
        assert bool((flags == gr.RowFlag.NEGINF).all())


def test_async_assert_on_token_ids() -> None:
    with (
        fresh_guardrails(async_assert=True) as guards,
        pytest.raises(RuntimeError, match="out-of-vocab"),
    ):
        guards.token_site("sampler.token_ids", vocab_size=5)(torch.tensor([7]))


def test_per_site_sanitize_overrides_global() -> None:
    with fresh_guardrails(sanitize=False, sites={"eagle.verify": {"sanitize": True}}) as guards:
        a, b = torch.full((1, 4), math.nan), torch.full((1, 4), math.nan)
        guards.site("sampler.logits")(a)
        guards.site("eagle.verify")(b)
        assert bool(a.isnan().all())
        assert bool((b == 0).all())


def test_leaf_requiring_grad_is_healed(guards: gr.Guardrails) -> None:
    x = _logits().requires_grad_()
    with torch.no_grad():
        x[0, 0] = math.nan
    guards.site("sampler.logits")(x)
    assert x[0, 0] == -math.inf


def test_inference_tensor_is_healed_outside_inference_mode(guards: gr.Guardrails) -> None:
    with torch.inference_mode():
        x = _logits()
        x[1, 1] = math.nan
        site = guards.site("sampler.logits")
        site(x)  # buffers first sized inside inference mode
    site(x)
    site(_logits())
    assert x[1, 1] == -math.inf


# -- the default instance -------------------------------------------------------------------


def test_sanitize_logits_uses_the_default_instance_from_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GUARDRAILS_SANITIZE", "false")
    reset_default()
    x = torch.full((1, 4), math.nan)
    flags = gr.sanitize_logits_(x, site="eagle.verify")
    assert flags is not None
    assert flags.tolist() == [gr.RowFlag.NAN | gr.RowFlag.NO_VALID_TOKEN]
    assert bool(x.isnan().all())
    assert gr.default() is gr.default()
    assert gr.default().count("eagle.verify", "nan") == 4


def test_default_instance_reports_bad_env_as_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDRAILS_ENABLED", "nope")
    reset_default()
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_ENABLED"):
        gr.sanitize_logits_(torch.zeros(1, 4))


def test_from_env_applies_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDRAILS_SANITIZE", "true")
    guards = gr.Guardrails.from_env(sanitize=False)
    assert guards.settings.sanitize is False
    guards.close()


def test_close_is_idempotent_and_stops_new_sites(guards: gr.Guardrails) -> None:
    site = guards.site("sampler.logits")
    guards.close()
    guards.close()
    assert guards.closed
    x = _logits()
    x[2, 5] = math.nan
    assert site(x).tolist() == [0, 0, int(gr.RowFlag.NAN), 0]  # existing sites keep guarding
    assert x[2, 5] == -math.inf
    with pytest.raises(RuntimeError, match="closed"):
        guards.site("eagle.verify")


def test_one_site_shared_by_threads_counts_exactly(guards: gr.Guardrails) -> None:
    import threading

    site = guards.site("sampler.logits")
    per_thread, threads = 2000, 4

    def work() -> None:
        x = torch.zeros(2, 8)
        for _ in range(per_thread):
            x[0, 0] = math.nan
            site(x)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert guards.count("sampler.logits", "nan") == per_thread * threads
    assert guards.count("sampler.logits", "calls") == per_thread * threads
