"""The `guardrails` command (also `python -m guardrails`).

- `main`: the argument parser and the entry point; a `ConfigError` exits 2 with its message.
- `config`, `check`, `run`: one module per subcommand, each with `register(subparsers)`.
- `bench/`: the command (`__init__`) and the benchmark itself (`measure`).
- `demo/`: the command (`__init__`) and the tiny serving loop with injected faults (`loop`).

The top of the tree: may import anything in guardrails; nothing in guardrails imports it.
Subcommand modules are imported when the command line is parsed, so `import guardrails`
never pays for the CLI.
"""
