"""Installs guardrails in a process started under `guardrails run` (via PYTHONPATH).

Runs a pre-existing `sitecustomize` found further down `sys.path` first, so launching under
guardrails never hides the environment's own start-up code, then calls
`guardrails.integrations.launcher.bootstrap()`. An interpreter without guardrails installed
(another Python the command happens to start) is told so on stderr and runs unguarded.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _install() -> None:
    try:
        from guardrails.integrations.launcher import bootstrap
    except ImportError as exc:
        sys.stderr.write(
            f"guardrails: not importable in {sys.executable} ({exc}); this process runs unguarded\n"
        )
        return
    bootstrap()


try:
    _chain()
finally:
    _install()
