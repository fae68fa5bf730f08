"""The difficulty ledger (schedulers/ledger.py) on its own, and in the scheduler actor on a real local Ray
cluster with scripted responses: uniform rows are passed over before generation, come back by re-test, and the
ledger resumes exactly from the scheduler's state."""

from __future__ import annotations

import pytest
import ray

from schedulers.ledger import DifficultyLedger
from tests.test_dynamic_sampling import (  # shared_stand_ins: autouse, stops the shared stand-ins after this module
    ARGS,
    N,
    config,
    rows_of,
    scheduler,
    scripted,
    shared_stand_ins,  # noqa: F401
)


def ledger(streak=1, retest_prob=0.25, size=10):
    return DifficultyLedger(size, streak=streak, retest_prob=retest_prob, seed=3, domain="math")


def test_streaks_count_uniform_groups_and_reset_on_a_mixed_one():
    book = ledger(streak=2)
    book.record(0, [True, True])
    assert book.streaks == {0: 1} and not book.uniform(0)
    book.record(0, [True, None, True])  # masked responses are left out
    assert book.streaks == {0: 2} and book.uniform(0)
    book.record(0, [False, False])  # the other way: a new streak
    assert book.streaks == {0: -1}
    book.record(0, [True, False])
    assert book.streaks == {} and not book.uniform(0)
    book.record(1, [None, None])  # nothing scored: says nothing
    assert book.streaks == {}
    book.record(1, [False])
    book.record(1, [False])
    assert book.uniform(1) and book.uniform_rows() == 1


# The ledger's streak as a state machine: (streak before, the group's verdicts) -> streak after. Written out from
# the module's rule (+n after n all-right groups in a row, -n after n all-wrong, 0 after a mixed group, unchanged
# by a group with nothing scored), not computed: a flip between all-right and all-wrong starts a new streak of 1
# in the other direction, whatever the length of the streak it ends.
RIGHT, WRONG, MIXED, NONE = [True, True, None], [False, None, False], [True, False], [None, None]
TRANSITIONS = [
    (0, RIGHT, 1), (1, RIGHT, 2), (2, RIGHT, 3), (-1, RIGHT, 1), (-2, RIGHT, 1), (-3, RIGHT, 1),
    (0, WRONG, -1), (-1, WRONG, -2), (-2, WRONG, -3), (1, WRONG, -1), (2, WRONG, -1), (3, WRONG, -1),
    (0, MIXED, 0), (2, MIXED, 0), (-2, MIXED, 0), (1, MIXED, 0), (-1, MIXED, 0),
    (0, NONE, 0), (2, NONE, 2), (-2, NONE, -2), (1, NONE, 1), (-1, NONE, -1),
    (3, [True], 4), (-3, [False], -4),  # a group of one
]


@pytest.mark.parametrize(("before", "group", "after"), TRANSITIONS)
def test_each_streak_transition(before, group, after):
    book = ledger(streak=2)
    book.load_state_dict({"size": 10, "streaks": {"5": before} if before else {}})
    book.record(5, group)
    assert book.streaks.get(5, 0) == after
    # A streak of 0 is not stored (a row never seen and a row whose last group was mixed are the same state).
    assert (5 in book.streaks) == (after != 0)
    assert book.uniform(5) == (abs(after) >= 2)
    book.record(6, [True])  # other rows are untouched
    assert book.streaks.get(5, 0) == after


def test_a_row_that_flips_back_and_forth_is_never_uniform():
    book = ledger(streak=2)
    for i in range(6):
        book.record(0, [i % 2 == 0] * 3)
        assert book.streaks[0] == (1 if i % 2 == 0 else -1) and not book.uniform(0)
    assert book.uniform_rows() == 0
    assert not any(book.skip(0, call=0, check=c) for c in range(100))


def test_skips_only_uniform_rows_and_lets_about_retest_prob_of_them_through():
    book = ledger(retest_prob=0.25)
    book.record(0, [True] * 4)
    assert not any(book.skip(1, call=0, check=c) for c in range(1000))  # never seen: never skipped
    through = sum(not book.skip(0, call=c // 100, check=c % 100) for c in range(10000))
    # Binomial(10000, 0.25): standard deviation 43; 5 of them either way.
    assert abs(through - 2500) < 5 * 43
    # The draws are a pure function of seed, domain, call and counter: deterministic.
    again = ledger(retest_prob=0.25)
    again.record(0, [True])
    assert [book.skip(0, 7, c) for c in range(200)] == [again.skip(0, 7, c) for c in range(200)]
    assert not any(ledger(retest_prob=1.0).skip(0, 0, c) for c in range(100))


def test_a_draw_equal_to_retest_prob_skips():
    """The re-test lets a uniform row through when its draw is below ``retest_prob``, so that exactly that share
    of draws comes through: a draw equal to it skips (one value in 2**64, found here by using it as the bound)."""
    book = ledger(retest_prob=0.5)
    book.record(0, [True])
    draws = [book._draw(2, c) for c in range(8)]
    for c, draw in enumerate(draws):
        book.retest_prob = draw
        assert book.skip(0, 2, c), (c, draw)
        book.retest_prob = min(d for d in draws if d > draw) if draw < max(draws) else 1.0
        assert not book.skip(0, 2, c), (c, draw)


def test_a_streak_past_the_threshold_still_counts_as_uniform():
    book = ledger(streak=2)
    for _ in range(5):
        book.record(0, [True])
    book.record(1, [False])
    book.record(2, [False])
    book.record(2, [False])
    assert book.streaks == {0: 5, 1: -1, 2: -2}
    assert book.uniform(0) and book.uniform_rows() == 2


def test_state_round_trips_and_refuses_other_data():
    import json

    book = ledger()
    book.record(3, [True])
    book.record(4, [False, False])
    other = ledger()
    other.load_state_dict(book.state_dict())
    assert other.streaks == {3: 1, 4: -1}
    for size in (9, 11):  # fewer rows or more
        with pytest.raises(ValueError, match=f"ledger state is for 10 rows, not {size}: the data changed"):
            ledger(size=size).load_state_dict(book.state_dict())
    # A large data set's state, as a checkpoint reads it back (new int objects): the same size is accepted.
    big = ledger(size=50_000)
    big.record(49_999, [True])
    again = ledger(size=50_000)
    again.load_state_dict(json.loads(json.dumps(big.state_dict())))
    assert again.streaks == {49_999: 1}


def steps(actor, n, share=3):
    out = []
    for _ in range(n):
        batch, m = ray.get(actor.get_batch.remote(share, N, ARGS))
        out.append(([int(i[1:]) for i in batch.meta["id"][::N]], m))
    return out


def counts(run):
    keys = ("prompts_drawn", "groups_dropped", "skipped_by_ledger", "ledger_uniform_rows")
    return [(ids, [m.get(f"scheduler/math/{k}") for k in keys]) for ids, m in run]


@pytest.mark.slow
def test_the_scheduler_passes_over_uniform_rows_and_resumes_its_ledger(local_ray):
    patterns = ["same1", "half", "same0"] * 8  # two rows in three give uniform groups (std_filter drops them)
    common = ["deterministic=true", "dynamic_sampling.max_running_requests=4", "dynamic_sampling.max_prompts_factor=8"]
    results = {}
    for enabled in (False, True):
        cfg = config(
            [*common, f"dynamic_sampling.ledger.enabled={str(enabled).lower()}", "dynamic_sampling.ledger.retest_prob=0.1"],
            group_filters="{std_filter: {}}",
        )
        actor, _ = scheduler(cfg, rows_of(patterns), scripted())
        results[enabled] = steps(actor, 8)
        if enabled:
            state = ray.get(actor.state_dict.remote())
            resumed, _ = scheduler(cfg, rows_of(patterns), scripted())
            ray.get(resumed.load_state_dict.remote(state))
            # The same draws, skips and batches after a resume as without one.
            assert counts(steps(resumed, 3)) == counts(steps(actor, 3))
    for run in results.values():
        for ids, m in run:
            assert m["scheduler/math/groups_kept"] == 3 and all(patterns[i] == "half" for i in ids)
    off = [m for _, m in results[False]]
    on = [m for _, m in results[True]]
    assert all("scheduler/math/skipped_by_ledger" not in m for m in off)
    # The first pass over the data (24 rows, ~9 drawn a step) fills the ledger; from then on uniform rows are
    # mostly skipped before generation: fewer prompts generated and dropped for the same kept groups.
    late = slice(4, 8)
    dropped_off = sum(m["scheduler/math/groups_dropped"] for m in off[late])
    dropped_on = sum(m["scheduler/math/groups_dropped"] for m in on[late])
    assert dropped_on < dropped_off / 2, (dropped_on, dropped_off)
    assert sum(m["scheduler/math/skipped_by_ledger"] for m in on[late]) > 0
    assert on[-1]["scheduler/math/ledger_uniform_rows"] == 16  # every same1/same0 row, none of the half ones
    # (Re-tests of uniform rows, at retest_prob, are tested on the ledger itself above: with 0.1 and these few
    # draws this run happens to retest none in its last steps, which is within chance.)
