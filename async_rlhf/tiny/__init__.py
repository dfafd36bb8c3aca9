"""The tiny policy of the CPU demo: a character tokenizer, a ~0.5 M-parameter Qwen2 and its SFT warm start.

Everything is built locally (no model hub), small enough that SFT and a few hundred GRPO steps fit on two
cores.
"""
