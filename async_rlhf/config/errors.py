"""The one error a configuration raises."""

class ConfigError(ValueError):
    """A configuration the run cannot start with; the message names the problem and the fix."""
