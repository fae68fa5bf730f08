"""Domain mixers (roll_core/algorithms/mixing.py): pure functions of the configured probabilities and what the
schedulers measured; and the config checks around them."""

from __future__ import annotations

import pytest

from roll_core.algorithms import DOMAIN_MIXERS
from roll_core.algorithms.mixing import MixState, clip_probs, observe_rollout, observe_validation
from roll_core.config import ConfigError, domain_shares
from roll_pipeline.driver.names import load_run_config
from tests.conftest import EXAMPLES

BASE = {"math": 0.5, "code": 0.5}
PARAMS = {"floor": 0.1, "ceil": 0.9, "strength": 1.0, "validation_weight": 1.0}


def rollout(math_kept, math_s, code_kept, code_s):
    return {
        "scheduler/math/groups_kept": math_kept, "scheduler/math/wall_s": math_s,
        "scheduler/code/groups_kept": code_kept, "scheduler/code/wall_s": code_s,
    }


def test_static_is_the_configured_probabilities():
    state = MixState()
    observe_rollout(state, rollout(8, 1.0, 8, 4.0), list(BASE), 0.0)
    assert DOMAIN_MIXERS.get("static")(BASE, state, **PARAMS) == BASE


def test_progress_moves_prompts_to_the_domain_that_keeps_more_groups_per_second():
    state = MixState()
    assert DOMAIN_MIXERS.get("progress")(BASE, state, **PARAMS) == BASE  # nothing measured yet
    # math keeps 8 groups a second, code 2 (its groups are slower, or dropped more often)
    observe_rollout(state, rollout(8, 1.0, 8, 4.0), list(BASE), 0.0)
    probs = DOMAIN_MIXERS.get("progress")(BASE, state, **PARAMS)
    assert probs["math"] == pytest.approx(0.8) and probs["code"] == pytest.approx(0.2)
    assert sum(probs.values()) == pytest.approx(1.0)
    # strength 0: the rates do not matter
    assert DOMAIN_MIXERS.get("progress")(BASE, state, **(PARAMS | {"strength": 0.0})) == pytest.approx(BASE)
    # a floor keeps the slow domain alive
    floored = DOMAIN_MIXERS.get("progress")(BASE, state, **(PARAMS | {"floor": 0.3}))
    assert floored == pytest.approx({"math": 0.7, "code": 0.3})
    assert domain_shares(floored, 16) == {"math": 11, "code": 5}


def test_a_validation_gain_adds_weight():
    state = MixState()
    observe_rollout(state, rollout(4, 1.0, 4, 1.0), list(BASE), 0.0)  # equal rates
    observe_validation(state, {"val_domain/math/correct_mean": 0.2, "val_domain/code/correct_mean": 0.5}, list(BASE))
    assert state.gain == {}  # one validation: no change yet
    observe_validation(state, {"val_domain/math/correct_mean": 0.6, "val_domain/code/correct_mean": 0.4}, list(BASE))
    assert state.gain == pytest.approx({"math": 0.4, "code": -0.1})
    probs = DOMAIN_MIXERS.get("progress")(BASE, state, **PARAMS)
    assert probs["math"] == pytest.approx(1.4 / 2.4)  # a loss adds nothing, and takes nothing either


def test_rates_are_smoothed_and_state_round_trips():
    state = MixState()
    observe_rollout(state, rollout(8, 1.0, 8, 1.0), list(BASE), 0.5)
    observe_rollout(state, rollout(0, 1.0, 8, 1.0), list(BASE), 0.5)
    assert state.rate == {"math": 4.0, "code": 8.0}
    observe_rollout(state, {"scheduler/math/groups_kept": 3.0}, list(BASE), 0.5)  # no wall time: ignored
    assert MixState.from_state(state.state_dict()) == state


def test_clipping_keeps_bounds_and_sums_to_one():
    probs = clip_probs({"a": 100.0, "b": 1.0, "c": 0.0}, 0.1, 0.7)
    assert probs == pytest.approx({"a": 0.7, "b": 0.2, "c": 0.1})
    assert clip_probs({"a": 1.0, "b": 1.0}, 0.1, 0.9) == pytest.approx({"a": 0.5, "b": 0.5})


def test_config_checks_the_mixer():
    with pytest.raises(ConfigError, match="domain_mixer.type: must be one of"):
        load_run_config(EXAMPLES / "math_code.yaml", ["domain_mixer.type=greedy"])
    with pytest.raises(ConfigError, match="domain_mixer.floor: floor 0.01 x rollout_batch_size"):
        load_run_config(EXAMPLES / "math_code.yaml", ["domain_mixer.type=progress", "domain_mixer.floor=0.01"])
    with pytest.raises(ConfigError, match="need 0 <= floor < ceil <= 1"):
        load_run_config(EXAMPLES / "math_code.yaml", ["domain_mixer.floor=0.95"])
    assert load_run_config(EXAMPLES / "math_code.yaml", ["domain_mixer.type=progress"]).config.domain_mixer.type == "progress"


def test_a_rollout_without_a_positive_wall_time_or_a_count_leaves_that_domain_alone():
    state = MixState()
    domains = ["math", "code", "open"]
    # math: no count; code: a negative wall time; open comes after both and is measured
    metrics = {"scheduler/code/groups_kept": 3.0, "scheduler/code/wall_s": -0.5,
               "scheduler/open/groups_kept": 3.0, "scheduler/open/wall_s": 2.0}
    observe_rollout(state, metrics, domains, 0.25)
    assert state.rate == {"open": 1.5}  # 3 groups in 2 s, not 3 // 2
    observe_rollout(state, {"scheduler/open/groups_kept": 5.0, "scheduler/open/wall_s": 1.0}, domains, 0.25)
    assert state.rate == {"open": pytest.approx(0.25 * 1.5 + 0.75 * 5.0)}  # the new rate weighs 1 - smoothing


def test_a_validation_without_a_domains_accuracy_or_with_nan_leaves_it_alone():
    state = MixState()
    domains = ["math", "code", "open"]
    observe_validation(state, {"val_domain/code/correct_mean": float("nan"), "val_domain/open/correct_mean": 0.5},
                       domains)
    assert state.accuracy == {"open": 0.5} and state.gain == {}


def test_clipping_all_zero_weights_gives_equal_shares_and_an_all_clipped_set_is_renormalised():
    assert clip_probs({"a": 0.0, "b": 0.0}, 0.0, 1.0) == {"a": 0.5, "b": 0.5}
    # Every domain hits the ceiling (0.4 x 2 < 1): the clipped values are normalised to sum to 1.
    assert clip_probs({"a": 3.0, "b": 1.0}, 0.0, 0.4) == pytest.approx({"a": 0.5, "b": 0.5})
    # What the clipped domain gives up is shared equally by the others when their weights are all zero.
    assert clip_probs({"a": 1.0, "b": 0.0, "c": 0.0}, 0.0, 0.6) == pytest.approx({"a": 0.6, "b": 0.2, "c": 0.2})


def test_progress_weights_are_the_rates_relative_to_their_mean_to_the_power_strength():
    state = MixState(rate={"math": 0.1, "code": 0.3})  # a mean rate under 1 moves the mix as well
    probs = DOMAIN_MIXERS.get("progress")(BASE, state, **(PARAMS | {"strength": 2.0, "floor": 0.0, "ceil": 1.0}))
    assert probs == pytest.approx({"math": 0.1, "code": 0.9})  # 1 : 9, the square of 1 : 3


def test_progress_gives_a_domain_that_kept_nothing_only_the_floor_whatever_the_strength():
    params = PARAMS | {"floor": 0.0, "ceil": 1.0, "validation_weight": 0.0}
    state = MixState(rate={"math": 0.0, "code": 2.0})
    for strength in (0.0, 1.0):
        probs = DOMAIN_MIXERS.get("progress")(BASE, state, **(params | {"strength": strength}))
        assert probs == {"math": 0.0, "code": 1.0}
    # Nothing kept anywhere: nothing to compare, so the configured probabilities stand.
    base = {"math": 0.75, "code": 0.25}
    assert DOMAIN_MIXERS.get("progress")(base, MixState(rate={"math": 0.0, "code": 0.0}), **params) == base


def test_a_domain_without_a_measured_gain_gets_no_validation_bonus():
    state = MixState(rate={"math": 1.0, "code": 1.0}, gain={"code": 0.5})
    probs = DOMAIN_MIXERS.get("progress")(BASE, state, **(PARAMS | {"floor": 0.0, "ceil": 1.0}))
    assert probs == pytest.approx({"math": 1.0 / 2.5, "code": 1.5 / 2.5})
