"""WeightSwap (workers/inference/weight_swap.py): a weight sync loads between two tokens of the generating batch, or
on the generating thread before its next batch when none runs, and returns only when its weights are in. The thread
that generates is a real RequestBatcher's; its batch here stands for a generation that takes one token per `token()`."""

from __future__ import annotations

import queue
import threading

import pytest

from workers.inference.request_batcher import Request, RequestBatcher
from workers.inference.weight_swap import WeightSwap

GENERATION = "generation"
"""The name of the batcher's thread: the only one that may load weights."""


class Model:
    def __init__(self) -> None:
        self.weights, self.loaded_in = "w0", []

    def load(self, state_dict) -> None:
        if state_dict == "broken":
            raise ValueError("shape mismatch for lm_head.weight")
        self.weights = state_dict
        self.loaded_in.append(threading.current_thread().name)


class Generator:
    """actor_infer's arrangement: a RequestBatcher and a WeightSwap that defers loads to the batcher's thread. Its
    batch, once `start`ed, runs until `end`, and asks for the weights (`swap.apply`) at each `token`."""

    def __init__(self, model: Model) -> None:
        self.batcher = RequestBatcher(self._run, max_sequences=8, gather_s=0.0, name=GENERATION)
        self.swap = WeightSwap(model.load, self.batcher.defer)
        self._steps: queue.Queue = queue.Queue()
        self._versions: queue.Queue = queue.Queue()
        self._running = threading.Event()
        self._batch = None

    def _run(self, requests, is_aborted):
        self._running.set()
        while self._steps.get() is not None:
            self._versions.put(self.swap.apply())
        return [None] * len(requests)

    def start(self) -> None:
        self._running.clear()
        self._batch = self.batcher.submit(Request("batch", [[1]], 1, key="k"))
        assert self._running.wait(5)

    def token(self) -> int:
        """The batch's next token: the version it is sampled with."""
        self._steps.put(True)
        return self._versions.get(timeout=5)

    def end(self) -> None:
        self._steps.put(None)
        self._batch.result(timeout=5)


def offering(swap: WeightSwap, state_dict, version) -> tuple[threading.Thread, dict]:
    """swap.offer in a thread of its own; the dict gets `returned` or `error`."""
    out: dict = {}

    def run() -> None:
        try:
            swap.offer(state_dict, version)
            out["returned"] = True
        except Exception as err:  # noqa: BLE001 - the test reads it
            out["error"] = err

    thread = threading.Thread(target=run, name="sync")
    thread.start()
    return thread, out


def offered(swap: WeightSwap, state_dict, version) -> tuple[threading.Thread, dict]:
    """`offering`, returned once the offer is pending (a batch generates)."""
    thread, out = offering(swap, state_dict, version)
    while swap._pending is None and thread.is_alive():
        threading.Event().wait(0.001)
    return thread, out


def test_with_no_batch_generating_the_sync_loads_at_once_on_the_generating_thread():
    model = Model()
    gen = Generator(model)
    gen.swap.offer("w1", 1)
    assert (model.weights, gen.swap.version, model.loaded_in) == ("w1", 1, [GENERATION])
    gen.start()
    assert gen.token() == 1 and model.loaded_in == [GENERATION]  # nothing pending: no load
    gen.end()


def test_a_generating_batch_takes_the_weights_at_its_next_token_and_the_sync_waits_for_that():
    model = Model()
    gen = Generator(model)
    gen.start()
    assert gen.token() == 0  # its first tokens: nothing offered yet
    thread, out = offering(gen.swap, "w1", 1)
    thread.join(0.2)
    assert thread.is_alive() and out == {} and model.weights == "w0"  # the sync waits for the next token
    assert gen.token() == 1  # the next token: the batch loads them itself
    thread.join(5)
    assert not thread.is_alive() and out == {"returned": True}
    assert model.loaded_in == [GENERATION] and model.weights == "w1"
    assert gen.token() == 1
    gen.end()
    assert model.loaded_in == [GENERATION]  # once: the load deferred to the batch's end found nothing left


def test_a_sync_waiting_on_a_batch_loads_when_the_batch_ends_without_another_token():
    model = Model()
    gen = Generator(model)
    gen.start()
    thread, out = offering(gen.swap, "w1", 1)
    thread.join(0.2)
    assert thread.is_alive()
    gen.end()  # vLLM's call ended (it asks once per call), or the batch's last token came
    thread.join(5)
    assert out == {"returned": True} and model.loaded_in == [GENERATION] and gen.swap.version == 1


def test_weights_that_fail_to_load_fail_the_sync_not_the_generating_batch():
    model = Model()
    gen = Generator(model)
    gen.start()
    thread, out = offered(gen.swap, "broken", 1)
    assert gen.token() == 0  # the batch goes on with what it has
    thread.join(5)
    assert isinstance(out["error"], ValueError) and "lm_head" in str(out["error"])
    assert gen.swap.version == 0 and model.weights == "w0"
    gen.end()
    gen.swap.offer("w2", 2)  # the next sync is not held up by the failed one
    assert gen.swap.version == 2


def two_pending_offers(pending: tuple, coming: tuple) -> tuple[Model, int, list[str]]:
    """Offers `pending` and then `coming` ((weights, version)) while a batch generates, then lets the batch take
    weights at its next token. The model, the version held after, and which sync returned before the batch took any
    (the dropped one); both syncs must return without error."""
    model = Model()
    gen = Generator(model)
    gen.start()
    first, out1 = offered(gen.swap, *pending)
    second, out2 = offering(gen.swap, *coming)
    for _ in range(5000):
        if not (first.is_alive() and second.is_alive()):
            break
        threading.Event().wait(0.001)
    dropped = [name for name, thread in (("pending", first), ("coming", second)) if not thread.is_alive()]
    assert model.weights == "w0"
    version = gen.token()
    first.join(5)
    second.join(5)
    gen.end()
    assert out1 == out2 == {"returned": True}
    assert model.loaded_in == [GENERATION]  # loaded once, by the batch
    return model, version, dropped


@pytest.mark.parametrize(
    ("pending", "coming", "loaded", "version", "dropped"),
    [
        (("w1", 1), ("w2", 2), "w2", 2, "pending"),  # a newer offer replaces the pending one
        # a sync resent to a restarted worker can arrive after the next one: the newer version is loaded whatever
        # the order the offers came in; an equal version is not newer either
        (("w3", 3), ("w2", 2), "w3", 3, "coming"),
        (("w3", 3), ("again", 3), "w3", 3, "coming"),
        (("w4", 4), ("w5", None), "w5", 0, "pending"),  # without a version: the later (the version is kept)
    ],
)
def test_of_two_pending_offers_the_newer_version_is_loaded_and_both_syncs_return(
    pending, coming, loaded, version, dropped
):
    model, held, returned_first = two_pending_offers(pending, coming)
    assert (model.weights, held, returned_first) == (loaded, version, [dropped])


def test_an_offer_without_a_version_keeps_the_version():
    model = Model()
    swap = Generator(model).swap
    swap.offer("w1", 3)
    swap.offer("w2", None)
    assert swap.version == 3 and model.weights == "w2"
