"""`SiteRegistry`, the sites part of `Guardrails`, on its own: one object per name, the kind
and vocabulary a name keeps, nothing made once closed, and exact counts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from guardrails.reporting._reporter import Reporter
from guardrails.settings import GuardSettings
from guardrails.sites import DisabledSite, LogitsSite, SiteRegistry, TokenSite
from guardrails.testing import SilentLogger


def _registry(**settings: object) -> tuple[SiteRegistry, Reporter]:
    config = GuardSettings(environ={}, **settings)
    reporter = Reporter(config, registry=CollectorRegistry(), logger=SilentLogger())
    return SiteRegistry(config, reporter), reporter


@pytest.fixture
def sites() -> Iterator[SiteRegistry]:
    registry, reporter = _registry()
    yield registry
    registry.close()
    reporter.close()


def test_a_name_gives_the_same_site_each_time(sites: SiteRegistry) -> None:
    first = sites.site("sampler.logits")
    assert isinstance(first, LogitsSite)
    assert sites.site("sampler.logits") is first
    assert sites.get("sampler.logits") is first
    assert sites.sites == {"sampler.logits": first}


def test_a_name_keeps_its_kind_and_a_token_site_its_vocabulary(sites: SiteRegistry) -> None:
    assert isinstance(sites.token_site("sampler.token_ids", vocab_size=8), TokenSite)
    with pytest.raises(ValueError, match="is a token-id site, not a logits site"):
        sites.site("sampler.token_ids")
    with pytest.raises(ValueError, match="exists with vocab_size=8, asked for 9"):
        sites.token_site("sampler.token_ids", vocab_size=9)
    sites.site("sampler.logits")
    with pytest.raises(ValueError, match="is a logits site, not a token-id site"):
        sites.token_site("sampler.logits", vocab_size=8)


def test_a_disabled_name_is_a_disabled_site_made_without_creating_anything_first() -> None:
    sites, reporter = _registry(disabled_sites=("eagle.*",))
    try:
        assert not sites.is_enabled("eagle.draft")
        assert sites.get("eagle.draft") is None
        assert isinstance(sites.site("eagle.draft"), DisabledSite)
    finally:
        reporter.close()


def test_closing_refuses_new_sites_and_keeps_the_made_ones_callable(sites: SiteRegistry) -> None:
    made = sites.site("sampler.logits")
    assert (sites.close(), sites.close(), sites.closed) == (True, False, True)
    with pytest.raises(RuntimeError, match="closed"):
        sites.site("model.logits")
    assert sites.site("sampler.logits") is made
    made(torch.zeros(2, 4))


def test_counts_are_exact_per_site_and_kind(sites: SiteRegistry) -> None:
    logits = torch.zeros(3, 4)
    logits[0, 1] = float("nan")
    sites.site("sampler.logits")(logits)
    sites.token_site("sampler.token_ids", vocab_size=4)(torch.tensor([1, 9]))
    counts = sites.counts()
    assert counts[("sampler.logits", "nan")] == 1
    assert counts[("sampler.token_ids", "oob_token")] == 1
