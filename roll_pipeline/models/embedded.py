"""The embedded models the examples and tests use: each one's name, what it is for, and how it is built.

Every example that needs one of them names it by folder (`pretrain: ./models/tiny-qwen2-multi`), and
`roll model build NAME` builds exactly that one, so an error about a missing model can name the command that
builds that model and no other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where the examples expect the models, relative to the repository root (where `roll` commands are run).
MODELS_DIR = Path("examples/models")
DATA_DIR = Path("examples/data")


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    """Folder name under examples/models/."""
    purpose: str
    train_files: tuple[str, ...]
    """Data it is warmed up on, under examples/data/."""
    reference_sha256: str
    """sha256 of the weights the default build (seed 0) gives with the pinned packages, on any x86-64 machine
    with AVX2 (roll_pipeline/models/tiny.py); the README's and the tests' figures were measured on these."""
    judge: bool = False
    """Built as the tiny judge (larger vocabulary, longer warm-up, verdicts measured after the build)."""


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel("tiny-qwen2", "the policy of the math and code examples",
                      ("math_train.jsonl", "code_train.jsonl"),
                      "0df32600af5ba39a5b54ae5a6e45e8dfdbdf32cfc0506d5c0bb04452585cc6db"),
        EmbeddedModel("tiny-qwen2-multi", "the policy of the three-domain examples",
                      ("math_train.jsonl", "code_train.jsonl", "open_train.jsonl"),
                      "4f8983425b9da935b1e8c610d1328d3213dcc1e2d8c4a2e53aeb9a240dc7329c"),
        EmbeddedModel("tiny-qwen2-judge", "the judge of the open-answer domain", ("judge_train.jsonl",),
                      "d12822322a8c6eea3fa9594d487280bbb1a1fa39148216d184a5b0432ece8ad3", judge=True),
    )
}


def build_command(name: str) -> str:
    return f"roll model build {name}"


def build_hint(path: str | Path) -> str | None:
    """For a model folder named like an embedded model: how to build it; else None."""
    name = Path(path).name
    if name not in EMBEDDED_MODELS:
        return None
    return f"build it with `{build_command(name)}` from the repository root"


def build_embedded_model(name: str, models_dir: Path = MODELS_DIR, data_dir: Path = DATA_DIR,
                         seed: int = 0) -> Path:
    """Build (or reuse, when up to date) the embedded model `name` in `models_dir/name`."""
    model = EMBEDDED_MODELS[name]
    files = [data_dir / file for file in model.train_files]
    missing = [str(file) for file in files if not file.exists()]
    if missing:
        raise FileNotFoundError(f"training data of {name} not found: {', '.join(missing)} "
                                "(run `roll model build` from the repository root, where examples/data holds it)")
    if model.judge:
        from roll_pipeline.models.tiny_judge import build_tiny_judge

        return build_tiny_judge(models_dir / name, files, seed=seed)
    from roll_pipeline.models.tiny import build_tiny_model

    return build_tiny_model(models_dir / name, files, seed=seed)
