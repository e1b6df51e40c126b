"""The test suite, one chapter per directory (`pytest` from the repository root runs them all).

    contract/   the numeric and API contract: what a guarded call does to values, flags and
                counts, held to an oracle of the tests' own (contract/oracle.py) for every
                kernel, dtype and layout; token-id sites; the site API
    settings/   environment variables, the config file, fuzzed settings, the generated
                settings reference, the engine profiles' syntax
    reporting/  Prometheus counters, log events, the reporter, multiprocess mode, a real
                Prometheus server, threaded load
    attach/     decorator, module hooks and import-path patching, the transformers
                LogitsProcessor, the launcher, config-declared attach points, the example
    cli/        the config, check, bench and demo commands
    deploy/     the deploy/ assets: Prometheus rules (promtool), Grafana, Kubernetes
    system/     the whole system under stress: faults, soak, security, CUDA end to end,
                the package's layering

Markers: `cuda` (skipped without a GPU), `slow` (seconds each; `-m "not slow"` skips them).
"""
