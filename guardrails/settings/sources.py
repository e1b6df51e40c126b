"""Where settings come from, first wins: explicit arguments, `GUARDRAILS_*` variables, the
TOML file. Each source records the origin of every key it supplies (a variable, a file key,
an argument) and the problems it finds, in the `Collector` of the construction."""

from __future__ import annotations

import contextvars
import os
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic_settings import PydanticBaseSettingsSource

from guardrails._suggest import closest
from guardrails.exceptions import Problem
from guardrails.settings.schema import dotted, part

__all__ = [
    "COLLECTOR",
    "ENV_VARS",
    "Collector",
    "EnvSource",
    "EnvVar",
    "FileSource",
    "InitSource",
    "is_table_list",
    "leaves",
]


@dataclass(frozen=True)
class EnvVar:
    name: str
    path: tuple[str, ...]
    is_list: bool = False


ENV_VARS: Mapping[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("GUARDRAILS_ENABLED", ("enabled",)),
        EnvVar("GUARDRAILS_SANITIZE", ("sanitize",)),
        EnvVar("GUARDRAILS_ASYNC_ASSERT", ("async_assert",)),
        EnvVar("GUARDRAILS_SITES", ("enabled_sites",), is_list=True),
        EnvVar("GUARDRAILS_DISABLED_SITES", ("disabled_sites",), is_list=True),
        EnvVar("GUARDRAILS_CONFIG_FILE", ("config_file",)),
        EnvVar("GUARDRAILS_MIN_TEMPERATURE", ("min_temperature",)),
        EnvVar("GUARDRAILS_STRICT_ATTACH", ("strict_attach",)),
        EnvVar("GUARDRAILS_HOOKS", ("hooks",), is_list=True),
        EnvVar("GUARDRAILS_HEARTBEAT", ("heartbeat",), is_list=True),
        EnvVar("GUARDRAILS_LIVENESS_STEPS", ("liveness_steps",)),
        EnvVar("GUARDRAILS_LOG_INTERVAL_S", ("reporting", "log_interval_s")),
        EnvVar("GUARDRAILS_LOG_FORMAT", ("reporting", "log_format")),
        EnvVar("GUARDRAILS_REPORT_EVERY", ("reporting", "every_calls")),
        EnvVar("GUARDRAILS_REPORT_INTERVAL_S", ("reporting", "report_interval_s")),
        EnvVar("GUARDRAILS_METRICS_PORT", ("metrics", "port")),
        EnvVar("GUARDRAILS_METRICS_ADDR", ("metrics", "addr")),
        EnvVar("GUARDRAILS_METRICS_LABELS", ("metrics", "labels"), is_list=True),
        EnvVar("GUARDRAILS_METRICS_DIR", ("metrics", "dir")),
        EnvVar("GUARDRAILS_TRACE", ("trace", "modules"), is_list=True),
        EnvVar("GUARDRAILS_TRACE_MODE", ("trace", "mode")),
    )
}


class Collector:
    """Origins of values and problems found by the sources during one construction."""

    def __init__(self, environ: Mapping[str, str], kwargs: dict[str, Any]) -> None:
        self.environ = environ
        self.kwargs = kwargs
        self.origins: dict[tuple[str, ...], str] = {}
        self.problems: list[Problem] = []
        self.file: Path | None = None
        # What each source supplied, first (highest precedence) first.
        self.layers: list[Mapping[str, Any]] = []

    def merged(self) -> dict[str, Any]:
        """The sources' values merged as pydantic-settings merges them: tables key by key,
        anything else whole, first source wins. Raw: for checks that still run when
        validation failed."""
        out: dict[str, Any] = {}
        for layer in reversed(self.layers):
            out = _deep_update(out, layer)
        return out

    def where(self, loc: tuple[str | int, ...]) -> str:
        path = tuple(part(p) for p in loc)
        for n in range(len(path), 0, -1):
            origin = self.origins.get(path[:n])
            if origin is not None:
                return origin if n == len(path) else f"{origin} ({dotted(path)})"
        return f"default {dotted(path)}"


# The collector of the construction in progress: pydantic-settings builds the sources, so
# this is how they find it.
COLLECTOR: contextvars.ContextVar[Collector] = contextvars.ContextVar("guardrails_settings")


def _deep_update(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            out[key] = _deep_update(below, value)
        else:
            out[key] = value
    return out


def _set_path(out: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value


def leaves(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        path = (*prefix, str(key))
        yield path
        if isinstance(value, Mapping):
            yield from leaves(value, path)
        elif is_table_list(value):
            for index, item in enumerate(value):
                yield (*path, part(index))
                yield from leaves(item, (*path, part(index)))


def is_table_list(value: object) -> bool:
    """A TOML array of tables (`[[attach]]`), whose entries get origins of their own."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


class EnvSource(PydanticBaseSettingsSource):
    """`GUARDRAILS_*` variables, mapped through the fixed table `ENV_VARS`."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ builds the whole mapping

    def __call__(self) -> dict[str, Any]:
        collector = COLLECTOR.get()
        out: dict[str, Any] = {}
        for key, raw in collector.environ.items():
            if not key.startswith("GUARDRAILS_"):
                continue
            var = ENV_VARS.get(key)
            if var is None:
                collector.problems.append(
                    Problem(key, "unknown guardrails variable" + closest(key, ENV_VARS), raw)
                )
                continue
            value: Any = raw
            if var.is_list:
                value = tuple(item.strip() for item in raw.split(",") if item.strip())
            elif var.path == ("config_file",) and not raw.strip():
                continue  # an empty path means "no file", as templated pod specs produce
            _set_path(out, var.path, value)
            collector.origins.setdefault(var.path, key)
        collector.layers.append(out)
        return out


# Far above any real configuration; a bound, so that a path to a device or a huge file fails
# at once instead of exhausting memory at start-up.
_MAX_CONFIG_BYTES = 1 << 20


def _read_config(path: Path) -> str:
    # Only regular files (symlinks to them, as Kubernetes ConfigMap mounts are, included): a
    # FIFO would block start-up, /dev/zero would never end.
    if not stat.S_ISREG(path.stat().st_mode):
        raise OSError(f"{path} is not a regular file")
    with path.open("rb") as handle:
        data = handle.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise OSError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    return data.decode("utf-8")


class FileSource(PydanticBaseSettingsSource):
    """The TOML file named by the `config_file` argument or `GUARDRAILS_CONFIG_FILE`."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        collector = COLLECTOR.get()
        raw = self.current_state.get("config_file")
        if raw is None or raw == "":
            return {}
        where = collector.origins.get(("config_file",), "config_file")
        if not isinstance(raw, (str, os.PathLike)):
            return {}  # not a path (1, True): the field's own validation names it
        try:
            path = Path(raw).expanduser()
        except RuntimeError as exc:  # "~nosuchuser/...": no home directory to expand to
            collector.problems.append(Problem(where, f"invalid config file path: {exc}", raw))
            return {}
        collector.file = path
        try:
            data = tomllib.loads(_read_config(path))
        except FileNotFoundError:
            collector.problems.append(Problem(where, "config file does not exist", str(path)))
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            collector.problems.append(Problem(where, f"cannot read config file: {exc}", str(path)))
            return {}
        except tomllib.TOMLDecodeError as exc:
            collector.problems.append(Problem(f"{path}", f"malformed TOML: {exc}"))
            return {}
        except ValueError as exc:
            # A path the OS cannot take at all ("embedded null byte"): an argument, since
            # environment variables cannot hold NUL.
            collector.problems.append(Problem(where, f"invalid config file path: {exc}", raw))
            return {}
        if "config_file" in data:
            collector.problems.append(
                Problem(f"{path}: config_file", "a config file cannot name another config file")
            )
            del data["config_file"]
        for leaf in leaves(data):
            collector.origins.setdefault(leaf, f"{path}: {dotted(leaf)}")
        collector.layers.append(data)
        return data


class InitSource(PydanticBaseSettingsSource):
    """Explicit keyword arguments; unlike pydantic-settings' own, unknown names are errors."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        collector = COLLECTOR.get()
        for key, value in collector.kwargs.items():
            collector.origins[(key,)] = f"argument {key}"
            if isinstance(value, Mapping) or is_table_list(value):
                for leaf in leaves({key: value}):
                    collector.origins[leaf] = f"argument {dotted(leaf)}"
        collector.layers.append(collector.kwargs)
        return dict(collector.kwargs)
