"""What `make gpu-bundle` carries to a GPU host without network (tests/gpu_check/bundle.py): the project's runtime
dependencies at this venv's versions, less the host's CUDA stack and what the host has, and more the host's
packages at another version than one of the project's exact pins. Nothing is downloaded here."""

from __future__ import annotations

from importlib.metadata import distribution

from packaging.requirements import Requirement

from tests.gpu_check.bundle import ROOT, exact_pins, host_packages, norm, runtime_closure, to_carry

CUDA_IMAGE = ROOT / "tests" / "gpu_check" / "cuda_image_packages.txt"


def test_the_closure_holds_every_direct_dependency_and_theirs_at_the_installed_versions():
    closure = runtime_closure("3.12")
    direct = {norm(Requirement(r).name) for r in distribution("roll-pipeline").requires if "extra" not in r}
    assert direct <= set(closure), direct - set(closure)
    # Second-level requirements too: MLflow's store (sqlalchemy, alembic), math-verify's parser, Ray's schema check.
    assert {"sqlalchemy", "alembic", "latex2sympy2-extended", "jsonschema"} <= set(closure)
    assert closure["ray"] == distribution("ray").version
    assert "roll-pipeline" not in closure
    # Ray's [default] extra (dashboard, metrics agent) is not followed: runs start Ray without the dashboard.
    assert "aiohttp-cors" not in closure and "opencensus" not in closure


def test_the_host_keeps_its_cuda_stack_and_what_it_has_and_gets_the_projects_pins_it_lacks():
    closure = runtime_closure("3.12")
    host = host_packages(CUDA_IMAGE)
    assert host["transformers"] == "5.17.0" and host["pyyaml"] is None
    carried = to_carry(closure, host, exact_pins())
    assert "torch" not in carried and not any(name.startswith("nvidia-") for name in carried)
    assert "numpy" not in carried and "pyyaml" not in carried  # the host has them (no exact pin of the project)
    # The project pins transformers==5.19.0; the image has 5.17.0: carried. Ray, DeepSpeed, MLflow: absent there.
    assert carried["transformers"] == exact_pins()["transformers"] == closure["transformers"]
    assert {"ray", "deepspeed", "mlflow", "math-verify", "dacite"} <= set(carried)
    # A host that has nothing but the CUDA stack gets every other package of the closure.
    assert set(to_carry(closure, {}, exact_pins())) == {n for n in closure if n != "torch"} - {
        n for n in closure if n.startswith(("nvidia-", "triton", "cuda-"))
    }
