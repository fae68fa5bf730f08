"""HeldUpdate: a weight update the trainer drives call by call, run on the thread that holds the generation lock
(workers/inference/held_update.py)."""

from __future__ import annotations

import threading

import pytest

from workers.inference.held_update import HeldUpdate


def hold_in_thread(update: HeldUpdate, events: list) -> tuple[threading.Thread, list]:
    errors = []

    def holder() -> None:
        try:
            update.hold(begin=lambda: events.append(("begin", threading.get_ident())),
                        end=lambda: events.append(("end", threading.get_ident())))
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=holder)
    thread.start()
    return thread, errors


def test_the_trainers_calls_run_in_order_on_the_holders_thread_between_begin_and_end():
    update, events = HeldUpdate(), []
    thread, errors = hold_in_thread(update, events)
    update.wait_begun(timeout=5)
    assert [update.run(lambda k=k: events.append((k, threading.get_ident())) or k) for k in range(3)] == [0, 1, 2]
    assert events[-1][0] == 2 and not any(e[0] == "end" for e in events)  # still held until the finish
    update.close()
    thread.join(5)
    assert [e[0] for e in events] == ["begin", 0, 1, 2, "end"]
    assert {e[1] for e in events} == {thread.ident} and not errors


def test_a_failing_call_raises_in_the_trainer_and_the_update_still_ends():
    update, events = HeldUpdate(), []
    thread, errors = hold_in_thread(update, events)
    update.wait_begun(timeout=5)
    with pytest.raises(ZeroDivisionError):
        update.run(lambda: 1 / 0)
    assert update.run(lambda: "next") == "next"
    update.close()
    thread.join(5)
    assert events[-1][0] == "end" and not errors


def test_an_update_that_cannot_begin_says_why_to_the_trainer():
    update = HeldUpdate()
    with pytest.raises(RuntimeError, match="engine asleep"):
        update.hold(begin=lambda: (_ for _ in ()).throw(RuntimeError("engine asleep")), end=lambda: None)
    with pytest.raises(RuntimeError, match="engine asleep"):
        update.wait_begun(timeout=1)
    replaced = HeldUpdate()
    replaced.refuse(RuntimeError("replaced by a newer sync"))
    with pytest.raises(RuntimeError, match="replaced"):
        replaced.wait_begun(timeout=1)


def test_a_refusal_after_the_update_began_changes_nothing():
    update, events = HeldUpdate(), []
    thread, _ = hold_in_thread(update, events)
    update.wait_begun(timeout=5)
    update.refuse(RuntimeError("too late"))
    update.wait_begun(timeout=1)
    update.close()
    thread.join(5)


def test_a_trainer_that_goes_silent_does_not_hold_the_lock_for_ever(monkeypatch):
    monkeypatch.setattr(HeldUpdate, "IDLE_S", 0.05)
    update, events = HeldUpdate(), []
    thread, errors = hold_in_thread(update, events)
    thread.join(5)
    assert isinstance(errors[0], TimeoutError) and events == [("begin", thread.ident)]  # not ended: given up
    with pytest.raises(RuntimeError, match="given up"):
        update.run(lambda: None)
