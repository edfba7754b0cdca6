"""Token data: data/fineweb/ makes and fetches llm.c token shards."""
