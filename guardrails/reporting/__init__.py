"""Reporting: device counts -> host mirror -> Prometheus counters and throttled log events.

- `mirror`: `DeviceCounts`, a site's counts on one device and their non-blocking host copy.
- `reporter`: `Reporter`, which turns completed copies into counter increments and log
  events; it sees sites only through the `ReportedSite` protocol.
- `metrics`: the metric families (contract names), when they open, and the rank label.
- `sinks`: where a process's series go once they open (a registry, or a process tree's
  multiprocess files).
- `hook_errors`: the count and log of an engine hook's own failures.
- `exposition`: the optional /metrics server and its process-tree sibling markers.

May import `guardrails.exceptions`, `flags`, `names`, `logs` and `settings` (for types);
never `guardrails.sites` or the service. `prometheus_client` is imported only inside
functions.
"""
