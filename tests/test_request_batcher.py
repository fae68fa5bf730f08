"""actor_infer's request batcher: concurrent requests become batches; aborts end them without a result."""

from __future__ import annotations

import threading
import time

import pytest

from workers.inference.request_batcher import Request, RequestBatcher


class Recorder:
    """A batch function that records each batch's request ids and can block until released."""

    def __init__(self, hold: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.started = threading.Event()
        if not hold:
            self.release.set()
        self.saw_abort: list[bool] = []

    def __call__(self, requests, is_aborted):
        self.batches.append([r.request_id for r in requests])
        self.started.set()
        # A generation loop checks is_aborted after every token; this one polls until released or all aborted.
        while not self.release.wait(0.01):
            if all(is_aborted(i) for i in range(len(requests))):
                self.saw_abort.append(True)
                break
        return [f"out-{r.request_id}" for r in requests]


def req(request_id, prompts=1, n=4, key="sample"):
    return Request(request_id, [[1, 2]] * prompts, n, key=key)


def test_requests_that_arrive_together_share_one_batch():
    run = Recorder(hold=True)
    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.0)
    first = batcher.submit(req("a"))
    assert run.started.wait(2)
    futures = [batcher.submit(req(x)) for x in "bcd"]  # arrive while "a" runs: joined into the next batch
    run.release.set()
    assert [f.result(2) for f in [first, *futures]] == ["out-a", "out-b", "out-c", "out-d"]
    assert run.batches == [["a"], ["b", "c", "d"]]


def test_batches_respect_the_sequence_cap_and_the_generating_arguments():
    run = Recorder(hold=True)
    batcher = RequestBatcher(run, max_sequences=8, gather_s=0.0)
    blocker = batcher.submit(req("x"))
    assert run.started.wait(2)
    futures = [batcher.submit(r) for r in [req("a"), req("g", key="greedy"), req("b"), req("c")]]
    run.release.set()
    for f in [blocker, *futures]:
        f.result(2)
    # 4 sequences each, at most 8 per batch; the greedy request never joins sampling ones.
    assert run.batches == [["x"], ["a", "b"], ["g"], ["c"]]


def test_a_request_larger_than_the_cap_runs_alone():
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=4, gather_s=0.0)
    assert batcher.submit(req("big", prompts=3)).result(2) == "out-big"


def test_abort_of_pending_and_running_requests_returns_none():
    run = Recorder(hold=True)
    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.0)
    running = batcher.submit(req("r"))
    assert run.started.wait(2)
    pending = batcher.submit(req("p"))
    assert batcher.abort(["r", "p", "unknown"]) == 2
    assert pending.result(2) is None
    assert running.result(2) is None  # the running batch stopped early: every row in it was aborted
    assert run.saw_abort == [True]
    assert run.batches == [["r"]]  # the pending request never ran


def test_a_failing_batch_fails_its_requests_and_the_batcher_goes_on():
    calls = []

    def run(requests, is_aborted):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return ["ok" for _ in requests]

    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.0)
    failed = batcher.submit(req("a"))
    try:
        failed.result(2)
        raise AssertionError("expected the batch's error")
    except RuntimeError as err:
        assert "out of memory" in str(err)
    time.sleep(0.05)
    assert batcher.submit(req("b")).result(2) == "ok"


def test_an_abort_that_overtakes_its_request_still_aborts_it():
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.0)
    assert batcher.abort(["late"]) == 0
    assert batcher.submit(req("late")).result(2) is None
    assert batcher.submit(req("other")).result(2) == "out-other"
    assert run.batches == [["other"]]


def test_requests_aborted_during_the_gathering_window_leave_the_batcher_working():
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.2, max_gather_s=0.5)
    doomed = batcher.submit(req("doomed"))
    time.sleep(0.05)  # the batcher is now inside its gathering window
    assert batcher.abort(["doomed"]) == 1
    assert doomed.result(2) is None
    time.sleep(0.3)
    assert batcher.submit(req("next")).result(2) == "out-next"
    assert run.batches == [["next"]]


def test_a_burst_of_requests_is_gathered_into_one_batch():
    """Requests that keep arriving within the gathering window join one batch, however far apart the machine's
    load spreads them (a window of 60 s; the burst fills the batch, which then starts)."""
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=20, gather_s=60.0, max_gather_s=120.0)
    futures = []
    for x in "abcde":  # one Ray call at a time, as from several schedulers
        futures.append(batcher.submit(req(x)))
        time.sleep(0.01)
    for f in futures:
        f.result(30)  # well inside the window: the full batch did not wait it out
    assert run.batches == [["a", "b", "c", "d", "e"]]


def test_a_lone_request_runs_once_the_window_passes_quietly():
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=64, gather_s=0.01, max_gather_s=60.0)
    assert batcher.submit(req("a")).result(30) == "out-a"
    assert run.batches == [["a"]]


def test_gathering_stops_when_the_batch_is_full():
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=8, gather_s=60.0, max_gather_s=120.0)
    first = batcher.submit(req("a"))
    time.sleep(0.1)  # the batcher is gathering: 4 of 8 sequences
    second = batcher.submit(req("b"))  # now full: the batch starts without waiting out the window
    # results long before the 60 s window would end (the timeout raises otherwise)
    assert first.result(30) == "out-a" and second.result(30) == "out-b"
    assert run.batches == [["a", "b"]]


def wave_req(request_id, source, wave, size):
    return Request(request_id, [[1, 2]], 4, key="sample", wave=(source, wave, size))


def test_gathering_stops_once_every_source_has_a_whole_wave():
    """A domain's scheduler sends a wave of draws as a few requests and says so: once every domain has all of
    one wave's requests in, the batch starts (a 60 s window would otherwise hold it; the timeouts raise then)."""
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=64, gather_s=60.0, max_gather_s=120.0, sources=["math"])
    assert batcher.submit(wave_req("a", "math", "0/0", 1)).result(30) == "out-a"
    # Two requests of one wave: the first alone does not start a batch, the second completes the wave.
    gate = threading.Event()
    batcher.defer(gate.wait)  # the serving thread waits here until the first request is pending
    first = batcher.submit(wave_req("b", "math", "1/0", 2))
    gate.set()
    assert not first.done() and run.batches == [["a"]]
    time.sleep(0.3)  # gathering: one request of two is in (without the rule on the count it would run now)
    assert not first.done()
    second = batcher.submit(wave_req("c", "math", "1/0", 2))
    assert first.result(30) == "out-b" and second.result(30) == "out-c"
    assert run.batches == [["a"], ["b", "c"]]


def test_a_wave_waits_for_the_other_sources_within_the_window():
    """With two domains, one domain's whole wave still gathers until the other's is in too (or the window ends)."""
    run = Recorder()
    batcher = RequestBatcher(run, max_sequences=64, gather_s=60.0, max_gather_s=120.0, sources=["math", "code"])
    gate = threading.Event()
    batcher.defer(gate.wait)
    first = batcher.submit(wave_req("m", "math", "0/0", 1))
    gate.set()
    time.sleep(0.3)
    assert not first.done()  # math's wave is whole, code's is not in yet
    second = batcher.submit(wave_req("c", "code", "0/0", 1))
    assert first.result(30) == "out-m" and second.result(30) == "out-c"
    assert run.batches == [["m", "c"]]


def test_call_runs_other_work_on_the_serving_thread_between_batches():
    """Weight loads and the model's own load go through `call`/`defer`: on the one thread that runs the batches (so
    that all of a worker's torch work runs on one thread), never while a batch runs, before the batches waiting."""
    run = Recorder(hold=True)
    batcher = RequestBatcher(run, max_sequences=4, gather_s=0.0, name="serving")
    assert batcher.call(lambda: threading.current_thread().name) == "serving"
    with pytest.raises(ZeroDivisionError):  # the call's error reaches its caller; the thread serves on
        batcher.call(lambda: 1 / 0)
    first = batcher.submit(req("a"))
    assert run.started.wait(5)
    order: list[str] = []
    deferred = batcher.defer(lambda: order.append("call") or len(run.batches))
    waiting = batcher.submit(req("b"))
    time.sleep(0.1)
    assert not deferred.done() and order == []  # batch "a" still runs
    run.release.set()
    assert deferred.result(timeout=5) == 1  # after batch "a", before batch "b"
    assert first.result(timeout=5) == "out-a" and waiting.result(timeout=5) == "out-b"
    assert run.batches == [["a"], ["b"]]


def test_a_call_from_the_serving_thread_runs_at_once():
    inner: list[str] = []
    holder: dict = {}

    def run(requests, is_aborted):
        inner.append(holder["batcher"].call(lambda: threading.current_thread().name))  # would wait for itself
        return [None] * len(requests)

    holder["batcher"] = batcher = RequestBatcher(run, max_sequences=4, gather_s=0.0, name="serving")
    assert batcher.submit(req("a")).result(timeout=5) is None
    assert inner == ["serving"]
