"""`SiteRegistry`: the named sites of one `Guardrails`, made on first request.

    registry = SiteRegistry(settings, reporter)
    registry.site("sampler.logits")(logits)      # the same object at every later request

A site is built from the settings snapshot the registry was given (a disabled one is a
`DisabledSite`), registered with the reporter, and cached by name: asking again for the same
name returns the same object, so engine code may ask in its hot loop or keep the site. A name
is one kind for its lifetime (logits or token ids) and a token-id site one vocabulary. Once
closed, the registry makes no new site; the ones it made stay callable.
"""

from __future__ import annotations

from typing import Any

import torch

from guardrails import _process
from guardrails.names import validate_site_name
from guardrails.reporting._reporter import Reporter
from guardrails.settings import GuardSettings
from guardrails.sites._site import DisabledSite, LogitsSite, Site, TokenSite

__all__ = ["SiteRegistry"]


class SiteRegistry:
    """The sites of one `Guardrails` by name, built from one settings snapshot and
    registered with one reporter."""

    def __init__(self, settings: GuardSettings, reporter: Reporter) -> None:
        self._settings = settings
        self._reporter = reporter
        self._sites: dict[str, Site] = {}
        self._lock = _process.lock(self, "_lock")
        self._closed = False

    def site(
        self,
        name: str,
        *,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> LogitsSite | DisabledSite:
        """The logits site `name` (created on first use); `device`/`capacity` reserve its
        buffers. ValueError when `name` is a token-id site."""
        site = self._sites.get(name)
        if site is None:
            site = self._create(name, "logits", device=device, capacity=capacity)
        elif device is not None:
            site.reserve(capacity or 1, device)
        if isinstance(site, TokenSite) or site.kind != "logits":
            raise ValueError(f"guardrails site {name!r} is a token-id site, not a logits site")
        return site

    def token_site(
        self,
        name: str,
        *,
        vocab_size: int,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> TokenSite | DisabledSite:
        """The token-id site `name` (created on first use). ValueError when `name` is a
        logits site, or a token-id site of another vocabulary."""
        site = self._sites.get(name)
        if site is None:
            site = self._create(
                name, "token_ids", vocab_size=vocab_size, device=device, capacity=capacity
            )
        elif device is not None:
            site.reserve(capacity or 1, device)
        if isinstance(site, LogitsSite) or site.kind != "token_ids":
            raise ValueError(f"guardrails site {name!r} is a logits site, not a token-id site")
        if isinstance(site, TokenSite) and site.vocab_size != vocab_size:
            raise ValueError(
                f"guardrails token site {name!r} exists with vocab_size={site.vocab_size}, "
                f"asked for {vocab_size}"
            )
        return site

    def _create(self, name: str, kind: str, **options: Any) -> Site:
        validate_site_name(name)
        with self._lock:
            existing = self._sites.get(name)
            if existing is not None:
                return existing
            if self._closed:
                raise RuntimeError("this Guardrails instance is closed")
            settings = self._settings
            site: Site
            if not settings.is_site_enabled(name):
                site = DisabledSite(name, kind)
            else:
                config = settings.site_settings(name)
                common: dict[str, Any] = {
                    "reporter": self._reporter,
                    "every_calls": settings.reporting.every_calls,
                    "device": options.get("device"),
                    "capacity": options.get("capacity"),
                }
                if kind == "logits":
                    site = LogitsSite(
                        name, config, min_temperature=settings.min_temperature, **common
                    )
                else:
                    rows_from = None
                    if config.on_no_valid_token == "eos":
                        logits_name = config.logits_site

                        def rows_from() -> tuple[int, torch.Tensor] | None:
                            # Looked up at each call: the logits site may be made later.
                            logits_site = self._sites.get(logits_name)
                            return None if logits_site is None else logits_site.recent()

                    site = TokenSite(
                        name,
                        config,
                        vocab_size=options["vocab_size"],
                        rows_from=rows_from,
                        **common,
                    )
                self._reporter.register(site)
            self._sites[name] = site
            return site

    @property
    def sites(self) -> dict[str, Site]:
        """The sites created so far, by name (a copy)."""
        return dict(self._sites)

    def get(self, name: str) -> Site | None:
        """The site `name` if it was created, without creating it."""
        return self._sites.get(name)

    def is_enabled(self, name: str) -> bool:
        """Whether a site of this name guards (without creating it)."""
        return self._settings.is_site_enabled(name)

    def counts(self) -> dict[tuple[str, str], int]:
        """Exact cumulative counts `{(site, kind): n}` of enabled sites (waits for devices)."""
        out: dict[tuple[str, str], int] = {}
        for name, site in self.sites.items():
            for kind, value in site.totals().items():
                out[(name, str(kind))] = value
        return out

    def close(self) -> bool:
        """Make no new site from now on; False when it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    @property
    def closed(self) -> bool:
        return self._closed
