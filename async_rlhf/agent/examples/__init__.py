"""Agents shipped with async_rlhf (``agent.entry=async_rlhf.agent.examples.<module>:run``)."""
