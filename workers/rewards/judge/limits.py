"""Concurrency and rate limits on one judge endpoint, shared by every process of a machine that calls it.

The reward worker scores each sample in a process of its pool, and several domains or worker replicas may call
the same judge, so the limits cannot live in one process's memory. They live in a folder per endpoint (under
the system's temporary folder, named by a hash of base URL and model), guarded by ``flock``:

- concurrency: ``max_concurrency`` lock files; a request holds one for as long as it is in flight. The kernel
  drops a lock when its holder exits, so a scoring process killed at its timeout never leaks a slot.
- rate: a generic cell rate algorithm (GCRA) per budget, requests per minute and tokens per minute, whose
  state is one "theoretical arrival time" per budget in a small JSON file. A request goes when neither budget
  is ahead of the clock and moves each one on by its cost; there is no burst allowance, so requests are spread
  evenly and the limits hold over any window.

The limits are per machine: reward workers on several machines that call one judge should divide them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

#: Where the per-endpoint folders go unless ``ROLL_JUDGE_LIMITS_DIR`` names another place.
LIMITS_ENV = "ROLL_JUDGE_LIMITS_DIR"
_SLOT_POLL_S = (0.005, 0.03)


def gcra(tat: float, now: float, cost: float, interval_s: float) -> tuple[float, float]:
    """One GCRA decision without burst: ``(wait, new_tat)``.

    ``tat`` is the budget's theoretical arrival time, ``cost`` the request's units and ``interval_s`` the time
    one unit takes to earn back. A request may go when ``wait == 0``; the budget's new state is then
    ``new_tat``. Otherwise it should try again after ``wait`` seconds, and the state stays ``tat``.
    """
    if tat > now:
        return tat - now, tat
    return 0.0, now + cost * interval_s


def endpoint_dir(base_url: str, model: str) -> Path:
    """The folder that holds one endpoint's shared limit state."""
    root = Path(os.environ.get(LIMITS_ENV) or Path(tempfile.gettempdir()) / "roll-judge-limits")
    digest = hashlib.sha256(f"{base_url.rstrip('/')}\n{model}".encode()).hexdigest()[:16]
    return root / digest


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


class RateLimiter:
    """Requests per minute and tokens per minute over a state file (see the module docstring)."""

    def __init__(
        self,
        state_file: Path,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.state_file = Path(state_file)
        self.request_interval_s = 60.0 / requests_per_minute if requests_per_minute else None
        self.token_interval_s = 60.0 / tokens_per_minute if tokens_per_minute else None
        self._clock = clock
        self._sleep = sleep

    @property
    def enabled(self) -> bool:
        return self.request_interval_s is not None or self.token_interval_s is not None

    def acquire(self, tokens: int) -> float:
        """Wait until a request of ``tokens`` tokens may go, and book it; returns the seconds waited."""
        waited = 0.0
        while True:
            wait = self._try(tokens)
            if wait <= 0:
                return waited
            self._sleep(wait)
            waited += wait

    def settle_tokens(self, booked: int, used: int) -> None:
        """Correct the token budget once a reply's real usage is known (``used`` instead of ``booked``)."""
        if self.token_interval_s is None or used == booked:
            return
        with _locked(self.state_file) as fd:
            state = self._read(fd)
            state["tokens_tat"] = state.get("tokens_tat", 0.0) + (used - booked) * self.token_interval_s
            self._write(fd, state)

    def _try(self, tokens: int) -> float:
        if not self.enabled:
            return 0.0
        with _locked(self.state_file) as fd:
            state = self._read(fd)
            now = self._clock()
            budgets = [
                ("requests_tat", 1, self.request_interval_s),
                ("tokens_tat", tokens, self.token_interval_s),
            ]
            decisions = {
                key: gcra(state.get(key, 0.0), now, cost, interval)
                for key, cost, interval in budgets
                if interval is not None
            }
            wait = max(w for w, _ in decisions.values())
            if wait > 0:
                return wait
            state.update({key: new_tat for key, (_, new_tat) in decisions.items()})
            self._write(fd, state)
            return 0.0

    @staticmethod
    def _read(fd: int) -> dict[str, float]:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = b""
        while chunk := os.read(fd, 4096):
            raw += chunk
        try:
            state = json.loads(raw or b"{}")
        except ValueError:  # a writer killed half-way: start the budgets afresh
            return {}
        return state if isinstance(state, dict) else {}

    @staticmethod
    def _write(fd: int, state: dict[str, float]) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(state).encode())


class ConcurrencySlots:
    """At most ``size`` holders at once among all processes using ``directory``."""

    def __init__(self, directory: Path, size: int) -> None:
        if size < 1:
            raise ValueError(f"concurrency limit must be >= 1, got {size}")
        self.paths = [Path(directory) / f"slot-{i}.lock" for i in range(size)]

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        fd = self._acquire()
        try:
            yield
        finally:
            os.close(fd)

    def _acquire(self) -> int:
        order = list(range(len(self.paths)))
        while True:
            random.shuffle(order)
            for i in order:
                # A fresh descriptor each time: flock is per open file, so two holders in one process
                # (threads) exclude each other just as two processes do.
                fd = os.open(self.paths[i], os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    os.close(fd)
            time.sleep(random.uniform(*_SLOT_POLL_S))


class SharedLimits:
    """The limits of one endpoint; each part is a no-op when its limit is not set."""

    def __init__(self, slots: ConcurrencySlots | None, rate: RateLimiter | None) -> None:
        self._slots = slots
        self._rate = rate

    @classmethod
    def for_endpoint(
        cls,
        base_url: str,
        model: str,
        *,
        max_concurrency: int | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
    ) -> SharedLimits:
        if max_concurrency is None and requests_per_minute is None and tokens_per_minute is None:
            return cls(None, None)
        directory = endpoint_dir(base_url, model)
        directory.mkdir(parents=True, exist_ok=True)
        slots = ConcurrencySlots(directory, max_concurrency) if max_concurrency is not None else None
        rate = None
        if requests_per_minute is not None or tokens_per_minute is not None:
            rate = RateLimiter(directory / "rate.json", requests_per_minute, tokens_per_minute)
        return cls(slots, rate)

    def slot(self) -> contextlib.AbstractContextManager[None]:
        return self._slots.hold() if self._slots is not None else contextlib.nullcontext()

    def wait_for_rate(self, tokens: int) -> float:
        return self._rate.acquire(tokens) if self._rate is not None else 0.0

    def settle_tokens(self, booked: int, used: int) -> None:
        if self._rate is not None:
            self._rate.settle_tokens(booked, used)
