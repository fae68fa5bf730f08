"""`make gpu-bundle`: what a GPU host without network needs, beside the checkout, to run `make gpu-check`.

A GPU machine usually brings its own CUDA stack (torch, triton, the nvidia-* libraries) and often many common
packages, but not this project's (Ray, DeepSpeed, MLflow, math-verify, ...), and it may have no network to fetch
them. This script, run on a machine that reaches PyPI, writes `.gpu-check/`:

- `site.tar.xz`: the project's runtime dependencies, at the versions installed in this venv (the ones CI tests),
  as wheels for the GPU host's Python (`--python-version`, manylinux x86-64), unpacked and packed into one xz
  archive, less what the host already has (`--host-has`, a file of package names or `pip freeze` lines).
  Left out: the CUDA stack (the host's own), vLLM (its CUDA wheel is 326 MB and needs the CUDA torch of its
  release; carry it yourself where the host lacks it), Ray's `[default]` extra (the dashboard and its agent:
  runs start Ray without them), Ray's Java workers and the two web UIs' compiled pages (Ray's and MLflow's).
  DeepSpeed ships only a source archive; it is built here into a pure-Python wheel (DS_BUILD_OPS=0: its
  kernels are compiled just in time on the host where a config asks for them).
- `debs/`: Debian's bubblewrap and libseccomp2, unpacked by gpu_check/run.sh where the host lacks them (the
  code sandbox's isolation and system-call filter).

Sizes (2026-11-27, Python 3.12 host with the 'cuda' image of tests/gpu_check/README.md): see `make gpu-bundle`'s
last lines, which print every part's size.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "roll-pipeline"
# The host's own CUDA stack, and engines too large to carry (see the module's docstring).
HOST_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|vllm.*|torchvision|torchaudio|torchcodec)$")
# Extras not followed: Ray's dashboard and metrics agent (runs start Ray with include_dashboard=False).
EXTRAS_NOT_FOLLOWED = {"ray"}
# Parts of unpacked packages no run reads: Ray's Java workers and both web UIs' compiled pages.
STRIPPED = ["ray/jars", "ray/dashboard/client/build", "mlflow/server/js/build"]
PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64",
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(python_version: str) -> dict[str, str]:
    """Every distribution the project needs at run time on a host of that Python, with the version installed
    here: its requirements and theirs, markers evaluated for the host, extras followed except Ray's."""
    env = default_environment()
    env["python_version"] = python_version
    env["python_full_version"] = python_version + ".0"
    extras_seen: dict[str, set[str]] = {}

    def wanted(req: Requirement, extras: set[str]) -> bool:
        if req.marker is None:
            return True
        marker = str(req.marker)
        return any(
            req.marker.evaluate({**env, "extra": extra}) for extra in extras if extra or "extra" not in marker
        )

    def walk(name: str, extras: set[str]) -> None:
        key = norm(name)
        known = extras_seen.get(key)
        if known is not None and extras <= known:
            return
        extras_seen[key] = (known or set()) | extras
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            sys.exit(f"gpu-bundle: {name} is not installed in this venv (run `make install` first)")
        for line in dist.requires or []:
            req = Requirement(line)
            if wanted(req, {""} | extras):
                walk(req.name, set() if norm(req.name) in EXTRAS_NOT_FOLLOWED else set(req.extras))

    walk(PROJECT, set())
    extras_seen.pop(norm(PROJECT))
    return {name: distribution(name).version for name in sorted(extras_seen)}


def host_packages(path: Path | None) -> dict[str, str | None]:
    """The host's packages from a file of names or `name==version` lines (`pip freeze`), '#' comments."""
    if path is None:
        return {}
    found: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[norm(name.strip())] = version.strip() or None
    return found


def exact_pins() -> dict[str, str]:
    """The project's own `==` pins: carried where the host has another version of them."""
    pins = {}
    for line in distribution(PROJECT).requires or []:
        req = Requirement(line)
        if req.marker is None and len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==":
            pins[norm(req.name)] = next(iter(req.specifier)).version
    return pins


def to_carry(needed: dict[str, str], host: dict[str, str | None], pinned: dict[str, str]) -> dict[str, str]:
    """What the host lacks, or has at another version than one of the project's exact pins."""
    carry = {}
    for name, version in needed.items():
        if HOST_STACK.match(name):
            continue
        if name not in host or (name in pinned and host[name] is not None and host[name] != pinned[name]):
            carry[name] = version
    return carry


def download(pins: dict[str, str], python_version: str, into: Path) -> None:
    """The pinned wheels for the host, in one pip call; DeepSpeed (a source archive only) built here without
    its kernels."""
    source_only = {"deepspeed"}
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp",
         *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(into),
         *[f"{n}=={v}" for n, v in pins.items() if n not in source_only]],
        check=True,
    )
    for name in source_only & pins.keys():
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
             str(into), f"{name}=={pins[name]}"],
            check=True, env={**os.environ, "DS_BUILD_OPS": "0"},
        )


def size_mb(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python (major.minor)")
    parser.add_argument("--host-has", type=Path, help="what the host has: names, or `pip freeze` lines")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-check")
    args = parser.parse_args(argv)

    pins = to_carry(runtime_closure(args.python_version), host_packages(args.host_has), exact_pins())
    print(f"gpu-bundle: {len(pins)} packages for Python {args.python_version}: "
          + " ".join(f"{n}=={v}" for n, v in pins.items()))
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "debs").mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        download(pins, args.python_version, wheels)
        print(f"gpu-bundle: wheels {size_mb(wheels):.1f} MB")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
             "--only-binary=:all:", "--python-version", args.python_version, "--implementation", "cp",
             *[a for p in PLATFORMS for a in ("--platform", p)], "--target", str(site),
             *sorted(str(w) for w in wheels.iterdir())],
            check=True,
        )
        for part in STRIPPED:
            shutil.rmtree(site / part, ignore_errors=True)
        print(f"gpu-bundle: unpacked {size_mb(site):.1f} MB")
        archive = args.out / "site.tar.xz"
        subprocess.run(
            f"tar -C {site} -cf - . | xz -9 -T0 > {archive}", shell=True, check=True
        )
    subprocess.run(["apt-get", "download", "bubblewrap", "libseccomp2"], cwd=args.out / "debs", check=True)
    print(f"gpu-bundle: {archive.relative_to(ROOT)} {size_mb(archive):.1f} MB, "
          f"debs {size_mb(args.out / 'debs'):.1f} MB, in all {size_mb(args.out):.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
