"""New weights for a generation worker while it may be generating: partial rollouts.

A weight sync hands its weights over (`WeightSwap.offer`) and returns once they are loaded. Whoever holds the
generation lock loads them: the batch that is generating, between two of its tokens (its strategy asks
`version_now()` there; the hf strategy after every token, vLLM's after every engine step), or the sync itself as soon as no
batch runs. So a sync never waits for a whole rollout, the tokens sampled before it keep the version that sampled
them, and the ones after come from the new weights (the KV cache of the tokens before is kept, as the peers'
partial rollouts keep it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Offer:
    state_dict: Any
    version: int | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class WeightSwap:
    """Loads offered weights (`load(state_dict)`) under the generation lock and keeps the version they bring."""

    POLL_S = 0.01
    """How often a waiting sync tries the generation lock itself (a batch may have ended meanwhile)."""

    def __init__(self, load: Callable[[Any], None], generation_lock: threading.Lock) -> None:
        self.load, self.generation_lock = load, generation_lock
        self.version = 0
        """0: the weights the worker started with; each offer names the version it brings."""
        self._lock = threading.Lock()
        self._pending: _Offer | None = None

    def offer(self, state_dict: Any, version: int | None = None) -> None:
        """Load `state_dict` (as `version`) at the generating batch's next token, or now when none runs; returns
        once it is loaded, and raises what loading it raised. Of two offers pending at once the newer version is
        loaded and the other dropped (its caller returns: newer weights replace it), whichever came first: a
        sync resent to a restarted worker may arrive after a newer one. Offers without a version: the later."""
        offer = _Offer(state_dict, version)
        with self._lock:
            pending = self._pending
            if pending is not None and not _newer(offer, pending):
                return  # the pending offer brings newer weights
            if pending is not None:
                pending.done.set()
            self._pending = offer
        while not offer.done.is_set():
            if self.generation_lock.acquire(timeout=self.POLL_S):
                try:
                    self.apply()
                finally:
                    self.generation_lock.release()
        if offer.error is not None:
            raise offer.error

    def apply(self, token: int | None = None) -> int:
        """Load the pending offer, if any (the caller holds the generation lock); the version now held. `token`,
        the index of the token the caller is about to sample, changes nothing: offers load wherever they find the
        batch (version_store.py's rule is the one that reads it)."""
        with self._lock:
            offer, self._pending = self._pending, None
        if offer is not None:
            try:
                self.load(offer.state_dict)
                if offer.version is not None:
                    self.version = offer.version
            except BaseException as err:  # the sync that offered them raises it, not the generating batch
                offer.error = err
            finally:
                offer.done.set()
        return self.version


def _newer(offer: _Offer, than: _Offer) -> bool:
    """Whether `offer` should replace `than`: a higher version, or either without one (then the later wins)."""
    return offer.version is None or than.version is None or offer.version > than.version
