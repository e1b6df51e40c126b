from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.e2e.sglang.serve")

from tests import tiny_llama  # noqa: E402  (after the rewrite hook)
from tests.e2e.server import Server  # noqa: E402
from tests.e2e.sglang.serve import serving  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny bfloat16 Llama whose trigger word's embedding row is NaN."""
    return tiny_llama.save(tmp_path_factory.mktemp("tiny-llama"), tiny_llama.FAULT_NAN_ROW)


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same server without guardrails (SGLang's allowlist leaves it out): what the
    guarded one is compared with."""
    log = tmp_path_factory.mktemp("plain") / "server.log"
    with serving(model_dir, log, way="unguarded") as server:
        yield server


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    with serving(model_dir, log) as server:
        yield server
