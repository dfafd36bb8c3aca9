"""Offline trainers (SFT, reward model, DPO, KTO), data builders from the tiny task, and batch inference."""
