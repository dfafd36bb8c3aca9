"""Environments: how a prompt becomes a scored trajectory (``base``: the single- and multi-turn interface;
``arithmetic``: the addition task; ``guess_number``: a multi-turn task; ``registry``: selection by config)."""
