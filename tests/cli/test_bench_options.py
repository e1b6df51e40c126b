"""`guardrails bench` output: the table once, files only where asked, a warning on a busy
machine."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from guardrails.cli.bench import measure as bench
from guardrails.cli.bench.command import load_warning
from guardrails.cli.main import main


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One smoke run from an empty working directory, without --out."""
    where = tmp_path_factory.mktemp("cwd")
    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        patch.chdir(where)
        assert main(["bench", "--smoke", "--device", "cpu"]) == 0
    return where, out.getvalue(), err.getvalue()


def is_row(line: str) -> bool:
    return line.split()[:1] in (["float32"], ["bfloat16"], ["float16"])


def test_smoke_prints_its_table_once(smoke: tuple[Path, str, str]) -> None:
    _, out, err = smoke
    config = bench.BenchConfig.smoke()
    cases = len(config.batches) * len(config.dtypes) * 2
    assert len([line for line in (out + err).splitlines() if is_row(line)]) == cases
    assert out.count("guardrails bench on ") == 1
    # Progress is one short line per case, on stderr.
    assert err.count("measured ") == cases


def test_results_are_written_only_where_asked(smoke: tuple[Path, str, str]) -> None:
    where, out, _ = smoke
    assert list(where.iterdir()) == []
    assert "wrote " not in out


@pytest.mark.parametrize(
    ("load", "cores", "busy"),
    [(1.5, 2, True), (0.9, 2, False), (8.0, 16, False), (9.0, 16, True), (0.6, 1, True)],
)
def test_a_busy_machine_gets_a_warning(load: float, cores: int, busy: bool) -> None:
    warning = load_warning(load, cores)
    assert (warning is not None) == busy
    if warning is not None:
        assert f"load average {load:.2f} on {cores} core" in warning
