"""VersionStore (workers/inference/version_store.py): under partial_rollout_token each token's weights follow the
request's rule, whenever the syncs arrive; a version is loaded only when a token needs another than the model holds."""

from __future__ import annotations

import threading

import pytest

from workers.inference.version_store import VersionStore


def store() -> tuple[VersionStore, list[str]]:
    loads: list[str] = []
    return VersionStore(loads.append), loads


def test_the_rule_names_the_launch_version_then_the_next_from_the_switch_token():
    s, loads = store()
    s.add("w0", 0)
    s.add("w1", 1, keep_from=0)
    version_now = s.rule(0, 3)
    assert [version_now(t) for t in range(6)] == [0, 0, 0, 1, 1, 1]
    assert loads == ["w1"]  # the model held version 0 (the starting weights) until token 3
    assert [s.rule(0, None)(t) for t in (0, 5, 9)] == [0, 0, 0]  # no switch: the launch version throughout
    assert loads == ["w1", "w0"]  # an older version is loaded again when a token names it
    assert s.rule(1, 2)(None) == 1  # asked without a token index (vLLM's engine steps): the launch version
    s.add("w2", 2, keep_from=0)
    assert [s.rule(1, 2)(t) for t in range(4)] == [1, 1, 2, 2]  # 1 + 1, not 1 | 1 or 1 ^ 1


def test_a_new_store_holds_version_0_and_loads_a_version_once_however_its_number_was_made():
    s, loads = store()
    assert (s.newest, s.loaded) == (0, 0)
    assert s.use(0) == 0 and loads == []  # the starting weights, loaded already
    s.add("w1000", 1000)
    assert s.use(int("1000")) == 1000 and s.use(int("1000")) == 1000  # equal numbers, distinct objects
    assert loads == ["w1000"]
    s.add("w1001", 1001)  # drops 1000, which the model still holds: a request naming it is served as it stands
    assert s.use(int("1000")) == 1000 and loads == ["w1000"]


def test_a_token_waits_for_a_version_not_synced_yet():
    s, loads = store()
    s.add("w0", 0)
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(s.rule(0, 2)(2)))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not got and not loads  # version 1 does not exist yet
    s.add("w1", 1, keep_from=0)
    waiting.join(10)
    assert got == [1] and loads == ["w1"]
    assert s.newest == 1 and s.loaded == 1


def test_versions_below_keep_from_are_dropped_and_never_served():
    s, loads = store()
    for v in range(4):
        s.add(f"w{v}", v, keep_from=2)
    assert s.use(2) == 2 and s.use(3) == 3 and loads == ["w2", "w3"]
    with pytest.raises(RuntimeError, match=r"weights version 1 was dropped \(versions held: \[2, 3\]\)"):
        s.use(1)
    s.add("w4", 4)  # keep_from None: only the newest stays (and the version the model holds, 3, serves on)
    assert s.use(3) == 3 and loads == ["w2", "w3"]
    with pytest.raises(RuntimeError, match="version 2 was dropped"):
        s.use(2)
    assert s.use(4) == 4 and loads == ["w2", "w3", "w4"]
