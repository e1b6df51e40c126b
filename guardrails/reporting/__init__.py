"""Reporting: device counts -> host mirror -> Prometheus counters and throttled log events.

- `mirror`: `DeviceCounts`, a site's counts on one device and their non-blocking host copy.
- `poller`: `Poller`, the background thread that polls a reporter twice per
  `report_interval_s`, so that counts reach the counters on an idle server too.
- `reporter`: `Reporter`, which turns completed copies into counter increments and log
  events; it sees sites only through the `ReportedSite` protocol. Its parts:
  `series` (a site's series, per-device baselines and deltas), `throttle` (a site's log
  throttle), `events` (the log events, built by pure functions).
- `recorder`: `ErrorRecorder`, the one recorder of the errors guardrails swallows (count,
  log once, a metric family), and `ReportingErrors`, the reporter's own.
- `metrics`: the metric families (contract names), when they open, and the rank label.
- `sinks`: where a process's series go once they open (a registry, or a process tree's
  multiprocess files).
- `hook_errors`: the count and log of an engine hook's own failures.
- `exposition`: the optional /metrics server, its process-tree sibling markers and what a
  failed bind says to fix (`bind_problem`).

May import `guardrails.exceptions`, `flags`, `names`, `logs` and `settings` (for types);
never `guardrails.sites` or the service. `prometheus_client` is imported only inside
functions.
"""
