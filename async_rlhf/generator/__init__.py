"""generator."""
