"""async_rlhf: asynchronous RL for language models."""
