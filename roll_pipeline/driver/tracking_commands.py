"""`roll report`, `roll mlflow sync` and `roll ui`: the tracking subcommands of the `roll` command."""

from __future__ import annotations

import argparse
import os
import sys

from roll_core.console import EXIT_FAILED, EXIT_USAGE, echo, error


def cmd_report(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException

    from roll_pipeline.driver.report import (
        format_comparison,
        format_report,
        format_run_change_report,
        last_validation_outcomes,
        load_report,
    )

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file per run
    if not 0 < args.alpha < 1:
        error(f"--alpha must be between 0 and 1, got {args.alpha}")
        return EXIT_USAGE
    try:
        report = load_report(args.run, args.tracking_uri)
        if args.other is None:
            echo(format_report(report, max_columns=args.columns))
            echo("")
            echo(format_run_change_report(report, args.alpha))
            return 0
        other = load_report(args.other, args.tracking_uri)
        outcomes = [last_validation_outcomes(r) for r in (report, other)]
    except (ValueError, MlflowException) as exc:
        error(str(exc).splitlines()[0])
        return EXIT_USAGE
    echo(format_comparison(report, other, *outcomes, alpha=args.alpha))
    return 0


def cmd_mlflow_sync(args: argparse.Namespace) -> int:
    from roll_core.tracking.mlflow_tracker import sync

    results = sync(args.path, args.tracking_uri)
    if not results:
        error(f"{args.path} holds no tracking spool (give a run's output_dir)")
        return EXIT_USAGE
    for r in results:
        state = "everything sent" if not r.left else f"{r.left} entries left (MLflow unreachable?)"
        echo(f"{r.spool}: sent {r.sent} entries, run {r.run_id}: {state}")
    return EXIT_FAILED if any(r.left for r in results) else 0


def ui_command(uri: str, port: int) -> list[str]:
    """The `mlflow ui` command line for a local store, listening on 127.0.0.1 only."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def cmd_ui(args: argparse.Namespace) -> int:
    from roll_core.tracking.mlflow_tracker import DEFAULT_TRACKING_URI, absolute_uri, is_server

    uri = absolute_uri(args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    if is_server(uri):
        echo(f"runs at {uri} are shown by that server's own UI: open {uri} in a browser")
        return 0
    echo(f"MLflow UI for {uri} at http://127.0.0.1:{args.port} (Ctrl-C stops it)")
    # The UI needs no background job runner (it serves GenAI features), which would start several more
    # processes on a small machine. exec: the UI is this process from now on, so signals reach it directly.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = ui_command(uri, args.port)
    os.execve(command[0], command, env)  # does not return


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `report`, `mlflow sync` and `ui` on the `roll` parser's subcommands."""
    report = sub.add_parser(
        "report", help="print a run's per-tag validation table, or compare two runs' last validations tag by tag"
    )
    report.add_argument("run", metavar="RUN_ID_OR_DIR", help="an MLflow run id, or a run's output_dir")
    report.add_argument(
        "other",
        metavar="OTHER_RUN",
        nargs="?",
        help="a second run (id or output_dir): compare the two runs' last validations, paired by prompt",
    )
    report.add_argument(
        "--alpha", type=float, default=0.05, help="flag a tag when its Holm-adjusted p-value is below this"
    )
    report.add_argument(
        "--tracking-uri", help="where the run is (default: the run's own, or MLFLOW_TRACKING_URI)"
    )
    report.add_argument("--columns", type=int, default=8, help="at most this many validation steps to show")
    report.set_defaults(func=cmd_report)

    mlflow = sub.add_parser("mlflow", help="MLflow tracking").add_subparsers(
        dest="mlflow_command", required=True
    )
    sync = mlflow.add_parser("sync", help="send tracking data a run spooled while MLflow was unreachable")
    sync.add_argument("path", help="a run's output_dir (or its mlflow_spool folder)")
    sync.add_argument("--tracking-uri", help="send to this URI instead of the one the run used")
    sync.set_defaults(func=cmd_mlflow_sync)

    ui = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 for a local tracking store")
    ui.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)
