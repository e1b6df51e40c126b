"""Holds the `sitecustomize` that `guardrails run` puts first on PYTHONPATH (a package only
so that it ships with guardrails)."""
