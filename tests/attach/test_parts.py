"""The attach-side parts of `Guardrails` on their own: `Recorders` (where an attach failure
goes) and `watched_now` (what the liveness self-check watches, from its inputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from guardrails.attach.errors import Recorders
from guardrails.attach.liveness import Watched, watched_now
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.exceptions import Problem
from guardrails.settings import GuardSettings
from guardrails.testing import SilentLogger


def _recorders(**settings: Any) -> Recorders:
    config = GuardSettings(environ={}, **settings)
    return Recorders(config, CollectorRegistry(), SilentLogger())


def _error() -> AttachError:
    return AttachError([Problem("attach[0].target", "no such method", None)])


def test_an_attach_failure_goes_to_on_error_when_given() -> None:
    recorders, seen = _recorders(strict_attach=True), []
    recorders.failed("sampler.logits", "pkg:f", _error(), seen.append)
    assert len(seen) == 1
    assert recorders.attach_errors.failures == []


def test_an_attach_failure_is_raised_under_strict_attach() -> None:
    with pytest.raises(AttachError):
        _recorders(strict_attach=True).failed("sampler.logits", "pkg:f", _error(), None)


def test_an_attach_failure_is_recorded_otherwise() -> None:
    recorders = _recorders()
    recorders.failed("sampler.logits", "pkg:f", _error(), None)
    assert [(site, target) for site, target, _ in recorders.attach_errors.failures] == [
        ("sampler.logits", "pkg:f")
    ]


def test_a_point_records_its_failure_unless_strict_or_told_otherwise() -> None:
    point = AttachPoint.from_arguments(site="sampler.logits", target="pkg.mod:f")
    recorded = _recorders().on_point_error(point, None)
    assert recorded is not None
    recorded(_error())
    assert _recorders(strict_attach=True).on_point_error(point, None) is None
    given = print
    assert _recorders().on_point_error(point, given) is given


@dataclass
class _Patch:
    point: AttachPoint
    state: str


@dataclass
class _Hook:
    watch_name: str
    path: str
    state: str = "applied"
    calls: int = 0
    extra: list[str] = field(default_factory=list)


def _patch(site: str, target: str, state: str = "applied", **options: Any) -> _Patch:
    return _Patch(AttachPoint.from_arguments(site=site, target=target, **options), state)


def test_watched_now_lists_attached_sites_loaders_and_pooled_hook_halves() -> None:
    settings = GuardSettings(environ={})
    patches = [
        _patch("sampler.logits", "pkg.a:f"),
        _patch("sampler.logits", "pkg.b:f", "pending"),
        _patch("model.logits", "pkg.c:f", "disabled"),  # not watched
    ]
    loaders = [_patch("trace", "pkg.load:m", "pending")]
    hooks = [_Hook("sglang.abort", "a.b:C.x", calls=2), _Hook("sglang.abort", "a.b:C.y", calls=3)]
    watched = watched_now(settings, patches, {"sampler.logits": 7}.get, loaders, lambda: 1, hooks)  # type: ignore[arg-type]
    assert watched == [
        Watched("sampler.logits", 7, ("pkg.a:f", "pkg.b:f"), ("applied", "pending")),
        Watched("trace", 1, ("pkg.load:m",), ("pending",), kind="installed"),
        Watched("sglang.abort", 5, ("a.b:C.x", "a.b:C.y"), ("applied", "applied")),
    ]
