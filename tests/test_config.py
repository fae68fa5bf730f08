"""Config loading: strict types, key paths in errors, references, overrides, validation and resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from roll_core.config import ConfigError, domain_shares, interpolate, load_config, parse_override
from roll_pipeline.driver.names import load_run_config
from tests.conftest import EXAMPLES

BASE = {
    "pretrain": "./model",
    "max_steps": 3,
    "rollout_batch_size": 4,
    "num_return_sequences_in_group": 4,
    "domain_interleave_probs": {"math": 0.5, "code": 0.5},
    "rewards": {
        "math": {"worker": "math_rule", "tag_included": ["add"]},
        "code": {"worker": "code_sandbox", "tag_included": ["string"]},
    },
    "data": {"train_files": ["data/train.jsonl"]},
    "actor_train": {"training_args": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}},
}


def write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def load(tmp_path: Path, cfg: dict, overrides: list[str] | None = None):
    """The config as a run loads it: the core loader and the driver's name checks."""
    return load_run_config(write(tmp_path, cfg), overrides)


def error_of(tmp_path: Path, cfg: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, cfg, overrides)
    return str(info.value)


def test_valid_config_resolves_paths_and_defaults(tmp_path):
    resolved = load(tmp_path, BASE)
    cfg = resolved.config
    assert cfg.pretrain == str(tmp_path / "model")
    assert cfg.actor_train.model_args.model_name_or_path == str(tmp_path / "model")
    assert cfg.actor_infer.model_args.model_name_or_path == str(tmp_path / "model")
    assert cfg.data.train_files == [str(tmp_path / "data" / "train.jsonl")]
    assert cfg.output_dir.endswith("runs/rlvr")
    assert resolved.domain_shares == {"math": 2, "code": 2}


def test_config_is_frozen(tmp_path):
    cfg = load(tmp_path, BASE).config
    with pytest.raises(AttributeError):
        cfg.max_steps = 5


def test_unknown_key_names_its_path_and_suggests(tmp_path):
    bad = {**BASE, "actor_train": {"training_args": {"learning_rat": 1e-5}}}
    msg = error_of(tmp_path, bad)
    assert "actor_train.training_args.learning_rat: unknown key" in msg
    assert "did you mean 'learning_rate'" in msg


def test_unknown_key_inside_a_domain(tmp_path):
    bad = {**BASE, "rewards": {**BASE["rewards"], "code": {**BASE["rewards"]["code"], "timeout": 3}}}
    assert "rewards.code.timeout: unknown key" in error_of(tmp_path, bad)


def test_wrong_type_names_path_and_types(tmp_path):
    msg = error_of(tmp_path, {**BASE, "max_steps": "ten"})
    assert msg == f"{tmp_path / 'cfg.yaml'}:2: max_steps: expected int, got 'ten' (str)"


def test_errors_name_the_line_of_the_key_in_the_file(tmp_path):
    bad = {**BASE, "data": {"train_files": ["x.jsonl"], "prompt_lenght": 8}}
    path = tmp_path / "cfg.yaml"
    msg = error_of(tmp_path, bad)
    line = path.read_text().splitlines().index("  prompt_lenght: 8") + 1
    assert msg == f"{path}:{line}: data.prompt_lenght: unknown key (did you mean 'prompt_length'?)"
    # A value out of range names its own line; a key missing from a section names the section's line.
    msg = error_of(tmp_path, {**BASE, "data": {"train_files": ["x.jsonl"], "on_long_prompt": "skip"}})
    line = path.read_text().splitlines().index("  on_long_prompt: skip") + 1
    assert msg == f"{path}:{line}: data.on_long_prompt: expected one of ['error', 'drop'], got 'skip'"
    msg = error_of(tmp_path, {**BASE, "data": {"prompt_length": 8}})
    data_line = path.read_text().splitlines().index("data:") + 1
    assert msg == f"{path}:{data_line}: data.train_files: required key is missing"


def test_a_wrong_type_inside_a_domain_names_the_domain(tmp_path):
    path = tmp_path / "cfg.yaml"
    bad = {**BASE, "rewards": {**BASE["rewards"], "code": {**BASE["rewards"]["code"], "world_size": "two"}}}
    msg = error_of(tmp_path, bad)
    line = path.read_text().splitlines().index("    world_size: two") + 1
    assert msg == f"{path}:{line}: rewards.code.world_size: expected int, got 'two' (str)"
    msg = error_of(tmp_path, BASE, ["rewards.math.rollout={type: multi_turn, max_turns: many}"])
    assert msg == "rewards.math.rollout.max_turns: expected int, got 'many' (str)"


def test_errors_from_overrides_name_no_line(tmp_path):
    msg = error_of(tmp_path, BASE, ["max_steps=ten"])
    assert msg == "max_steps: expected int, got 'ten' (str)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "exp_name: x\ndata:\n  train_files: [a.jsonl\n  prompt_length: 8\n",
            "cfg.yaml:4:16: not valid YAML: expected ',' or ']', but got ':' "
            "(while parsing a flow sequence at line 3)\n      prompt_length: 8\n                   ^",
        ),
        (
            "exp_name: x\nmax_steps: 3: 4\n",
            "cfg.yaml:2:13: not valid YAML: mapping values are not allowed here\n    max_steps: 3: 4\n",
        ),
        (
            "exp_name: x\n\tmax_steps: 3\n",
            "cfg.yaml:2:1: not valid YAML: found character '\\t' that cannot start",
        ),
    ],
)
def test_malformed_yaml_names_file_line_and_column(tmp_path, text, expected):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{tmp_path}/{expected}")


def test_missing_required_key(tmp_path):
    cfg = {k: v for k, v in BASE.items() if k != "rollout_batch_size"}
    assert error_of(tmp_path, cfg) == "rollout_batch_size: required key is missing"


def test_float_fields_accept_ints_and_exponent_strings(tmp_path):
    cfg = load(tmp_path, BASE, ["actor_train.training_args.learning_rate=1e-5", "pg_clip=0.25"]).config
    assert cfg.actor_train.training_args.learning_rate == pytest.approx(1e-5)
    assert cfg.pg_clip == 0.25


def test_probabilities_must_sum_to_one(tmp_path):
    msg = error_of(tmp_path, {**BASE, "domain_interleave_probs": {"math": 0.5, "code": 0.4}})
    assert "domain_interleave_probs: must sum to 1, got 0.9 (math=0.5, code=0.4)" in msg


def test_domain_without_reward_worker(tmp_path):
    probs = {"math": 0.5, "code": 0.25, "poetry": 0.25}
    msg = error_of(tmp_path, {**BASE, "domain_interleave_probs": probs})
    assert "domain_interleave_probs.poetry: domain 'poetry' has no reward worker under rewards" in msg


def test_share_of_zero_prompts_is_an_error(tmp_path):
    cfg = {**BASE, "domain_interleave_probs": {"math": 0.9, "code": 0.1}}
    msg = error_of(tmp_path, cfg)
    assert "domain_interleave_probs.code: gives domain 'code' 0 of rollout_batch_size=4 prompts" in msg


def test_batch_that_does_not_divide(tmp_path):
    msg = error_of(tmp_path, BASE, ["num_return_sequences_in_group=3"])
    assert "actor_train.training_args: rollout_batch_size * num_return_sequences_in_group = 12" in msg
    assert "= 8" in msg


def test_several_problems_are_reported_together(tmp_path):
    msg = error_of(tmp_path, BASE, ["max_steps=0", "pg_clip=1.5"])
    assert "max_steps: must be >= 1" in msg and "pg_clip: must be in (0, 1), got 1.5" in msg


def test_same_tag_in_two_domains(tmp_path):
    rewards = {**BASE["rewards"], "code": {"worker": "code_sandbox", "tag_included": ["string", "add"]}}
    msg = error_of(tmp_path, {**BASE, "rewards": rewards})
    assert "rewards.code.tag_included: tag 'add' is also routed to domain 'math'" in msg


def test_a_sample_budget_past_the_worker_timeout_is_refused(tmp_path):
    # The worker masks at 30 s; the sandbox's own work around the runs needs a margin: max(2 s, 20%) -> 24 s.
    code = {"worker": "code_sandbox", "tag_included": ["string"], "timeout_s": 30, "options": {"sample_timeout_s": 30}}
    for budget in (30, 29.5, 24.5):
        code["options"]["sample_timeout_s"] = budget
        msg = error_of(tmp_path, {**BASE, "rewards": {**BASE["rewards"], "code": code}})
        assert "rewards.code.options.sample_timeout_s: must be at most 24 (timeout_s 30" in msg
    code["options"]["sample_timeout_s"] = 24
    try:
        load(tmp_path, {**BASE, "rewards": {**BASE["rewards"], "code": code}})
    except ConfigError as err:
        assert "sample_timeout_s" not in str(err)
    # A component of `workers` is checked against its own timeout (10 s -> 8 s).
    component = {"worker": "code_sandbox", "timeout_s": 10, "options": {"sample_timeout_s": 9}}
    code = {"tag_included": ["string"], "workers": [component]}
    msg = error_of(tmp_path, {**BASE, "rewards": {**BASE["rewards"], "code": code}})
    assert "rewards.code.workers[0].options.sample_timeout_s: must be at most 8 (timeout_s 10" in msg


def test_the_scoring_budget_leaves_the_worker_a_margin():
    from roll_core.config.rewards import scoring_budget_s

    assert [scoring_budget_s(t) for t in (30, 10, 6, 3, 2)] == [24, 8, 4, 1.5, 1]


def test_gae_needs_a_critic(tmp_path):
    assert "critic: adv_estimator gae needs a critic section" in error_of(
        tmp_path, BASE, ["adv_estimator=gae"]
    )
    assert "critic_warmup: needs a critic (an estimator that uses one, e.g. gae), got adv_estimator 'grpo'" in (
        error_of(tmp_path, BASE, ["adv_estimator=grpo", "critic_warmup=2"])
    )


def test_the_core_loader_checks_no_registered_names_and_the_driver_does(tmp_path):
    """The core config imports no module that registers algorithms or filters, so it cannot know their names;
    the driver's load folds the name findings into the same error."""
    overrides = ["adv_estimator=grpoo", "rewards.math.group_filters={std_filtr: {}}"]
    path = write(tmp_path, BASE)
    assert load_config(path, overrides).config.adv_estimator == "grpoo"
    message = error_of(tmp_path, BASE, overrides)
    assert "adv_estimator: must be one of ['dr_grpo', 'gae', 'grpo'," in message
    assert "rewards.math.group_filters.std_filtr: unknown group filter 'std_filtr'" in message


def test_a_domain_chooses_its_rollout_by_a_registered_name(tmp_path):
    assert load(tmp_path, BASE).config.rewards["math"].rollout.type == "single_turn"
    message = error_of(tmp_path, BASE, ["rewards.math.rollout=multi_turnn"])
    assert "rewards.math.rollout: must be one of ['multi_turn', 'single_turn'], got 'multi_turnn'" in message
    message = error_of(tmp_path, BASE, ["rewards.math.rollout={type: multi_turnn}"])  # the same, as a mapping
    assert "rewards.math.rollout: must be one of ['multi_turn', 'single_turn'], got 'multi_turnn'" in message


def test_a_multi_turn_rollout_checks_its_environment_and_its_limits(tmp_path):
    rollout = load(tmp_path, BASE, ["rewards.math.rollout={type: multi_turn, max_turns: 3}"]).config.rewards[
        "math"
    ].rollout
    assert (rollout.type, rollout.max_turns, rollout.environment, rollout.stop) == (
        "multi_turn", 3, "python", ["</python>"]
    )
    message = error_of(tmp_path, BASE, [
        "rewards.math.rollout={type: multi_turn, environment: pyton, max_turns: 0, max_tool_output_tokens: 0}"
    ])
    assert "rewards.math.rollout.max_turns: must be >= 1" in message
    assert "rewards.math.rollout.max_tool_output_tokens: must be >= 1" in message
    message = error_of(tmp_path, BASE, ["rewards.math.rollout={type: multi_turn, environment: pyton}"])
    assert "rewards.math.rollout.environment: unknown environment 'pyton'; available: python" in message
    message = error_of(tmp_path, BASE, [
        "rewards.math.rollout={type: multi_turn, environment_options: {timeout: 3}}"
    ])
    assert "rewards.math.rollout.environment_options: PythonToolEnvironment: unknown option(s) ['timeout']" in message
    message = error_of(tmp_path, BASE, ["rewards.math.rollout={type: multi_turn, stop: []}"])
    assert "rewards.math.rollout.stop: must be a list of non-empty strings, got []" in message
    message = error_of(tmp_path, BASE, ["rewards.math.rollout={type: multi_turn, tool_message: chat}"])
    assert "rollout.tool_message: expected one of ['template', 'inline'], got 'chat'" in message


def test_references_keep_types_and_embed_in_strings():
    tree = {"a": {"n": 3, "name": "x"}, "b": "${a.n}", "c": "run-${a.name}-${a.n}", "d": ["${a.n}"]}
    assert interpolate(tree) == {"a": {"n": 3, "name": "x"}, "b": 3, "c": "run-x-3", "d": [3]}


def test_reference_chain_and_errors():
    assert interpolate({"a": "${b}", "b": "${c}", "c": 1})["a"] == 1
    with pytest.raises(ConfigError, match=r"x: reference \$\{nope\} names no key"):
        interpolate({"x": "${nope}"})
    with pytest.raises(ConfigError, match="circular reference"):
        interpolate({"a": "${b}", "b": "${a}"})


def test_reference_in_a_config_file(tmp_path):
    cfg = {**BASE, "exp_name": "demo", "tracking": {"experiment_name": "${exp_name}-exp"}}
    assert load(tmp_path, cfg).config.tracking.experiment_name == "demo-exp"


def test_overrides_parse_yaml_values(tmp_path):
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=hello") == (["a"], "hello")
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_override("novalue")
    cfg = load(tmp_path, BASE, ["max_steps=7", "actor_infer.generating_args.temperature=0.7"]).config
    assert cfg.max_steps == 7 and cfg.actor_infer.generating_args.temperature == 0.7


def test_override_with_unknown_key_is_rejected(tmp_path):
    assert "actor_infer.generating_args.temprature: unknown key" in error_of(
        tmp_path, BASE, ["actor_infer.generating_args.temprature=0.5"]
    )


@pytest.mark.parametrize(
    ("probs", "total", "expected"),
    [
        ({"a": 0.5, "b": 0.5}, 16, {"a": 8, "b": 8}),
        ({"a": 0.6, "b": 0.4}, 5, {"a": 3, "b": 2}),
        ({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, 10, {"a": 4, "b": 3, "c": 3}),
        ({"a": 0.25, "b": 0.35, "c": 0.4}, 7, {"a": 2, "b": 2, "c": 3}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 3, {"a": 1, "b": 1, "c": 1}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 4, {"a": 2, "b": 1, "c": 1}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 7, {"a": 4, "b": 2, "c": 1}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 10, {"a": 5, "b": 3, "c": 2}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 16, {"a": 8, "b": 5, "c": 3}),
        ({"a": 0.5, "b": 0.3, "c": 0.2}, 33, {"a": 16, "b": 10, "c": 7}),
        ({"a": 0.34, "b": 0.33, "c": 0.33}, 3, {"a": 1, "b": 1, "c": 1}),
        ({"a": 0.34, "b": 0.33, "c": 0.33}, 7, {"a": 3, "b": 2, "c": 2}),
        ({"a": 0.34, "b": 0.33, "c": 0.33}, 10, {"a": 4, "b": 3, "c": 3}),
        ({"a": 0.34, "b": 0.33, "c": 0.33}, 16, {"a": 6, "b": 5, "c": 5}),
        ({"a": 0.34, "b": 0.33, "c": 0.33}, 100, {"a": 34, "b": 33, "c": 33}),
    ],
)
def test_domain_shares_largest_remainder(probs, total, expected):
    shares = domain_shares(probs, total)
    assert shares == expected
    assert sum(shares.values()) == total


def test_every_example_config_loads():
    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        load_config(path)


def test_derived_batch_sizes_are_defined_once_on_the_config():
    cfg = load_config(
        EXAMPLES / "math_code.yaml",
        [
            "max_steps=10",
            "ppo_epochs=2",
            "rollout_batch_size=8",
            "num_return_sequences_in_group=4",
            "actor_train.training_args.per_device_train_batch_size=4",
            "actor_train.training_args.gradient_accumulation_steps=2",
            "actor_train.world_size=2",
        ],
    ).config
    assert cfg.samples_per_step == 32
    assert cfg.actor_train.training_args.minibatch_size == 8
    assert cfg.actor_train.samples_per_update == 16
    assert cfg.optimizer_steps(cfg.actor_train) == 10 * 2 * (32 // 16)
    assert not cfg.update_gives_old_log_probs  # two epochs, two optimizer steps an epoch


def test_the_old_name_num_threads_still_reads_with_a_warning(tmp_path):
    old = {**BASE, "rewards": {**BASE["rewards"], "math": {**BASE["rewards"]["math"], "num_threads": 5}}}
    with pytest.warns(FutureWarning, match=r"rewards\.math\.num_threads is deprecated .* rewards\.math\.num_processes"):
        assert load(tmp_path, old).config.rewards["math"].num_processes == 5
    both = {**BASE, "rewards": {**BASE["rewards"], "math": {**BASE["rewards"]["math"], "num_threads": 5, "num_processes": 3}}}
    assert "rewards.math.num_threads: the old name of num_processes, which is set too" in error_of(tmp_path, both)
    assert load(tmp_path, BASE).config.rewards["math"].num_processes == 2


def test_stop_strings_are_a_list_or_one_string(tmp_path):
    def stop(value):
        return load(tmp_path, BASE, [f"actor_infer.generating_args.stop={value}"]).config.actor_infer.generating_args.stop

    assert load(tmp_path, BASE).config.actor_infer.generating_args.stop == ()
    assert stop('["</python>", "END"]') == ("</python>", "END")
    assert stop('"</python>"') == ("</python>",)
    hash(load(tmp_path, BASE, ['actor_infer.generating_args.stop=["a"]']).config.actor_infer.generating_args)
    message = error_of(tmp_path, BASE, ['actor_infer.generating_args.stop=["x", ""]'])
    assert "actor_infer.generating_args.stop: must be a list of non-empty strings, got ['x', '']" in message
    assert "actor_infer.generating_args.stop" in error_of(tmp_path, BASE, ["actor_infer.generating_args.stop=[3]"])


def test_a_weight_transport_is_checked_against_the_engine_the_devices_and_lora(tmp_path):
    """actor_infer's strategy_config.weight_transport: a known name, vLLM only; nccl and ipc move GPU tensors;
    ipc needs GPUs shared with actor_train and nccl GPUs apart from it (one NCCL rank per GPU); not with LoRA."""
    key = "actor_infer.strategy_args.strategy_config.weight_transport"
    vllm = {"strategy_name": "vllm", "strategy_config": {}}

    def infer(transport: str, **section) -> dict:
        args = {**vllm, "strategy_config": {"weight_transport": transport}}
        return {**BASE, "actor_infer": {"strategy_args": args, **section}}

    assert f"{key}: must be one of ['rpc', 'nccl', 'ipc', 'gloo'], got 'tcp'" in error_of(tmp_path, infer("tcp"))
    hf = {**BASE, "actor_infer": {"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {"weight_transport": "gloo"}}}}
    assert f"{key}: gloo is vLLM's weight-transfer API: it needs strategy_name vllm" in error_of(tmp_path, hf)
    assert f"{key}: nccl moves GPU tensors" in error_of(tmp_path, infer("nccl"))
    gpus = {"num_gpus_per_worker": 1, "device_mapping": [0]}
    trained = {**BASE["actor_train"], "num_gpus_per_worker": 1}
    apart = infer("ipc", **gpus) | {"actor_train": {**trained, "device_mapping": [1]}}
    assert f"{key}: ipc opens actor_train's tensors on the GPU they are on" in error_of(tmp_path, apart)
    wider = infer("ipc", num_gpus_per_worker=1, world_size=2, device_mapping=[0, 1])
    wider |= {"actor_train": {**trained, "device_mapping": [0]}}
    assert "GPUs [1] are not" in error_of(tmp_path, wider)
    shared = infer("nccl", **gpus) | {"actor_train": {**trained, "device_mapping": [0]}}
    assert f"{key}: nccl puts actor_train and the vLLM workers in one NCCL group" in error_of(tmp_path, shared)
    assert load(tmp_path, infer("gloo")).config.actor_infer.weight_transport == "gloo"
    assert load(tmp_path, infer("ipc", **gpus) | {"actor_train": {**trained, "device_mapping": [0]}})
    assert load(tmp_path, infer("nccl", **gpus) | {"actor_train": {**trained, "device_mapping": [1]}})
    lora = infer("gloo") | {"actor_train": {**BASE["actor_train"], "lora": {"rank": 8}}}
    assert f"{key}: gloo: with actor_train.lora a sync brings the adapters as a folder; use rpc" in error_of(tmp_path, lora)
