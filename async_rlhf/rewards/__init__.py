"""Reward sources, combinable with weights: a Python function, a reward model served by Ray actors, a remote
HTTP scorer (``build.make_rewards`` picks them from ``rewards.*``)."""
