"""`guardrails config [--config FILE] [--format table|env|toml|json]`: the effective settings
and where each value came from (default, environment variable, config file, argument).

`--format toml` prints a complete config file that reproduces the effective settings;
`--format env` prints the `GUARDRAILS_*` assignments (keys that exist only in files are shown
as comments, with the file to point at); `--format json` maps each key to its value and
source. Invalid settings exit 2 with the `ConfigError` message, like every command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from guardrails.settings import toml
from guardrails.settings.schema import plain

if TYPE_CHECKING:
    from guardrails.settings import GuardSettings


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "config",
        help="show the effective settings and the source of each value",
        description="Show the effective settings (arguments > GUARDRAILS_* > file > defaults) "
        "and the source of each value.",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="config file to read instead of $GUARDRAILS_CONFIG_FILE"
    )
    parser.add_argument(
        "--format", choices=("table", "env", "toml", "json"), default="table", help="output format"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from guardrails.settings import GuardSettings

    environ = dict(os.environ)
    if args.config is not None:
        environ["GUARDRAILS_CONFIG_FILE"] = args.config
    settings = GuardSettings(environ=environ)
    render = {"table": _table, "env": _env, "toml": _toml, "json": _json}[args.format]
    print(render(settings), end="")
    return 0


def entries(settings: GuardSettings) -> Iterator[tuple[tuple[str | int, ...], Any, str]]:
    """(path, value, source) for every effective setting, in file order."""

    def source(*path: str | int) -> str:
        origin = settings.origin(*path)
        if origin.startswith("GUARDRAILS_"):
            return f"env {origin}"
        if origin == "default" or origin.startswith("argument"):
            return origin
        return f"file {origin}"

    for name in ("enabled", "sanitize", "async_assert", "enabled_sites", "disabled_sites"):
        yield (name,), getattr(settings, name), source(name)
    if settings.config_file is not None:
        yield ("config_file",), str(settings.config_file), source("config_file")
    yield ("min_temperature",), settings.min_temperature, source("min_temperature")
    for name in ("strict_attach", "hooks"):
        yield (name,), getattr(settings, name), source(name)
    for table in ("reporting", "metrics"):
        model = getattr(settings, table)
        for key in type(model).model_fields:
            value = getattr(model, key)
            if value is not None:  # metrics.dir unset: nothing to reproduce
                yield (table, key), value, source(table, key)
    for site, config in settings.sites.items():
        for key in type(config).model_fields:
            yield ("sites", site, key), getattr(config, key), source("sites", site, key)
    for index, point in enumerate(settings.attach):
        for key in type(point).model_fields:
            value = getattr(point, key)
            if value is not None:
                yield ("attach", index, key), value, source("attach", index, key)


def _key(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + toml.key(part)
    return out


def _plain(value: Any) -> str:
    return plain(value, unset="(inherit)", empty="", sep=",", number="")


def _table(settings: GuardSettings) -> str:
    rows = [(_key(path), _plain(value), origin) for path, value, origin in entries(settings)]
    width_key = max(len(r[0]) for r in rows)
    width_value = max(len(r[1]) for r in rows)
    lines = [f"{'key':<{width_key}}  {'value':<{width_value}}  source"]
    lines += [f"{k:<{width_key}}  {v:<{width_value}}  {s}" for k, v, s in rows]
    return "\n".join(lines) + "\n"


def _env(settings: GuardSettings) -> str:
    from guardrails.settings.sources import ENV_VARS

    by_path = {var.path: var.name for var in ENV_VARS.values()}
    lines = []
    for path, value, _origin in entries(settings):
        name = by_path.get(tuple(str(p) for p in path))
        if name is not None:
            lines.append(f"{name}={_plain(value)}")
    file_only = [
        f"# {_key(path)} = {toml.value(value)}"
        for path, value, _origin in entries(settings)
        if path[0] in ("sites", "attach") and value is not None
    ]
    if file_only:
        where = settings.config_file or "a config file"
        lines.append(f"# set in {where} only (no environment variable):")
        lines += file_only
    return "\n".join(lines) + "\n"


def _toml(settings: GuardSettings) -> str:
    """A config file that reproduces `settings` (the file's own path is not repeated)."""
    lines = ["# effective guardrails settings (guardrails config --format toml)"]
    sections: dict[str, list[str]] = {}
    attach: dict[int, list[str]] = {}
    for path, value, _origin in entries(settings):
        if path == ("config_file",) or value is None:
            continue
        key = str(path[-1])
        line = f"{toml.key(key)} = {toml.value(value)}"
        if len(path) == 1:
            lines.append(line)
        elif path[0] == "attach":
            attach.setdefault(int(path[1]), []).append(line)
        else:
            sections.setdefault(_key(path[:-1]), []).append(line)
    for header, body in sections.items():
        lines += ["", f"[{header}]", *body]
    for index in sorted(attach):
        lines += ["", "[[attach]]", *attach[index]]
    return "\n".join(lines) + "\n"


def _json(settings: GuardSettings) -> str:
    def plain(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return _plain(value)  # JSON has no inf/nan
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    data = {
        _key(path): {"value": plain(value), "source": origin}
        for path, value, origin in entries(settings)
    }
    return json.dumps(data, indent=2) + "\n"
