"""Launchers and tools: shell scripts, and entry points run from the repo root as `python -m scripts.<name>`."""
