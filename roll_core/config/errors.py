"""`ConfigError`, the one exception a configuration problem raises: its message names the key path(s).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the key path(s) and is meant for the user as is."""
