"""Every example runs as its header says, from the state of a fresh clone.

Each `examples/*.yaml` header lists, indented under a comment, the exact commands that run it from the repository
root: the embedded models it needs (`roll model build NAME`), a judge server where it calls one (`roll serve ...
&`), then `roll run`. The test copies what a clone has (the example files and their data, no models) into an empty
folder, checks that a dry run there fails and names the command that builds its policy model, then runs the
header's commands there (the last, `roll run`, as `--dry-run`) and checks that the dry run passes.

The builds are cache hits: the models `make test` built (and the pretrained model `make real-model` wrote, which
`roll model fetch` reuses when it was written from the same file) are copied in first, and `roll model build` reuses a folder
only when its recorded spec (seed, hyperparameters, hashes of the training files) is the one that name builds, so
a header that named the wrong model would still leave its model missing. The GPU examples' headers are run the same
way as far as a CPU host goes: their `--dry-run` lines (installs and `roll run` without it are for the GPU host).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from roll_core.models.embedded import EMBEDDED_MODELS
from roll_core.models.pretrained import PRETRAINED_MODELS
from roll_pipeline.driver.cli import main
from tests.conftest import EXAMPLES, ROOT

CPU_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
GPU_EXAMPLES = sorted(f"gpu/{p.name}" for p in (EXAMPLES / "gpu").glob("*.yaml"))


def header_commands(example: str) -> list[str]:
    """The commands of an example's header: its comment lines indented by three spaces, `\\` lines joined."""
    commands: list[str] = []
    for line in (EXAMPLES / example).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1].rstrip() + " " + text.strip()
        elif text.startswith("   "):
            commands.append(text.strip())
    return commands


def models_used(example: str) -> set[str]:
    """Folder names of the embedded models an example runs on: those its config points at (policy, local judge,
    reward model) and the judge its header serves."""
    cfg = yaml.safe_load((EXAMPLES / example).read_text())
    blocks = [b for reward in cfg["rewards"].values() for b in [reward, *reward.get("workers", [])]]
    paths = [cfg["pretrain"]] + [block.get("options", {}).get("model_path", "") for block in blocks]
    paths += [shlex.split(c)[2] for c in header_commands(example) if c.startswith("roll serve ")]
    return {Path(p).name for p in paths if Path(p).name in EMBEDDED_MODELS}


@pytest.mark.parametrize("example", CPU_EXAMPLES)
def test_each_header_builds_the_models_its_config_uses_then_runs_it(example):
    commands = header_commands(example)
    built = {name for c in commands if c.startswith("roll model build ") for name in shlex.split(c)[3:]}
    assert built == models_used(example), commands
    assert commands[-1] == f"roll run examples/{example}", commands


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch) -> Path:
    """A folder holding what a clone holds of examples/ (configs and data, no models), as the working directory."""
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("models"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def start_judge_server(command: str, cwd: Path) -> subprocess.Popen:
    args = shlex.split(command.removesuffix("&"))
    assert args[:2] == ["roll", "serve"], command
    port = args[args.index("--port") + 1]
    log = cwd / "judge-server.log"  # a file, not a pipe: nothing reads the server's output while it runs
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "roll_pipeline.driver.cli", *args[1:]], cwd=cwd,
                                  stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`{command}` exited with {server.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    pytest.fail(f"`{command}` did not answer on port {port} within 120 s")


@pytest.mark.slow
@pytest.mark.parametrize("example", CPU_EXAMPLES)
def test_a_fresh_clone_runs_each_example_with_only_its_header_commands(example, fresh_clone, tiny_model, capsys):
    assert main(["run", f"examples/{example}", "--dry-run"]) == 2
    out = capsys.readouterr()
    cfg = yaml.safe_load((EXAMPLES / example).read_text())
    policy = Path(cfg["pretrain"]).name
    verb = "fetch" if policy in PRETRAINED_MODELS else "build"
    assert f"`roll model {verb} {policy}`" in out.out + out.err, out

    servers = []
    try:
        for command in header_commands(example)[:-1]:
            args = shlex.split(command)
            if args[:2] == ["roll", "serve"]:
                servers.append(start_judge_server(command, fresh_clone))
                continue
            if args[:3] in (["roll", "model", "build"], ["roll", "model", "fetch"]):  # as a cache it checks
                for name in args[3:]:
                    shutil.copytree(ROOT / "examples" / "models" / name, fresh_clone / "examples" / "models" / name)
            assert main(args[1:]) == 0, command
        capsys.readouterr()
        assert main([*shlex.split(header_commands(example)[-1])[1:], "--dry-run"]) == 0, capsys.readouterr()
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)


@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_a_fresh_clone_dry_runs_each_gpu_example_as_its_header_says(example, fresh_clone, capsys):
    commands = [shlex.split(c, comments=True) for c in header_commands(example)]
    dry_runs = [args for args in commands if args[:2] == ["roll", "run"] and "--dry-run" in args]
    assert dry_runs, f"the header of examples/{example} shows no `roll run ... --dry-run`"
    for args in commands:
        if args[:3] in (["roll", "model", "build"], ["roll", "model", "fetch"]):  # as a cache it checks
            for name in args[3:]:
                shutil.copytree(ROOT / "examples" / "models" / name, fresh_clone / "examples" / "models" / name)
            assert main(args[1:]) == 0, args
    for args in dry_runs:
        assert main(args[1:]) == 0, capsys.readouterr()
