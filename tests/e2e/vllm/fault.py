"""TEST ONLY: the NaN-row fault switched off and on inside a running vLLM server.

A worker extension (vLLM's `--worker-extension-cls`, mixed into every worker) whose method the
dev server's `POST /collective_rpc` calls (`VLLM_SERVER_DEV_MODE=1`): it rewrites the trigger's
embedding row in the model the worker serves, in place. Healed, the row is a copy of
`SUBSTITUTE`'s, so a prompt holding the trigger then answers exactly as the same prompt with
`SUBSTITUTE` in its place (the embedding is the only weight that reads a prompt's token ids:
the model's word embeddings are not tied to its lm_head). vLLM's compiled graph reads the
parameter at every step, so the change reaches the next step. A transient fault is what the
"retry once the fault is gone" check needs: the poisoned KV stays wherever vLLM kept it.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tests.e2e.prompts import SUBSTITUTE_ID, TRIGGER_ID

if TYPE_CHECKING:
    from tests.e2e.server import Server

EXTENSION = "tests.e2e.vllm.fault.FaultSwitch"


class FaultSwitch:
    """Mixed into vLLM's Worker; `self.model_runner` is the worker's."""

    def guardrails_e2e_fault(self, state: str) -> str:
        weight = self.model_runner.get_model().model.embed_tokens.weight  # type: ignore[attr-defined]
        with torch.no_grad():
            if state == "on":
                weight[TRIGGER_ID] = float("nan")
            elif state == "off":
                weight[TRIGGER_ID] = weight[SUBSTITUTE_ID]
            else:
                raise ValueError(f"fault state {state!r}: on or off")
        return state


def switch(server: Server, state: str) -> None:
    """Every worker's fault on or off, through the dev server's /collective_rpc."""
    body = json.dumps({"method": "guardrails_e2e_fault", "args": [state]}).encode()
    request = urllib.request.Request(
        f"{server.base_url}/collective_rpc",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        results = json.loads(reply.read())["results"]
    assert results, "no worker answered"
    assert set(results) == {state}, results


@contextlib.contextmanager
def off(server: Server) -> Iterator[None]:
    """The fault gone for the block (every worker's trigger row healed), then back."""
    switch(server, "off")
    try:
        yield
    finally:
        switch(server, "on")
