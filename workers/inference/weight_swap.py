"""New weights for a generation worker while it may be generating: partial rollouts.

A weight sync hands its weights over (`WeightSwap.offer`) and returns once they are loaded. The thread that
generates loads them (it is the only one that touches the model: request_batcher.py says why): the batch that is
generating, between two of its tokens (its strategy asks `version_now()` there; the hf strategy after every token,
vLLM's after every engine step), or, when no batch runs, the thread before it starts the next one. So a sync never
waits for a whole rollout, the tokens sampled before it keep the version that sampled
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
    """Loads offered weights (`load(state_dict)`) on the thread that generates and keeps the version they bring."""

    def __init__(self, load: Callable[[Any], None], between_batches: Callable[[Callable[[], Any]], Any]) -> None:
        """`between_batches(fn)` has `fn` run on the thread that generates before its next batch, at once when none
        runs (RequestBatcher.defer), and returns without waiting for it."""
        self.load, self.between_batches = load, between_batches
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
        self.between_batches(self.apply)  # finds nothing to load if the generating batch took the offer first
        offer.done.wait()
        if offer.error is not None:
            raise offer.error

    def apply(self, token: int | None = None) -> int:
        """Load the pending offer, if any (the caller is the thread that generates); the version now held. `token`,
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
