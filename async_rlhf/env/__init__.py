"""Verifiable environments: prompts, held-out splits and binary rewards computed from the completion text."""
