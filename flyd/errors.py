"""Errors shared across flyd's packages. A leaf: it imports nothing of flyd, so any layer may
raise or catch these without depending on the layer that defines the rules behind them
(the configuration, the lease parameters, a store's settings)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the file (exit 2, `CONFIG`)."""

    code: str = "CONFIG"
    mutation: str = "none"
