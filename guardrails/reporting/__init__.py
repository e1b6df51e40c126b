"""Reporting: device counts -> host mirror -> Prometheus counters and throttled log events.

- `mirror`: `DeviceCounts`, a site's counts on one device and their non-blocking host copy.
- `reporter`: `Reporter`, which turns completed copies into counter increments and log
  events; it sees sites only through the `ReportedSite` protocol.
- `metrics`: the counter families (contract names) and the rank label.
- `exposition`: the optional /metrics server and its multiprocess sibling markers.

May import `guardrails.exceptions`, `flags`, `names`, `logs` and `settings` (for types);
never `guardrails.sites` or the service. `prometheus_client` is imported only inside
functions.
"""
