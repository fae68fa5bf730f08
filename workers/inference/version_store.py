"""Weights versions chosen by a rule, not by timing: deterministic partial rollouts (`partial_rollout_token`).

Elsewhere a weight sync is loaded wherever the generating batch stands when it arrives (weight_swap.py), which
no rerun can repeat. Under the rule each request names the version it was launched with, v, and the token T at
which it goes on with v + 1: tokens 0..T-1 of every generate call are sampled by v and the rest by v + 1, which
generation waits for at token T. A sync then only adds its weights to this store, and the worker keeps every
version a request may still name, loading the one each token needs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class VersionStore:
    """Every weights version still needed, each loaded (`load(state_dict)`) when a token asks for it."""

    WAIT_LOG_S = 60.0
    """How often a request waiting for a version not synced yet says so."""

    def __init__(self, load: Callable[[Any], None]) -> None:
        self.load = load
        self._cond = threading.Condition()
        self._weights: dict[int, Any] = {}
        self.newest = 0
        """The newest version synced; 0: the weights the worker started with."""
        self.loaded = 0
        """The version the model holds now (the starting weights, 0, until a token asks for another)."""

    def add(self, state_dict: Any, version: int, keep_from: int | None = None) -> None:
        """Keep `state_dict` as `version`; versions below `keep_from` (none below the newest when it is None)
        are dropped: no request in flight or to come names them."""
        with self._cond:
            self._weights[version] = state_dict
            self.newest = max(self.newest, version)
            floor = self.newest if keep_from is None else min(keep_from, self.newest)
            for old in [v for v in self._weights if v < floor]:
                del self._weights[old]
            self._cond.notify_all()

    def use(self, version: int) -> int:
        """Load `version` unless the model holds it, waiting for its sync when it is newer than any synced
        (the caller is the thread that generates); returns it."""
        with self._cond:
            while version != self.loaded and version not in self._weights:
                if version <= self.newest:
                    raise RuntimeError(
                        f"weights version {version} was dropped (versions held: {sorted(self._weights)}); the "
                        "driver's keep_from must cover every rollout in flight"
                    )
                if not self._cond.wait(self.WAIT_LOG_S):
                    logger.info("a deterministic partial rollout waits for weights version %d", version)
            if version != self.loaded:
                self.load(self._weights[version])
                self.loaded = version
        return version

    def rule(self, version: int, switch_at: int | None) -> Callable[[int | None], int]:
        """`version_now(token)` for one request: `version` before token `switch_at`, version + 1 from it on
        (always `version` when switch_at is None); each call loads the version it names."""

        def version_now(token: int | None = None) -> int:
            later = switch_at is not None and token is not None and token >= switch_at
            return self.use(version + 1 if later else version)

        return version_now
