"""Building an embedded model (`roll model build NAME`) and judging whether a build is sound."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.models.embedded import EMBEDDED_MODELS
from roll_core.models.folders import DATA_DIR, MODELS_DIR, SHIPPED_DIR


def build_problems(name: str, model_dir: Path) -> list[str]:
    """What makes the build in `model_dir` an unsound build of `name`: its own figures (build_info.json, and the
    judge's judge_eval.json) beyond the model's bounds; [] for a sound build."""
    from roll_pipeline.models.tiny import BUILD_INFO
    from roll_pipeline.models.tiny_judge import JUDGE_EVAL

    model = EMBEDDED_MODELS[name]
    info = json.loads((Path(model_dir) / BUILD_INFO).read_text())
    problems = []
    if model.reward_model:
        if info["heldout_pairwise_accuracy"] < model.min_heldout_accuracy:
            problems.append(f"held-out pairwise accuracy {info['heldout_pairwise_accuracy']} < {model.min_heldout_accuracy}")
        if info["final_loss"] > model.max_final_loss:
            problems.append(f"final loss {info['final_loss']} > {model.max_final_loss}")
        return problems
    if info["heldout_greedy_accuracy"] < model.min_heldout_accuracy:
        problems.append(f"held-out accuracy {info['heldout_greedy_accuracy']} < {model.min_heldout_accuracy}")
    if info["final_loss"] > model.max_final_loss:
        problems.append(f"final loss {info['final_loss']} > {model.max_final_loss}")
    if model.judge:
        verdicts = json.loads((Path(model_dir) / JUDGE_EVAL).read_text())
        if verdicts["verdict_accuracy"] < model.min_verdict_accuracy:
            problems.append(f"verdict accuracy {verdicts['verdict_accuracy']} < {model.min_verdict_accuracy}")
        if verdicts["unparseable"]:
            problems.append(f"{verdicts['unparseable']} unparseable verdicts")
    return problems


def build_embedded_model(name: str, models_dir: Path = MODELS_DIR, data_dir: Path = DATA_DIR,
                         seed: int = 0, from_scratch: bool = False, shipped_dir: Path = SHIPPED_DIR) -> Path:
    """Build (or reuse, when up to date) the embedded model `name` in `models_dir/name`; a shipped model's shipped
    build (`EmbeddedModel.shipped`) is copied in where its spec is the one asked for, unless `from_scratch` (which
    builds the model asked for here, not the models it is built from: the reward model's backbone is copied)."""
    model = EMBEDDED_MODELS[name]
    files = _train_files(name, data_dir)
    shipped = shipped_dir / name if model.shipped else None
    if model.reward_model:
        from roll_pipeline.models.tiny_reward import build_tiny_reward_model

        base = build_embedded_model("tiny-qwen2", models_dir, data_dir, shipped_dir=shipped_dir)  # its backbone
        return build_tiny_reward_model(models_dir / name, base, *files, seed=seed, shipped=shipped,
                                       from_scratch=from_scratch)
    if model.judge:
        from roll_pipeline.models.tiny_judge import build_tiny_judge

        return build_tiny_judge(models_dir / name, files, seed=seed, shipped=shipped, from_scratch=from_scratch)
    from roll_pipeline.models.tiny import build_tiny_model

    return build_tiny_model(models_dir / name, files, seed=seed, shipped=shipped, from_scratch=from_scratch,
                            **dict(model.hyperparameters))


def current_spec(name: str, data_dir: Path = DATA_DIR, shipped_dir: Path = SHIPPED_DIR, seed: int = 0) -> dict:
    """The spec a build of `name` records today (build_info.json): what its shipped build must record to be copied.
    The reward model's depends on its backbone's weights, those of tiny-qwen2's shipped build."""
    from roll_pipeline.models import tiny

    model = EMBEDDED_MODELS[name]
    files = _train_files(name, data_dir)
    if model.reward_model:
        from roll_pipeline.models.tiny_reward import reward_model_spec

        return reward_model_spec(shipped_dir / "tiny-qwen2", *files, seed=seed)
    if model.judge:
        from roll_pipeline.models.tiny_judge import JUDGE_HYPERPARAMETERS

        return tiny.build_spec(tiny.TinyModelHyperparameters(**JUDGE_HYPERPARAMETERS), files, seed)
    return tiny.build_spec(tiny.TinyModelHyperparameters(**dict(model.hyperparameters)), files, seed)


def _train_files(name: str, data_dir: Path) -> list[Path]:
    files = [data_dir / file for file in EMBEDDED_MODELS[name].train_files]
    missing = [str(file) for file in files if not file.exists()]
    if missing:
        raise FileNotFoundError(f"training data of {name} not found: {', '.join(missing)} "
                                "(run `roll model build` from the repository root, where examples/data holds it)")
    return files
