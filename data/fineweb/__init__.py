"""FineWeb as llm.c token shards: `python -m data.fineweb.prepare` (or .download), from the repo root."""
