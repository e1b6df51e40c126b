"""The Triton kernel's device code, run by Triton's interpreter on the CPU.

`TRITON_INTERPRET=1` must be set when a `@triton.jit` function is decorated, and while it
runs. Rather than set it at import (pytest imports every test module before running any, so
it would hold for the whole session and for every subprocess other tests start), this
module-scoped fixture sets it only while the tests of the module that asks for it run, and
loads a private copy of the device-code module under another name.
`guardrails.kernels._triton_kernel`, if anything else imports it, stays a normally compiled
module: no other test meets an interpreted kernel or the variable (which matters on a GPU
machine, where the CUDA tests may run in the same session). The kernel calls only Triton
builtins, so this copy runs in the interpreter even though `triton` itself was imported, by
then, in compiled mode.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def triton_device_code() -> Iterator[ModuleType]:
    pytest.importorskip("triton")
    from guardrails.kernels import triton_impl

    path = Path(triton_impl.__file__).with_name("_triton_kernel.py")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("guardrails_interpreted_kernel", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
