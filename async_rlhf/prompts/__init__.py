"""Prompt sources: the environment's own stream, files (JSONL, Parquet) through ``datasets``, Python
iterables, and a Redis stream that external producers feed while training runs (``build.make_prompts``)."""
