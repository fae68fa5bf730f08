"""WeightSwap (workers/inference/weight_swap.py): a weight sync loads between two tokens of the generating batch, or
at once when no batch runs, and returns only when its weights are in."""

from __future__ import annotations

import threading

import pytest

from workers.inference.weight_swap import WeightSwap


class Model:
    def __init__(self) -> None:
        self.weights, self.loaded_in = "w0", []

    def load(self, state_dict) -> None:
        if state_dict == "broken":
            raise ValueError("shape mismatch for lm_head.weight")
        self.weights = state_dict
        self.loaded_in.append(threading.current_thread().name)


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
    """`offering`, returned once the offer is pending (the caller holds the generation lock)."""
    thread, out = offering(swap, state_dict, version)
    while swap._pending is None and thread.is_alive():
        threading.Event().wait(0.001)
    return thread, out


def test_with_no_batch_generating_the_sync_loads_at_once():
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    swap.offer("w1", 1)
    assert (model.weights, swap.version, model.loaded_in) == ("w1", 1, [threading.current_thread().name])
    assert swap.apply() == 1 and model.loaded_in == [threading.current_thread().name]  # nothing pending: no load


def test_a_generating_batch_takes_the_weights_at_its_next_token_and_the_sync_waits_for_that():
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    generation = threading.current_thread().name  # this thread is the generating batch
    with lock:  # a batch is generating
        assert swap.apply() == 0  # its first tokens: nothing offered yet
        thread, out = offering(swap, "w1", 1)
        thread.join(0.2)
        assert thread.is_alive() and out == {} and model.weights == "w0"  # the sync waits for the next token
        assert swap.apply() == 1  # the next token: the batch loads them itself
        thread.join(5)
        assert not thread.is_alive() and out == {"returned": True}
        assert model.loaded_in == [generation] and model.weights == "w1"
        assert swap.apply() == 1


def test_a_sync_waiting_on_a_batch_loads_itself_when_the_batch_ends_without_another_token():
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    lock.acquire()
    thread, out = offering(swap, "w1", 1)
    thread.join(0.2)
    assert thread.is_alive()
    lock.release()  # vLLM's call ended (it asks once per call), or the batch's last token came
    thread.join(5)
    assert out == {"returned": True} and model.loaded_in == ["sync"] and swap.version == 1


def test_weights_that_fail_to_load_fail_the_sync_not_the_generating_batch():
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    with lock:
        thread, out = offered(swap, "broken", 1)
        assert swap.apply() == 0  # the batch goes on with what it has
    thread.join(5)
    assert isinstance(out["error"], ValueError) and "lm_head" in str(out["error"])
    assert swap.version == 0 and model.weights == "w0"
    swap.offer("w2", 2)  # the next sync is not held up by the failed one
    assert swap.version == 2


def two_pending_offers(pending: tuple, coming: tuple) -> tuple[Model, int, list[str]]:
    """Offers `pending` and then `coming` ((weights, version)) while a batch holds the generation lock, then lets
    the batch take weights at its next token. The model, the version held after, and which sync returned before
    the batch took any (the dropped one); both syncs must return without error."""
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    with lock:
        first, out1 = offered(swap, *pending)
        second, out2 = offering(swap, *coming)
        for _ in range(5000):
            if not (first.is_alive() and second.is_alive()):
                break
            threading.Event().wait(0.001)
        dropped = [name for name, thread in (("pending", first), ("coming", second)) if not thread.is_alive()]
        assert model.weights == "w0"
        version = swap.apply()
    first.join(5)
    second.join(5)
    assert out1 == out2 == {"returned": True}
    assert model.loaded_in == [threading.current_thread().name]  # loaded once, by the batch
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
    model, lock = Model(), threading.Lock()
    swap = WeightSwap(model.load, lock)
    swap.offer("w1", 3)
    swap.offer("w2", None)
    assert swap.version == 3 and model.weights == "w2"
