"""Evaluation entry points, each run from the repo root as `python -m eval.<name>`."""
