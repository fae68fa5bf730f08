"""When and how long to retry a reward worker's call to an HTTP service (an LLM judge, a remote code sandbox).

Worth another attempt: a connection that fails, a request that times out, a 5xx, a 408 and a 429 (the server's
own rate limit, with its ``Retry-After`` honoured up to ``backoff_max_s``). Not: any other 4xx, which would fail
the same way again. Waits double from ``backoff_s`` up to ``backoff_max_s``, with jitter so that the scoring
processes that failed together do not retry together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

RETRIED_STATUSES = frozenset({408, 429})


def is_retried_status(status: int) -> bool:
    """Whether an HTTP status is worth another attempt: 5xx, 408 and 429; no other 4xx."""
    return status >= 500 or status in RETRIED_STATUSES


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    #: Give up once this much time has passed since the first attempt (None: only ``max_retries`` bounds it).
    total_timeout_s: float | None = None

    def delay(self, retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): ``backoff_s * 2**(retry-1)`` capped at
        ``backoff_max_s``, drawn uniformly from its upper half; at least a server's ``Retry-After``
        (capped)."""
        full = min(self.backoff_max_s, self.backoff_s * 2 ** (retry - 1))
        wait = full / 2 + rng.random() * full / 2
        if retry_after_s is not None:
            wait = max(wait, min(retry_after_s, self.backoff_max_s))
        return wait
