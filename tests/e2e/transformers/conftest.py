from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiny_llama
from tests.e2e.server import Server
from tests.e2e.transformers.serve import CB_ARGS, serving


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GenerationConfig

    path = tiny_llama.save(tmp_path_factory.mktemp("tiny-llama"))
    # From 5.25 on, continuous batching sets a request's sampling only through the processors
    # the model's own generation config makes: with no top-k there, a temperature-0 request's
    # top_k=1 is dropped and it samples. A top-k of the whole vocabulary filters nothing (the
    # other modes and versions sample and decode as before) and makes that processor.
    config = GenerationConfig.from_pretrained(path)
    config.top_k = tiny_llama.VOCAB
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(model_dir, tmp_path_factory.mktemp("plain") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def batching(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("batching") / "server.log"
    with serving(model_dir, log, "--continuous-batching", *CB_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def batching_sampled(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("batching-sampled") / "server.log"
    with serving(model_dir, log, "--continuous-batching", *CB_ARGS) as server:
        yield server
