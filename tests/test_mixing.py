"""Domain mixers (roll_pipeline/algorithms/mixing.py): pure functions of the configured probabilities and what the
schedulers measured; and the config checks around them."""

from __future__ import annotations

import pytest

from roll_pipeline.algorithms import DOMAIN_MIXERS
from roll_pipeline.algorithms.mixing import MixState, clip_probs, observe_rollout, observe_validation
from roll_pipeline.config import ConfigError, domain_shares
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
