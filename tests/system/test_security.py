"""Security properties, each checked on the real thing.

- The metrics server listens on loopback unless told otherwise (read from the kernel's
  socket table, not from our own settings).
- Log events and the whole /metrics exposition never carry tensor values, prompts or request
  ids, even when those pass through guarded calls.
- Config files are parsed, never executed: code and shell syntax in every string of a file
  (and in variables) runs nothing, through the settings, `guardrails check` and
  `guardrails run`.
- Attach targets are import paths only: anything else is rejected before any import, and a
  valid target is never imported by guardrails itself (it waits for the host's import).
"""

from __future__ import annotations

import importlib
import importlib.abc
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import wrapt  # noqa: F401  # imported before the import recorder runs: patch() imports it late
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from guardrails import ConfigError, Guardrails, GuardSettings
from guardrails.integrations.launcher import prepare
from guardrails.reporting.metrics import GUARD_ERROR_REASONS
from guardrails.settings import toml
from guardrails.settings.targets import Target, parse_target
from guardrails.testing import fresh_guardrails
from tests.budget import budget

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- the metrics server binds loopback -------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6}."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            if width == 8:
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
            else:
                words = [bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 32, 8)]
                found.add(socket.inet_ntop(socket.AF_INET6, b"".join(words)))
    return found


@pytest.fixture
def proc_net() -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the kernel's socket table from /proc/net/tcp (Linux)")


@pytest.mark.usefixtures("proc_net")
def test_metrics_server_listens_on_loopback_by_default() -> None:
    port = free_port()
    with fresh_guardrails(metrics={"port": port}):
        assert listening_addresses(port) == {"127.0.0.1"}
    assert listening_addresses(port) == set()  # and stops with its instance


@pytest.mark.usefixtures("proc_net")
def test_metrics_server_listens_where_it_is_told() -> None:
    # The same check sees a non-loopback bind, so the test above can fail.
    port = free_port()
    with fresh_guardrails(metrics={"port": port, "addr": "0.0.0.0"}):
        assert listening_addresses(port) == {"0.0.0.0"}


# -- no values, prompts or request ids in logs and metrics -------------------------------------

PROMPT = "PROMPT-7f3a tell me the launch codes"
REQUEST_ID = "req-4b1d-93c2"
LOGIT_VALUES = (31337.25, -27182.5)
OOB_ID = 987654321
NEEDLES = ("31337", "27182", str(OOB_ID), "PROMPT-7f3a", "launch codes", REQUEST_ID, "4b1d")

ENGINE = f"""
import torch


class Request:
    def __init__(self, prompt, rid):
        self.prompt = prompt
        self.rid = rid


class Engine:
    def sample(self, logits, request):
        ids = logits.argmax(-1)
        ids[0] = {OOB_ID}
        return ids
"""

_names = itertools.count()


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    name = f"guardrails_secret_engine_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(ENGINE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


def _serve_guarded_requests(engine: Any, guards: Guardrails) -> None:
    guards.patch(f"{engine.__name__}:Engine.sample", "sampler.logits", tensor="arg:logits")
    guards.patch(
        f"{engine.__name__}:Engine.sample",
        "sampler.token_ids",
        tensor="return",
        kind="token_ids",
        vocab_size_from="arg:logits",
    )
    server = engine.Engine()
    for step in range(3):
        logits = torch.tensor([[*LOGIT_VALUES, math.nan, 1.0], [math.inf, *LOGIT_VALUES, 2.0]])
        server.sample(logits, engine.Request(PROMPT, f"{REQUEST_ID}-{step}"))


def test_log_events_never_carry_values_prompts_or_request_ids(engine: Any) -> None:
    with (
        structlog.testing.capture_logs() as events,
        fresh_guardrails(reporting={"every_calls": 1}) as guards,
    ):
        _serve_guarded_requests(engine, guards)
    names = {event["event"] for event in events}
    assert {"guardrails.nonfinite_logits", "guardrails.oob_token_ids"} <= names
    text = json.dumps(events, default=repr) + repr(events)
    for needle in NEEDLES:
        assert needle not in text, needle


def test_metrics_exposition_never_carries_values_prompts_or_request_ids(engine: Any) -> None:
    port = free_port()
    registry = CollectorRegistry()
    with fresh_guardrails(
        registry=registry, metrics={"port": port}, reporting={"every_calls": 1}
    ) as guards:
        _serve_guarded_requests(engine, guards)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            exposition = reply.read().decode()
    assert "guardrails_nonfinite_values_total" in exposition
    for needle in NEEDLES:
        assert needle not in exposition, needle
    allowed = {
        "site": {"sampler.logits", "sampler.token_ids"},
        "kind": {"nan", "posinf", "neginf"},
        # flagged rows, and why a patched call went unguarded (a bounded set too)
        "reason": {"nonfinite", "no_valid_token", "oob_token", *GUARD_ERROR_REASONS},
        "rank": {"0"},
        "stage": {"poll", "metrics", "logs"},
        # guardrails' own host time: the sites' names, the report poller (bounded by config)
        "part": {
            *(
                f"{kind}:{site}"
                for kind in ("site", "attach")
                for site in ("sampler.logits", "sampler.token_ids")
            ),
            "poller",
        },
    }
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert value in allowed[label], (sample.name, label, value)


# -- config files are parsed, never executed ----------------------------------------------------


def payloads(sentinel: Path) -> list[str]:
    """Strings that would create `sentinel` if anything evaluated or shelled them."""
    s = str(sentinel)
    return [
        f"__import__('os').system('touch {s}')",
        f"exec(\"open('{s}', 'w')\")",
        f"$(touch {s})",
        f"`touch {s}`",
        f"; touch {s}",
        f"| touch {s}",
        f"&& touch {s} #",
        f"{{{{ __import__('os').system('touch {s}') }}}}",
        f"!!python/object/apply:os.system ['touch {s}']",
    ]


def rejected_document(sentinel: Path) -> str:
    """Every string of the file carries a payload: the settings must refuse it."""
    lines = []
    for i, p in enumerate(payloads(sentinel)):
        q = toml.string(p)
        lines += [
            "[[attach]]",
            f"site = {q}",
            f"target = {q}",
            f"tensor = {q}",
            f"vocab_size_from = {q}",
            f"when = {q}",
        ]
        lines += [
            f'[sites."sampler.logits{i}"]',
            f"dtypes = [{q}]",
            f"abort_on = [{q}]",
            f"logits_site = {q}",
        ]
        lines += [f"[sites.{q}]", "count_neginf = true"]  # site names become metric labels
    first = toml.string(payloads(sentinel)[0])
    head = [
        f"enabled = {first}",
        f"enabled_sites = [{first}]",
        f"disabled_sites = [{first}]",
        f"min_temperature = {first}",
        f"hooks = [{first}]",
        f"strict_attach = {first}",
        f"{first} = {first}",
        "[reporting]",
        f"log_format = {first}",
        "[metrics]",
        f"addr = {first}",
    ]
    return "\n".join([*head, *lines]) + "\n"


def accepted_document(sentinel: Path) -> str:
    """Payloads only where any string is accepted: constant metric label values (site table
    names must now be site names, the metrics address an IP address or a host name). The
    settings build; the strings stay strings, down to the exported series."""
    lines = [f"l{i} = {toml.string(p)}" for i, p in enumerate(payloads(sentinel))]
    return "[metrics.labels]\n" + "\n".join(lines) + "\n"


def run_cli(args: Sequence[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guardrails", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.update(extra)
    return env


def test_config_file_with_code_everywhere_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "guardrails.toml"
    path.write_text(rejected_document(sentinel), encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        GuardSettings(environ={}, config_file=path)
    assert len(refused.value.problems) > 20  # each payload refused, each named
    check = run_cli(["check", "--config", str(path)], clean_env())
    launched = run_cli(
        ["run", "--config", str(path), "--", sys.executable, "-c", "pass"], clean_env()
    )
    assert check.returncode == 2
    assert launched.returncode == 2
    assert not sentinel.exists()


def test_config_file_strings_stay_strings_when_accepted(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "guardrails.toml"
    path.write_text(accepted_document(sentinel), encoding="utf-8")
    settings_ = GuardSettings(environ={}, config_file=path)
    assert set(payloads(sentinel)) == set(settings_.metrics.labels.values())
    registry = CollectorRegistry()
    with Guardrails(settings_, registry=registry) as guards:
        guards.site("sampler.logits")(torch.tensor([[math.nan, 0.0]]))
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0", **settings_.metrics.labels}
    assert registry.get_sample_value("guardrails_nonfinite_values_total", labels) == 1.0
    launched = run_cli(
        ["run", "--config", str(path), "--", sys.executable, "-c", "import guardrails"],
        clean_env(),
    )
    assert launched.returncode == 0, launched.stderr
    assert not sentinel.exists()


def test_variables_with_code_and_shell_syntax_run_nothing(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    for payload in payloads(sentinel):
        # What `guardrails run` does first, for every payload; then once for real below.
        env = {"GUARDRAILS_CONFIG_FILE": payload, "GUARDRAILS_METRICS_ADDR": payload}
        with pytest.raises(ConfigError, match="GUARDRAILS_CONFIG_FILE"):
            prepare(env)
    env = clean_env(
        GUARDRAILS_CONFIG_FILE=payloads(sentinel)[2], GUARDRAILS_SITES=payloads(sentinel)[3]
    )
    launched = run_cli(["run", "--", "sh", "-c", "true"], env)
    assert launched.returncode == 2  # refused at start-up, the command never ran
    assert "GUARDRAILS_CONFIG_FILE" in launched.stderr
    assert not sentinel.exists()


# -- attach targets are import paths only -------------------------------------------------------


class ImportRecorder(importlib.abc.MetaPathFinder):
    """Sees every import of a module not yet in sys.modules, and lets it proceed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.names.append(name)


@pytest.fixture
def imports() -> Iterator[ImportRecorder]:
    recorder = ImportRecorder()
    sys.meta_path.insert(0, recorder)
    try:
        yield recorder
    finally:
        sys.meta_path.remove(recorder)


MALICIOUS_TARGETS = [
    "os:system('touch /tmp/pwned')",
    "__import__('os').system:x",
    "os.system('id'):x",
    "subprocess:run;import os",
    "pkg.mod:Cls.method()",
    "pkg.mod:Cls[0]",
    "pkg.mod:Cls.method\nimport os",
    "../../etc/passwd:x",
    "/usr/lib/python3/os.py:system",
    "pkg mod:f",
    "pkg.mod:f:g",
    "pkg.mod:",
    ":f",
    "pkg.mod.f",
    "pkg.mod:lambda: 0",
    "pkg.mod:f # comment",
    "$(touch /tmp/pwned):f",
    "pkg.mod:__import__('os')",
    "pkg.\u2024mod:f",  # one dot leader, not a full stop
    "",
]


def test_malicious_targets_are_rejected_before_any_import(
    guards: Guardrails, imports: ImportRecorder
) -> None:
    with pytest.raises(ConfigError):
        guards.patch("warm:up:", "sampler.logits")  # lazy imports of the error path
    imports.names.clear()
    modules = set(sys.modules)
    for target in MALICIOUS_TARGETS:
        with pytest.raises(ConfigError, match="target"):
            guards.patch(target, "sampler.logits")
    assert imports.names == []
    assert set(sys.modules) == modules
    assert guards.patches() == []


def test_malicious_targets_in_a_config_file_are_refused_naming_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "guardrails.toml"
    entries = [
        f'[[attach]]\nsite = "sampler.logits"\ntarget = {toml.string(target)}\n'
        for target in MALICIOUS_TARGETS
    ]
    path.write_text("".join(entries), encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        GuardSettings(environ={}, config_file=path)
    where = " | ".join(problem.where for problem in refused.value.problems)
    for i in range(len(MALICIOUS_TARGETS)):
        assert f"{path}: attach[{i}].target" in where


def test_a_valid_target_is_never_imported_by_guardrails(
    guards: Guardrails, imports: ImportRecorder
) -> None:
    handle = guards.patch("guardrails_never_imported_module:Engine.sample", "sampler.logits")
    assert handle.state == "pending"  # applied when the host imports it, if ever
    assert "guardrails_never_imported_module" not in imports.names
    assert "guardrails_never_imported_module" not in sys.modules
    handle.remove()


DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@budget(500)
@given(
    text=st.one_of(
        st.text(max_size=40),
        st.from_regex(r"[a-z_.]{1,10}:[a-z_.()\[\]'; ]{1,12}", fullmatch=True),
    )
)
def test_any_target_string_parses_to_identifiers_or_is_refused_without_importing(
    text: str,
) -> None:
    recorder = ImportRecorder()
    sys.meta_path.insert(0, recorder)
    target: Target | None = None
    refused = ""
    try:
        target = parse_target(text)
    except ValueError as exc:
        refused = str(exc)
    finally:
        sys.meta_path.remove(recorder)
    assert recorder.names == []
    if target is None:
        assert "target" in refused
    else:
        assert DOTTED.fullmatch(target.module)
        assert DOTTED.fullmatch(target.qualname)
        assert str(target) == text
