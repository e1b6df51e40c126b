"""The settings keys integrations read: `[[attach]]` entries and per-site `abort_on`."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardrails import ConfigError, GuardSettings, RowFlag

GOOD = 'site = "sampler.logits"\ntarget = "pkg.mod:Sampler.forward"\n'


def load(tmp_path: Path, text: str, **environ: str) -> GuardSettings:
    path = tmp_path / "guardrails.toml"
    path.write_text(text, encoding="utf-8")
    return GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path), **environ})


def problems(tmp_path: Path, text: str, **environ: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, **environ)
    return [str(p) for p in caught.value.problems]


def test_attach_entries_parse_with_defaults(tmp_path: Path) -> None:
    settings = load(tmp_path, "[[attach]]\n" + GOOD)
    (entry,) = settings.attach
    assert (entry.site, entry.target, entry.tensor, entry.kind) == (
        "sampler.logits",
        "pkg.mod:Sampler.forward",
        "return",
        "logits",
    )


def test_a_bad_target_is_named_by_its_file_key(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, '[[attach]]\nsite = "sampler.logits"\ntarget = "pkg.mod.f"\n')
    assert problem.startswith(f"{tmp_path / 'guardrails.toml'}: attach[0].target='pkg.mod.f'")
    assert "a ':' must separate the module path" in problem


@pytest.mark.parametrize(
    "target",
    [
        "os:system('rm -rf /')",
        "__import__('os'):system",
        "pkg.mod:Sampler.forward()",
        "pkg.mod:Sampler[0]",
        "pkg mod:f",
        "pkg.mod:",
    ],
)
def test_code_is_never_a_target(tmp_path: Path, target: str) -> None:
    found = problems(tmp_path, f'[[attach]]\nsite = "sampler.logits"\ntarget = """{target}"""\n')
    assert any("attach[0].target" in p and "not an import path" in p for p in found), found


@pytest.mark.parametrize(
    "tensor", ["ret", "arg:", "arg:x()", "return[0]", "arg:x.__class__()", "return:-1"]
)
def test_a_bad_tensor_reference_is_named_by_its_file_key(tmp_path: Path, tensor: str) -> None:
    (problem,) = problems(tmp_path, f'[[attach]]\n{GOOD}tensor = """{tensor}"""\n')
    assert "attach[0].tensor" in problem
    assert "not a reference" in problem


def test_an_unknown_key_in_an_entry_names_the_entry_and_the_keys(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, f"[[attach]]\n{GOOD}\n[[attach]]\n{GOOD}tensr = 'arg:0'\n")
    assert "attach[1].tensr: unknown key; did you mean 'tensor'?" in problem
    assert "vocab_size_from" in problem  # the accepted keys are listed


def test_token_ids_need_a_vocab_size(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, f'[[attach]]\n{GOOD}kind = "token_ids"\n')
    assert "attach[0]" in problem
    assert "vocab_size" in problem


def test_logits_take_no_vocab_size(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, f"[[attach]]\n{GOOD}vocab_size = 10\n")
    assert "attach[0]" in problem


def test_one_site_name_has_one_kind(tmp_path: Path) -> None:
    text = (
        f"[[attach]]\n{GOOD}\n[[attach]]\n{GOOD}"
        'kind = "token_ids"\nvocab_size_from = "arg:logits"\n'
    )
    (problem,) = problems(tmp_path, text)
    assert "attach[1].kind='token_ids': site 'sampler.logits' is a logits site in attach[0]" in (
        problem
    )


def test_an_attach_site_is_a_declared_site_for_enable_lists(tmp_path: Path) -> None:
    text = '[[attach]]\nsite = "engine.custom"\ntarget = "pkg.mod:f"\n'
    settings = load(tmp_path, text, GUARDRAILS_SITES="engine.custom")
    assert settings.is_site_enabled("engine.custom")


def test_an_invalid_site_name_is_named_by_its_file_key(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, '[[attach]]\nsite = "my site"\ntarget = "pkg.mod:f"\n')
    assert "attach[0].site='my site'" in problem


def test_abort_on_is_a_row_flag_mask(tmp_path: Path) -> None:
    settings = load(tmp_path, '[sites."sampler.logits"]\nabort_on = ["no_valid_token", "NAN"]\n')
    site = settings.site_settings("sampler.logits")
    assert site.abort_on == ("no_valid_token", "nan")
    assert site.abort_flags == int(RowFlag.NO_VALID_TOKEN | RowFlag.NAN)


def test_abort_on_defaults_to_heal(tmp_path: Path) -> None:
    assert load(tmp_path, "").site_settings("sampler.logits").abort_flags == 0


def test_an_unknown_abort_flag_is_named_by_its_file_key(tmp_path: Path) -> None:
    text = '[sites."sampler.logits"]\nabort_on = ["no_valid_tokn"]\n'
    (problem,) = problems(tmp_path, text)
    assert 'sites."sampler.logits".abort_on' in problem
    assert "unknown row flag 'no_valid_tokn'" in problem
