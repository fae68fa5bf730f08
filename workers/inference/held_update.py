"""A weight update that the trainer drives call by call (vLLM's weight-transfer engines: start, update..., finish),
run by the thread that generates.

A generating batch must not step its engine between the start and the finish of such an update (vLLM's layerwise
reload takes the weights apart in between), and two threads must not drive the engine at once. So the update is
offered like any weight sync (weight_swap.py): the thread that generates takes it (the generating batch
between two engine steps, or the thread between two batches) begins it and then runs the trainer's calls, which
arrive on other threads, one by one, until the finish.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class HeldUpdate:
    IDLE_S = 600.0
    """How long the holder waits for the trainer's next call before it gives the update up (a trainer that died
    mid-sync must not hold up generation for ever)."""

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._begun = threading.Event()
        self._given_up = False
        self.error: BaseException | None = None
        """What beginning the update raised, or why it was never begun (the caller of `wait_begun` raises it)."""

    def hold(self, begin: Callable[[], None], end: Callable[[], None]) -> None:
        """On the thread that generates: `begin()`, then every call `run` sends, in order, until `close`; then `end()`.
        Raises what `begin` or `end` raise, or TimeoutError when no call came for IDLE_S."""
        try:
            begin()
        except BaseException as err:
            self.refuse(err)
            raise
        self._begun.set()
        while True:
            try:
                item = self._calls.get(timeout=self.IDLE_S)
            except queue.Empty:
                self._given_up = True
                raise TimeoutError(f"a weight update got no call from the trainer for {self.IDLE_S:.0f} s") from None
            if item is None:
                break
            call, result = item
            try:
                result.set_result(call())
            except BaseException as err:  # the trainer's call raises it; the holder waits for the finish
                result.set_exception(err)
        end()

    def refuse(self, error: BaseException) -> None:
        """The update will not be held (beginning it failed, or a newer sync replaced it): `wait_begun` raises.
        No effect once it was begun or refused."""
        if self._begun.is_set():
            return
        self.error = error
        self._begun.set()

    def wait_begun(self, timeout: float | None = None) -> None:
        """Return once the holder has begun the update; raise why it will not."""
        if not self._begun.wait(timeout):
            raise TimeoutError("the weight update was not begun in time")
        if self.error is not None:
            raise self.error

    def run(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the holder's thread and return its result (raise its error)."""
        if self._given_up:
            raise RuntimeError("the weight update was given up (no call from the trainer in time)")
        result: Future = Future()
        self._calls.put((call, result))
        return result.result()

    def close(self) -> None:
        """The trainer's last call: the holder ends the update and goes back to generating."""
        self._calls.put(None)
