"""What the liveness self-check (`guardrails.attach.liveness`) hands the reporter at the end
of each window: `Observation`s of `Watched` things. Defined here, below both, so that the
reporter reads the same classes the self-check makes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Observation", "Watched"]


@dataclass(frozen=True)
class Watched:
    """Something that should be called at every step: a site, or an engine hook's halves."""

    name: str  # the site's name, or the hook's ("trace" for tracing)
    calls: int  # cumulative, as the site (or hook) counts them; traced models for "installed"
    targets: tuple[str, ...]  # the attach targets (or hook methods, or loaders) that should call it
    states: tuple[str, ...]  # their states: applied, pending, failed
    # "calls": silent in a window without a call; "installed": silent while `calls` is 0;
    # "off": an engine-hook part not applied (reported once, at once: `Attachment.hook_off`).
    kind: str = "calls"


@dataclass(frozen=True)
class Observation:
    """One watched thing at the end of a window of `steps` beats."""

    watched: Watched
    silent: bool  # no call in this window
    first: bool  # silent now, called (or not yet watched) in the window before
    steps: int  # beats since it was last seen called (or since watching began)
