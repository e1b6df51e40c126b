"""The origin rule as a pure function, the mode spellings, and the `[trace]` settings."""

from __future__ import annotations

from pathlib import Path

import pytest

import guardrails as gr
from guardrails.tracing import find_origin, parse_mode

NAMES = ["layers.0", "layers.0.mlp", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "norm"]


def row(step: int = 0, inp: int = 0, out: int = 0, mask: bool = False) -> list[float]:
    """A module row (`guardrails.tracing.ops`): latched at `step` with input and output kind
    bits (1 nan, 2 +inf, 4 -inf); `mask`: seen writing -inf in a step without NaN/+Inf."""
    return [0.0, 1.0, 0.0, 1.0, float(step), float(inp), float(out), 1.0, float(mask)]


def origin_of(*rows: list[float]) -> str | None:
    found = find_origin(NAMES, list(rows), ["float16"] * len(rows))
    return None if found is None else found.module


def test_plain_code_inside_a_module_is_that_modules() -> None:
    # down_proj saw an Inf input: the MLP's own arithmetic made it.
    assert origin_of(row(1, 0, 2), row(1, 0, 1), row(), row(1, 2, 1), row(1, 1, 1)) == (
        "layers.0.mlp"
    )


def test_a_projection_that_overflows_is_named_not_its_parents() -> None:
    assert origin_of(row(1, 0, 2), row(1, 0, 2), row(1, 0, 2), row(1, 2, 1), row(1, 1, 1)) == (
        "layers.0.mlp.up_proj"
    )


def test_the_earliest_step_wins() -> None:
    # norm was born at step 3 (after a reset of nothing), the MLP at step 2.
    assert origin_of(row(2, 0, 2), row(2, 0, 2), row(), row(2, 2, 2), row(3, 0, 1)) == (
        "layers.0.mlp"
    )


def test_nothing_latched_or_only_bad_inputs_names_nothing() -> None:
    assert origin_of(row(), row(), row(), row(), row()) is None
    assert origin_of(row(1, 1, 1), row(1, 1, 1), row(), row(), row(1, 1, 1)) is None


def test_the_kind_is_the_origins_output_kind() -> None:
    found = find_origin(NAMES, [row(1, 0, 6), row(), row(), row(), row()], ["bfloat16"] * 5)
    assert found is not None
    assert (found.kind, found.dtype, found.step) == ("posinf", "bfloat16", 1)


def test_a_nan_or_posinf_origin_wins_over_a_new_neginf() -> None:
    # norm wrote -inf from a finite input in the same step; the MLP made a NaN.
    assert origin_of(row(1, 0, 1), row(1, 0, 1), row(), row(1, 1, 1), row(1, 0, 4)) == (
        "layers.0.mlp"
    )


def test_a_mask_is_never_the_origin() -> None:
    # The NaN came from outside (every NaN output saw a NaN input); norm writes -inf by
    # design, even from an input whose only non-finite values are -inf.
    rows = [row(1, 1, 1), row(1, 1, 1), row(), row(1, 4, 1), row(1, 0, 4, mask=True)]
    assert origin_of(*rows) is None


def test_a_negative_overflow_that_a_nan_follows_is_named() -> None:
    # up_proj overflowed to -inf; down_proj made NaN of it: the -inf is the origin.
    found = find_origin(
        NAMES, [row(1, 0, 5), row(1, 0, 5), row(1, 0, 4), row(1, 4, 1), row(1, 1, 1)], [None] * 5
    )
    assert found is not None
    assert (found.module, found.kind) == ("layers.0.mlp.up_proj", "neginf")


def test_a_neginf_that_no_nan_follows_names_nothing() -> None:
    # up_proj wrote a new -inf, but the NaN came in from outside: no NaN/+Inf followed from
    # a -inf.
    assert origin_of(row(1, 1, 1), row(1, 1, 1), row(1, 0, 4), row(1, 1, 1), row()) is None


@pytest.mark.parametrize(
    ("text", "shown"), [("always", "always"), ("ARMED", "armed"), ("every:16", "every:16")]
)
def test_modes_parse(text: str, shown: str) -> None:
    assert str(parse_mode(text)) == shown


@pytest.mark.parametrize("text", ["", "sometimes", "every:0", "every:-1", "every:x", "every"])
def test_bad_modes_name_the_accepted_ones(text: str) -> None:
    with pytest.raises(ValueError, match="always, armed, or every:N"):
        parse_mode(text)


def test_trace_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDRAILS_TRACE", "model.layers.*, model.norm")
    monkeypatch.setenv("GUARDRAILS_TRACE_MODE", "every:8")
    settings = gr.GuardSettings()
    assert settings.trace.modules == ("model.layers.*", "model.norm")
    assert settings.trace.mode == "every:8"


def test_trace_settings_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text('[trace]\nmodules = ["model.layers.*"]\nmode = "armed"\n')
    settings = gr.GuardSettings(config_file=path)
    assert settings.trace.modules == ("model.layers.*",)
    assert settings.trace.mode == "armed"


def test_a_bad_mode_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GUARDRAILS_TRACE_MODE", "evry:8")
    with pytest.raises(gr.ConfigError, match="GUARDRAILS_TRACE_MODE"):
        gr.GuardSettings()


def test_a_bad_file_key_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text('[trace]\nmodule = ["model.layers.*"]\n')
    with pytest.raises(gr.ConfigError, match=r"trace\.module"):
        gr.GuardSettings(config_file=path)


def test_a_pattern_that_matches_nothing_is_named() -> None:
    from tests.tracing.models import net

    with (
        gr.Guardrails(gr.GuardSettings()) as guards,
        pytest.raises(ValueError, match=r"'layer\.\*' matches no module"),
    ):
        guards.trace(net("mlp"), ["layer.*"])


def test_a_bad_mode_in_code_is_refused() -> None:
    from tests.tracing.models import net

    with gr.Guardrails(gr.GuardSettings()) as guards, pytest.raises(ValueError, match="every:N"):
        guards.trace(net("mlp"), ["layers.*"], mode="every:0")


def test_the_start_event_says_what_is_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    from structlog.testing import capture_logs

    from guardrails.names import STARTED_EVENT

    with capture_logs() as logs:
        gr.Guardrails(gr.GuardSettings()).close()
        monkeypatch.setenv("GUARDRAILS_TRACE", "model.layers.*")
        gr.Guardrails(gr.GuardSettings()).close()
    plain, traced = (e["trace"] for e in logs if e["event"] == STARTED_EVENT)
    assert plain is None
    assert traced == {"modules": ["model.layers.*"], "mode": "always"}
