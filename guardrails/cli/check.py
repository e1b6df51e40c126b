"""`guardrails check [--config FILE] [--strict]`: validate the environment, the settings and the
attach targets, before a deployment does.

Each `[[attach]]` target is imported and checked the way applying it would (module, attribute,
callable, argument), without patching anything. A target whose package is not installed here
(checking an SGLang profile on a laptop) is a warning, an error under `--strict`; every other
problem is an error. Exit 0 with a short summary, 1 with one line per problem, 2 when the
settings themselves are invalid (the `ConfigError` message).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from typing import Any


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "check",
        help="validate the environment, the config file and the attach targets",
        description="Validate GUARDRAILS_* variables, the config file and every [[attach]] "
        "target (importable, attribute exists, callable, argument exists).",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="config file to check instead of $GUARDRAILS_CONFIG_FILE"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="treat targets whose package is not importable here as errors",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from guardrails.attach.patching import inspect_point
    from guardrails.attach.points import AttachPoint
    from guardrails.integrations.launcher import prepare

    _, settings = prepare(os.environ, config_file=args.config)  # ConfigError: exit 2
    print("guardrails check")
    for name, value in _environment():
        print(f"  {name:<13} {value}")
    config = settings.config_file
    print(f"  {'config':<13} {config if config is not None else '(none: defaults and env)'}")
    print(
        f"  {'enabled':<13} {settings.enabled} (sites {', '.join(settings.enabled_sites)}"
        + (f"; off: {', '.join(settings.disabled_sites)})" if settings.disabled_sites else ")")
    )
    errors: list[str] = []
    warnings: list[str] = []
    for index, entry in enumerate(settings.attach):
        point = AttachPoint.from_settings(entry, settings.origin("attach", index, "target"))
        report = inspect_point(point)
        label = f"attach[{index}]"
        state = "" if settings.is_site_enabled(point.site) else " (site disabled)"
        if report.status == "ok":
            print(f"  {label:<13} ok       {point}{state}")
            continue
        line = f"{label} {point}: {report.message}"
        if report.status == "not_importable" and not args.strict:
            print(f"  {label:<13} warning  {point}: {report.message}")
            warnings.append(line)
        else:
            print(f"  {label:<13} error    {point}: {report.message}")
            errors.append(f"{point.origin}: {point.target}: {report.message}")
    if settings.attach and not _has_wrapt():
        errors.append("wrapt is not importable: [[attach]] entries need it (pip install wrapt)")
    for error in errors:
        print(f"guardrails check: error: {error}", file=sys.stderr)
    total = len(settings.attach)
    summary = (
        f"{total} attach point{'s' if total != 1 else ''}, "
        f"{total - len(errors) - len(warnings)} resolved, {len(warnings)} not importable here, "
        f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
    )
    if errors:
        print(f"guardrails check: FAILED ({summary})", file=sys.stderr)
        return 1
    print(f"guardrails check: ok ({summary})")
    return 0


def _environment() -> list[tuple[str, str]]:
    import torch

    cuda = (
        f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
        if torch.cuda.is_available()
        else "no CUDA device"
    )
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} ({cuda})"),
    ]
    for package in ("triton", "transformers", "wrapt", "sglang", "vllm"):
        rows.append((package, _version(package)))
    return rows


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _has_wrapt() -> bool:
    try:
        import wrapt  # noqa: F401
    except ImportError:
        return False
    return True
