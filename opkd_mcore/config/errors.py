"""The one error a config problem raises."""


class ConfigError(ValueError):
    """A config value or combination that cannot run; the message starts with the key path."""
