"""`roll config import` (roll_pipeline/roll_import/): ROLL RLVR YAMLs become this project's configs that pass `roll run
--dry-run` with local stand-ins for models and data; every ROLL key ends in the report as mapped, changed meaning
(with the substitution) or not supported, and unsupported keys stop the import unless --lenient.

The fixtures under tests/fixtures/roll_configs/ are written for these tests in the shapes of ROLL's examples (the
typical five-domain one, an async one, a LoRA one, a VLM one). The sweep over ROLL's own 50 RLVR YAMLs runs when
ROLL_EXAMPLES_DIR names the `examples` folder of a ROLL checkout (its results are in docs/roll-import.md)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml

from roll_pipeline.driver.cli import main
from roll_pipeline.roll_import.convert import import_roll_config
from roll_pipeline.roll_import.hydra_yaml import RollTree, load_roll_yaml
from tests.conftest import TINY_MODEL
from tests.roll_stand_ins import write_stand_in_data

FIXTURES = Path(__file__).parent / "fixtures" / "roll_configs"


def run_import(source: Path, out: Path, *extra: str) -> int:
    return main(["config", "import", str(source), "-o", str(out), *extra])


def dry_run(config_path: Path, config: dict, tmp_path: Path, capsys) -> str:
    """`roll run --dry-run` on the imported config, its model and data pointed at local stand-ins."""
    sets = [f"{k}={v}" for k, v in write_stand_in_data(config, tmp_path / "data").items()]
    sets.append(f"pretrain={TINY_MODEL}")
    for domain, reward in config["rewards"].items():
        if reward.get("options", {}).get("backend") == "ray_actor":
            sets.append(f"rewards.{domain}.options.model_path={TINY_MODEL}")
    capsys.readouterr()
    code = main(["run", str(config_path), *sets, "--dry-run"])
    shown = capsys.readouterr().out
    assert code == 0, shown
    assert "all checks passed" in shown
    return shown


def test_the_typical_five_domain_config_imports_with_rolls_behaviour_and_dry_runs(tmp_path, capsys, tiny_model):
    out = tmp_path / "five.yaml"
    assert run_import(FIXTURES / "five_domains.yaml", out) == 0
    report = capsys.readouterr().err
    cfg = yaml.safe_load(out.read_text())
    # Hydra's references resolved; the look-alikes rewritten to ROLL's meaning
    assert cfg["output_dir"] == "./checkpoints/five-domain-import"
    assert cfg["actor_infer"]["generating_args"]["max_new_tokens"] == 2048
    assert cfg["validation"]["generating_args"] == {
        "temperature": 0.5, "top_p": 0.7, "top_k": 40, "do_sample": True, "max_new_tokens": 2048
    }
    assert (cfg["adv_estimator"], cfg["advantage_scope"], cfg["whiten_advantages"]) == ("reinforce", "domain", True)
    assert cfg["dual_clip_c"] == 1.5  # 1 + 2 * pg_clip 0.25
    assert cfg["loss_agg_mode"] == "seq-mean-token-mean"  # ROLL's default, not ours
    assert cfg["reward_shaping"] == {
        "reward_clip": 5, "difficulty_mask": {"low": 0.2, "high": 0.9, "inclusive": False}
    }
    assert cfg["rewards"]["math_rule"]["group_filters"] == {
        "mean_filter": {"low": 0.1, "high": 0.9, "inclusive": False}
    }
    assert cfg["rewards"]["code_sandbox"]["group_filters"] == {"std_filter": {"min_std": 0.0}}
    assert {d: r["worker"] for d, r in cfg["rewards"].items()} == {
        "crossthinkqa": "multiple_choice", "ifeval": "ifeval", "math_rule": "math_rule",
        "code_sandbox": "code_sandbox", "llm_judge": "llm_judge",
    }
    assert all(r["response_filters"] == {"truncated": {}} for r in cfg["rewards"].values())  # max_len_mask
    assert cfg["rewards"]["code_sandbox"]["options"] == {"reward_mode": "all_or_nothing"}
    assert cfg["rewards"]["llm_judge"]["options"]["backend"] == "ray_actor"
    # ROLL's prompt counts per step: int(p * 32) for all but the last domain, which takes the rest
    shares = {d: round(p * 32) for d, p in cfg["domain_interleave_probs"].items()}
    assert shares == {"math_rule": 12, "code_sandbox": 6, "llm_judge": 6, "crossthinkqa": 3, "ifeval": 5}
    # Megatron TP 2 over 16 GPUs: 8 data-parallel ranks x 1 x 16 = 128 samples per optimizer step, kept over 16
    train = cfg["actor_train"]
    assert train["strategy_args"] == {"strategy_name": "deepspeed_train",
                                      "strategy_config": {"zero_optimization": {"stage": 3}}}
    assert (train["world_size"], train["training_args"]["gradient_accumulation_steps"]) == (16, 8)
    assert train["training_args"]["lr_scheduler_type"] == "linear"
    assert cfg["reference"]["strategy_args"] == {"strategy_name": "hf_infer"}
    assert cfg["actor_infer"]["world_size"] == 12
    assert "load_format" not in cfg["actor_infer"]["strategy_args"]["strategy_config"]
    for part in ("mapped (", "changed meaning (", "not supported (0)"):
        assert part in report
    assert "dual_clip_loss -> dual_clip_c: 1.5" in report
    assert out.read_text().startswith("# Imported from ROLL's five_domains.yaml")
    plan = dry_run(out, cfg, tmp_path, capsys)
    assert "prompts per step: math_rule=12, code_sandbox=6, llm_judge=6, crossthinkqa=3, ifeval=5" in plan


def test_every_key_of_the_roll_file_is_in_the_report():
    """Nothing is passed over in silence: each leaf of ROLL's file is covered by a reported key (itself or a
    section above it)."""
    source = FIXTURES / "five_domains.yaml"
    result = import_roll_config(source)
    reported = {key for rows in (result.report.mapped, result.report.changed, result.report.unsupported)
                for key, _ in rows}
    for path, _ in RollTree(load_roll_yaml(source)).leaves():
        parts = path.split(".")
        assert any(".".join(parts[:i]) in reported for i in range(1, len(parts) + 1)), path


def test_the_async_config_imports_sglang_fsdp2_and_grpo_as_roll_runs_them(tmp_path, capsys, tiny_model):
    out = tmp_path / "async.yaml"
    assert run_import(FIXTURES / "async_grpo.yaml", out) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["async_generation_ratio"] == 1
    # ROLL's grpo = its reinforce on group-normalised rewards
    assert cfg["adv_estimator"] == "reinforce"
    assert cfg["reward_shaping"]["norm_mean_type"] == cfg["reward_shaping"]["norm_std_type"] == "group"
    assert (cfg["use_kl_loss"], cfg["kl_loss_coef"], cfg["kl_estimator"]) == (True, 0.01, "k3")
    infer = cfg["actor_infer"]
    assert infer["strategy_args"] == {"strategy_name": "vllm", "strategy_config": {
        "gpu_memory_utilization": 0.7, "tensor_parallel_size": 2}}
    assert (infer["world_size"], infer["num_gpus_per_worker"]) == (2, 2)
    zero = cfg["actor_train"]["strategy_args"]["strategy_config"]["zero_optimization"]
    assert zero == {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    # ulysses 2 over 4 GPUs: 2 data-parallel ranks x 2 x 4 = 16 samples per step, here 4 ranks x 2 x 2
    assert cfg["actor_train"]["training_args"]["gradient_accumulation_steps"] == 2
    assert cfg["actor_train"]["training_args"]["lr_scheduler_type"] == "constant"
    assert cfg["validation"]["num_samples"] == 2
    assert "critic" not in cfg
    dry_run(out, cfg, tmp_path, capsys)


def test_the_lora_config_imports_its_adapters(tmp_path, capsys, tiny_model):
    out = tmp_path / "lora.yaml"
    assert run_import(FIXTURES / "lora.yaml", out) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["actor_train"]["lora"] == {
        "rank": 16, "alpha": 32.0, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    assert cfg["actor_train"]["strategy_args"]["strategy_config"] == {"zero_optimization": {"stage": 1}}
    assert "lora" not in cfg["actor_infer"]
    dry_run(out, cfg, tmp_path, capsys)


def test_gae_brings_rolls_critic_from_reward_pretrain(tmp_path):
    from roll_pipeline.roll_import.writing import checked_config

    tree = yaml.safe_load((FIXTURES / "lora.yaml").read_text())
    for key in ("lora_target", "lora_rank", "lora_alpha"):
        del tree["actor_train"]["model_args"][key], tree["actor_infer"]["model_args"][key]
    tree.update(adv_estimator="gae", value_clip=0.3, reward_pretrain="/models/value", critic={
        "model_args": {"dtype": "bf16"}, "device_mapping": "list(range(0,8))",
        "training_args": {"learning_rate": 1.0e-5, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        "strategy_args": {"strategy_name": "megatron_train", "strategy_config": {}},
    })
    source = tmp_path / "gae.yaml"
    source.write_text(yaml.safe_dump(tree))
    result = checked_config(source, [])
    assert result.problems is None and not result.report.unsupported
    critic = result.config["critic"]
    assert (critic["value_clip"], critic["model_args"]["model_name_or_path"]) == (0.3, "/models/value")
    assert critic["world_size"] == 8 and critic["training_args"]["gradient_accumulation_steps"] == 2
    assert result.config["adv_estimator"] == "gae"


def test_a_vlm_config_stops_with_one_message_naming_every_unsupported_key(tmp_path, capsys):
    out = tmp_path / "vlm.yaml"
    assert run_import(FIXTURES / "vlm_detection.yaml", out) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1
    for key in ("rewards.cv_detection", "actor_train.data_args.image_max_pixels",
                "actor_train.model_args.freeze_module_prefix"):
        assert key in errors[0]
    assert "object detection on images" in err
    assert not out.exists()
    assert run_import(FIXTURES / "vlm_detection.yaml", out, "--lenient") == 0
    cfg = yaml.safe_load(out.read_text())
    assert list(cfg["rewards"]) == ["math"] and cfg["domain_interleave_probs"] == {"math": 1.0}
    assert "#   rewards.cv_detection: a VLM domain" in out.read_text()


def test_an_unknown_key_is_reported_not_dropped(tmp_path, capsys):
    source = tmp_path / "roll.yaml"
    tree = yaml.safe_load((FIXTURES / "lora.yaml").read_text())
    tree["shiny_new_knob"] = 3
    tree["actor_train"]["training_args"]["warmup_ratio"] = 0.1
    source.write_text(yaml.safe_dump(tree))
    assert run_import(source, tmp_path / "out.yaml") == 1
    err = capsys.readouterr().err
    assert "shiny_new_knob: 3: not a key the importer knows" in err
    assert "actor_train.training_args.warmup_ratio: set training_args.warmup_steps" in err


def test_a_reference_to_no_key_names_it(tmp_path, capsys):
    source = tmp_path / "roll.yaml"
    source.write_text("exp_name: x\nresponse_length: ${nowhere.length}\n")
    assert run_import(source, tmp_path / "out.yaml") == 2
    assert "nowhere" in capsys.readouterr().err


def test_hydra_references_resolve_as_hydra_resolves_them(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLL_IMPORT_TEST_STEPS", "12")
    source = tmp_path / "roll.yaml"
    source.write_text(
        "exp_name: e\nmax_steps: ${oc.env:ROLL_IMPORT_TEST_STEPS}\nresponse_length: 64\n"
        "checkpoint_config:\n  output_dir: /ckpt/${exp_name}/x\n  depth:\n    n: ${..output_dir}\n"
    )
    tree = load_roll_yaml(source)
    assert tree["max_steps"] == "12" and tree["checkpoint_config"]["output_dir"] == "/ckpt/e/x"
    assert tree["checkpoint_config"]["depth"]["n"] == "/ckpt/e/x"


def test_set_edits_the_imported_config_and_a_bad_result_is_reported(tmp_path, capsys):
    out = tmp_path / "lora.yaml"
    assert run_import(FIXTURES / "lora.yaml", out, "--set", "pretrain=/elsewhere/model", "--set", "max_steps=3") == 0
    cfg = yaml.safe_load(out.read_text())
    assert (cfg["pretrain"], cfg["max_steps"]) == ("/elsewhere/model", 3)
    capsys.readouterr()
    assert run_import(FIXTURES / "lora.yaml", out, "--set", "rollout_batch_size=0") == 1
    assert "rollout_batch_size: must be >= 1" in capsys.readouterr().err


def test_rolls_std_threshold_becomes_the_population_std_bound():
    """ROLL drops a group whose sample std is <= t; std_filter compares the population std: t * sqrt((n-1)/n)."""
    from roll_core.rewards.scored import ScoredSample
    from roll_pipeline.roll_import.domain_keys import _filters
    from roll_pipeline.roll_import.report import Importer
    from schedulers.filters import std_filter

    tree = {"rewards": {"d": {"query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.5}}}}}
    imp = Importer(RollTree(tree))
    imp.put("num_return_sequences_in_group", 4)
    _filters(imp, "rewards.d")
    bound = imp.ours("rewards.d.group_filters")["std_filter"]["min_std"]
    assert bound == pytest.approx(0.5 * math.sqrt(3 / 4))

    def group(*scores):
        return [ScoredSample(score=s, correct=s > 0) for s in scores]

    for scores in ((0, 0, 1, 1), (0, 0, 0, 1), (0, 0.2, 0.4, 1), (0.5, 0.6, 0.7, 0.8)):
        mean = sum(scores) / 4
        sample_std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3)
        assert std_filter(group(*scores), min_std=bound) is (sample_std > 0.5), scores


@pytest.mark.skipif(not os.environ.get("ROLL_EXAMPLES_DIR"), reason="ROLL_EXAMPLES_DIR names no ROLL checkout")
def test_rolls_own_rlvr_yamls_import_and_dry_run_or_stop(tmp_path, capsys):
    """Each of ROLL's RLVR YAMLs either imports to a config that dry-runs with stand-ins, or stops naming every
    unsupported key in one message (docs/roll-import.md has the table)."""
    found = sorted(p for p in Path(os.environ["ROLL_EXAMPLES_DIR"]).rglob("*.yaml") if "rlvr" in str(p).lower())
    assert found
    for i, source in enumerate(found):
        out = tmp_path / f"{i}.yaml"
        code = run_import(source, out)
        err = capsys.readouterr().err
        if code:
            assert code == 1 and sum(line.startswith("error") for line in err.splitlines()) == 1, (source, err)
            continue
        cfg = yaml.safe_load(out.read_text())
        dry_run(out, cfg, tmp_path / str(i), capsys)


def test_rolls_dynamic_batching_of_the_log_prob_passes_and_the_train_step_becomes_their_token_budgets(tmp_path):
    from roll_pipeline.roll_import.writing import checked_config

    tree = yaml.safe_load((FIXTURES / "lora.yaml").read_text())
    for key in ("lora_target", "lora_rank", "lora_alpha"):
        del tree["actor_train"]["model_args"][key], tree["actor_infer"]["model_args"][key]
    for section in ("actor_train", "reference", "actor_infer"):
        tree.setdefault(section, {}).update(
            use_dynamic_batching_in_infer=True, max_tokens_per_microbatch_in_infer=8192,
            use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=8192,
        )
    tree["reference"].update(max_tokens_per_microbatch_in_infer=4096, sequence_length_round_in_infer=128)
    source = tmp_path / "dynamic.yaml"
    source.write_text(yaml.safe_dump(tree))
    result = checked_config(source, [])
    assert result.problems is None and not result.report.unsupported
    assert result.config["actor_train"]["infer_max_tokens_per_microbatch"] == 8192
    assert result.config["reference"]["infer_max_tokens_per_microbatch"] == 4096
    assert "infer_max_tokens_per_microbatch" not in result.config["actor_infer"]
    assert result.config["actor_train"]["training_args"]["max_tokens_per_microbatch"] == 8192
    assert "training_args" not in result.config["reference"]
    mapped = dict(result.report.mapped)
    assert mapped["actor_train.max_tokens_per_microbatch_in_train"].startswith(
        "actor_train.training_args.max_tokens_per_microbatch: 8192")
    assert mapped["reference.max_tokens_per_microbatch_in_infer"].startswith("reference.infer_max_tokens_per_microbatch: 4096")
    assert "nothing here" in mapped["actor_infer.max_tokens_per_microbatch_in_infer"]
    # the rounding: ROLL's key where set, its default 4 where not
    assert result.config["reference"]["infer_sequence_length_round"] == 128
    assert mapped["reference.sequence_length_round_in_infer"].startswith("reference.infer_sequence_length_round: 128")
    assert result.config["actor_train"]["infer_sequence_length_round"] == 4
    assert result.config["actor_train"]["training_args"]["sequence_length_round"] == 4
    defaults = [ours for roll, ours in result.report.mapped if roll == "(ROLL's default)"]
    assert any(line.startswith("actor_train.training_args.sequence_length_round: 4 (ROLL pads") for line in defaults)
    assert "infer_sequence_length_round" not in result.config["actor_infer"]
    # ROLL's flag off: its budget is not used there, nor here
    tree["reference"]["use_dynamic_batching_in_infer"] = False
    tree["actor_train"]["use_dynamic_batching_in_train"] = False
    source.write_text(yaml.safe_dump(tree))
    config = checked_config(source, []).config
    assert "infer_max_tokens_per_microbatch" not in config["reference"]
    assert "infer_sequence_length_round" not in config["reference"]
    assert "max_tokens_per_microbatch" not in config["actor_train"].get("training_args", {})
    assert "sequence_length_round" not in config["actor_train"].get("training_args", {})


def test_rolls_sequence_packing_and_attention_kernel_are_mapped(tmp_path):
    """use_sequence_packing on the trained and reference clusters, its packed lengths as the token budgets where
    dynamic batching set none, and fa2 as transformers' flash_attention_2; actor_infer's packing is its engine's."""
    from roll_pipeline.roll_import.writing import checked_config

    tree = yaml.safe_load((FIXTURES / "lora.yaml").read_text())
    for key in ("lora_target", "lora_rank", "lora_alpha"):
        del tree["actor_train"]["model_args"][key], tree["actor_infer"]["model_args"][key]
    packing = {"algorithm": "load_balance", "max_packed_sequence_length_train": 8192,
               "max_packed_sequence_length_forward": 16384, "min_num_micro_batches_train": 1}
    for section in ("actor_train", "reference", "actor_infer"):
        tree.setdefault(section, {}).update(use_sequence_packing=True, sequence_packing_args=dict(packing))
        tree[section].setdefault("model_args", {})["attn_implementation"] = "fa2"
    tree["reference"]["model_args"]["attn_implementation"] = "auto"
    tree["actor_train"].update(use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=4096,
                               sequence_length_round_in_train=128)
    source = tmp_path / "packing.yaml"
    source.write_text(yaml.safe_dump(tree))
    result = checked_config(source, [])
    assert result.problems is None and not result.report.unsupported
    train, ref, infer = (result.config[s] for s in ("actor_train", "reference", "actor_infer"))
    assert train["use_sequence_packing"] is ref["use_sequence_packing"] is True
    assert "use_sequence_packing" not in infer
    assert train["training_args"]["max_tokens_per_microbatch"] == 4096  # dynamic batching's, not the packed length
    assert train["infer_max_tokens_per_microbatch"] == ref["infer_max_tokens_per_microbatch"] == 16384
    assert train["model_args"]["attn_implementation"] == infer["model_args"]["attn_implementation"] == (
        "flash_attention_2")
    assert "attn_implementation" not in ref["model_args"]
    mapped = dict(result.report.mapped)
    assert mapped["reference.sequence_packing_args.max_packed_sequence_length_forward"].startswith(
        "reference.infer_max_tokens_per_microbatch: 16384")
    assert "dynamic batching" in mapped["actor_train.sequence_packing_args.max_packed_sequence_length_train"]
    assert "nothing here" in mapped["actor_infer.use_sequence_packing"]
    assert "no padding to round" in mapped["actor_train.sequence_length_round_in_train"]
    assert "sequence_length_round" not in train["training_args"]
    for section in ("actor_train", "reference", "actor_infer"):
        assert "nothing here" in mapped[f"{section}.sequence_packing_args.algorithm"]
    assert "nothing here" in mapped["reference.model_args.attn_implementation"]
