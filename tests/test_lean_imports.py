"""roll_core/lean_imports.py: a process of the project skips three imports of its dependencies that it never uses
(scikit-learn for transformers' assisted generation, MLflow for DeepSpeed's autotuner, transformers' generation
code for AutoTokenizer), and everything else still gets the truth and works.

Each case is a fresh Python process whose first import is the given one (a Ray worker's first import is its actor's
module; the driver's is the CLI's); a module's third-party imports run before its own package's modules, never
before its package, so each package of the project installs the finder in its __init__."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = """
import json, sys
{first}
facts = {{}}
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({model!r})
facts["tokenizer imported torch's compiler"] = "torch._dynamo" in sys.modules
# transformers answers the truth to every module but the one whose body was told otherwise, that one too now
import transformers.utils.import_utils as import_utils
facts["modules told torch is absent"] = sorted(
    name for name, m in list(sys.modules.items()) if name.startswith("transformers") and m is not None
    and m.__dict__.get("is_torch_available", import_utils.is_torch_available) is not import_utils.is_torch_available
)
from transformers.generation import candidate_generator
import transformers.utils
facts["sklearn imported, as candidate_generator and transformers see it"] = [
    "sklearn" in sys.modules, candidate_generator.is_sklearn_available(), transformers.utils.is_sklearn_available()
]
import deepspeed.autotuning.autotuner as autotuner
facts["mlflow imported, as DeepSpeed's autotuner sees it"] = ["mlflow" in sys.modules, autotuner.has_mlflow]
import mlflow  # still there for whoever asks
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
model = AutoModelForCausalLM.from_pretrained({model!r})
facts["tokens generated"] = model.generate(**tokenizer("1 + 1 =", return_tensors="pt"), max_new_tokens=2,
                                           do_sample=False).shape[1] - 5
# a remote-code model of before transformers 4.45 (its own prepare_inputs_for_generation) still gets generate()
from transformers.models.auto import auto_factory
class Old(PreTrainedModel):
    def prepare_inputs_for_generation(self, *args, **kwargs):
        return kwargs
facts["an old remote-code model gets GenerationMixin"] = issubclass(
    auto_factory.add_generation_mixin_to_remote_model(Old), GenerationMixin
)
print("FACTS", json.dumps(facts))
"""

#: What every case must find, whatever its first import.
WORKS = {"modules told torch is absent": [], "tokens generated": 2, "an old remote-code model gets GenerationMixin": True}
LEAN = {
    "sklearn imported, as candidate_generator and transformers see it": [False, False, True],
    "mlflow imported, as DeepSpeed's autotuner sees it": [False, False],
}

CASES = {
    # The cost each rule saves: if a dependency stops making it, its rule has nothing left to do and can go.
    "": {
        "tokenizer imported torch's compiler": True,
        "sklearn imported, as candidate_generator and transformers see it": [True, True, True],
        "mlflow imported, as DeepSpeed's autotuner sees it": [True, True],
    },
    # a scheduler's process (it loads a tokenizer, never a model)
    "import schedulers": {"tokenizer imported torch's compiler": False, **LEAN},
    # a training worker's
    "import workers.actor_train": LEAN,
    # the driver's, which imports MLflow for its tracking before DeepSpeed could: then the autotuner gets it
    "import roll_pipeline.driver.cli; import mlflow": {
        "tokenizer imported torch's compiler": False,
        **LEAN,
        "mlflow imported, as DeepSpeed's autotuner sees it": [True, True],
    },
    "import roll_core": {"tokenizer imported torch's compiler": False, **LEAN},
}


@pytest.mark.parametrize("first", list(CASES), ids=["no project", *list(CASES)[1:]])
def test_what_a_process_imports_first_decides_what_it_skips_and_the_rest_still_works(first, tiny_model):
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first, model=str(tiny_model))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FACTS ")]
    facts = json.loads(line.removeprefix("FACTS "))
    expected = WORKS | CASES[first]
    assert {key: facts[key] for key in expected} == expected
