"""Validation reports: the sample table and accuracy chart of each validation, and `roll report`'s text.

Artifacts of each validation at step N:
- `validation/samples_step_<N>.json`: a table (MLflow `log_table`) with the first
  `tracking.sample_rows_per_tag` responses of every tag: tag, domain, prompt id, sample index, prompt,
  response, ground truth, reward, verdict (correct / wrong / masked), finish reason and length;
- `validation/accuracy_by_tag.png`: val_correct/<tag>/mean of every tag (and all) over the validations so far,
  replaced at each validation.

And every `tracking.logging_steps` steps, `train_samples/step_<N>.json`: that step's training samples
(`train_sample_table`).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.rewards.scored import ScoredSample
from roll_pipeline.driver.run_change import ci_text, format_run_change, run_change
from roll_pipeline.driver.significance import (
    ALL,
    PromptOutcome,
    compare,
    intervals,
    outcomes_from_table,
    outcomes_table,
)

TABLE_DIR = "validation"
CHART_FILE = "validation/accuracy_by_tag.png"


def table_file(step: int) -> str:
    return f"{TABLE_DIR}/samples_step_{step:06d}.json"


def prompts_file(step: int) -> str:
    return f"{TABLE_DIR}/prompts_step_{step:06d}.json"


def verdict(correct: bool | None) -> str:
    return "masked" if correct is None else ("correct" if correct else "wrong")


def sample_table(records: Sequence[ScoredSample], rows_per_tag: int) -> dict[str, list]:
    """Columns of the first `rows_per_tag` records of every tag, tags in sorted order, records in their order
    (a prompt's k responses are next to each other)."""
    by_tag: dict[str, list[ScoredSample]] = defaultdict(list)
    seen: dict[tuple[str, Any], int] = defaultdict(int)
    rows = []
    for r in records:
        index = seen[(r.domain, r.id)]
        seen[(r.domain, r.id)] += 1
        if len(by_tag[r.tag]) < rows_per_tag:
            by_tag[r.tag].append(r)
            rows.append((r.tag, r, index))
    rows.sort(key=lambda t: t[0])
    columns = [
        "tag",
        "verdict",
        "reward",
        "prompt",
        "response",
        "ground_truth",
        "domain",
        "prompt_id",
        "sample",
        "finish_reason",
        "response_length",
    ]
    if any(r.trajectory is not None for _, r, _ in rows):
        columns.append("trajectory")
    table: dict[str, list] = {c: [] for c in columns}
    for tag, r, index in rows:
        values = {
            "tag": tag,
            "domain": r.domain,
            "prompt_id": str(r.id),
            "sample": index,
            "prompt": r.prompt or "",
            "response": r.response_text,
            "ground_truth": "" if r.ground_truth is None else str(r.ground_truth),
            "reward": None if r.masked else float(r.score),
            "verdict": verdict(r.correct),
            "finish_reason": r.finish_reason,
            "response_length": int(r.response_length or 0),
            "trajectory": transcript(r.trajectory),
        }
        for c in columns:
            table[c].append(values[c])
    return table


def transcript(messages: Sequence[Mapping[str, str]] | None) -> str:
    """A multi-turn response as text for the sample tables: each message after its role; "" for single-turn."""
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages or ())


TRAIN_TABLE_DIR = "train_samples"


def train_table_file(step: int) -> str:
    return f"{TRAIN_TABLE_DIR}/step_{step:06d}.json"


def train_sample_table(
    records: Sequence[ScoredSample],
    prompts: Sequence[str],
    shaped: Sequence[float],
    advantages: Sequence[float],
    in_loss: Sequence[bool],
    rows_per_domain: int,
) -> dict[str, list]:
    """The first `rows_per_domain` training samples of each domain, in batch order: what the policy wrote, what it
    was scored (`reward`, None when the reward could not be computed), the reward after shaping (`shaped_reward`,
    the KL penalty left out), the mean advantage over its tokens, and whether it was in the loss."""
    taken: dict[str, int] = defaultdict(int)
    columns = [
        "domain", "tag", "prompt_id", "verdict", "reward", "shaped_reward", "advantage", "in_loss", "prompt",
        "response", "finish_reason", "response_length",
    ]
    if any(r.trajectory is not None for r in records):
        columns.append("trajectory")
    table: dict[str, list] = {c: [] for c in columns}
    for i, r in enumerate(records):
        if taken[r.domain] >= rows_per_domain:
            continue
        taken[r.domain] += 1
        values = {
            "domain": r.domain, "tag": r.tag, "prompt_id": str(r.id), "verdict": verdict(r.correct),
            "reward": None if r.masked else float(r.score), "shaped_reward": float(shaped[i]),
            "advantage": float(advantages[i]), "in_loss": bool(in_loss[i]), "prompt": prompts[i],
            "response": r.response_text, "finish_reason": r.finish_reason, "response_length": int(r.response_length or 0),
            "trajectory": transcript(r.trajectory),
        }
        for column in columns:
            table[column].append(values[column])
    return table


def accuracy_series(history: Mapping[int, Mapping[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """scope ("all" or a tag) -> [(step, val_correct/<scope>/mean)] over the steps that validated."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for step in sorted(history):
        for key, value in history[step].items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "val_correct" and parts[2] == "mean" and not math.isnan(value):
                series[parts[1]].append((step, value))
    return dict(sorted(series.items(), key=lambda kv: (kv[0] != "all", kv[0])))


def accuracy_chart(history: Mapping[int, Mapping[str, float]]) -> bytes:
    """A PNG line chart of every tag's validation accuracy (and all's) over the steps in `history`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for scope, points in accuracy_series(history).items():
        steps, values = zip(*points, strict=True)
        ax.plot(
            steps,
            values,
            marker="o",
            linewidth=2.5 if scope == "all" else 1.5,
            color="black" if scope == "all" else None,
            label=scope,
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("accuracy (val_correct/<tag>/mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Validation accuracy by tag")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="tag")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def log_validation_artifacts(
    tracker: Any,
    step: int,
    records: Sequence[ScoredSample],
    history: Mapping[int, Mapping[str, float]],
    rows_per_tag: int,
    outcomes: Mapping[str, PromptOutcome] | None = None,
) -> None:
    """The sample table of this validation, the accuracy chart over `history` (this step included) and every
    prompt's outcome (what `roll report` pairs two validations by)."""
    if rows_per_tag:
        tracker.log_table(sample_table(records, rows_per_tag), table_file(step))
    tracker.log_file(accuracy_chart(history), CHART_FILE)
    if outcomes is not None:
        tracker.log_dict(outcomes_table(outcomes), prompts_file(step))


# ------------------------------------------------------------------------------------------- roll report


@dataclass
class RunReport:
    run_id: str
    run_name: str
    status: str
    uri: str
    accuracy: dict[str, dict[int, float]]
    """scope -> step -> val_correct/<scope>/mean."""
    latest: dict[str, float] = field(default_factory=dict)
    """The run's last value of every validation metric."""


def load_report(target: str, uri: str | None = None) -> RunReport:
    """`target`: a run id, or a run's output_dir (or spool folder), whose spool knows the run id and URI."""
    from mlflow.tracking import MlflowClient

    from roll_core.tracking.mlflow_tracker import DEFAULT_TRACKING_URI, absolute_uri
    from roll_core.tracking.spool import Spool

    run_id = target
    if Path(target).exists():
        spools = Spool.find(target)
        if not spools:
            raise ValueError(f"{target} holds no tracking spool (is it a run's output_dir?)")
        spool = Spool(spools[-1])
        if spool.run_id is None:
            raise ValueError(
                f"the MLflow run of {spools[-1]} was never created: send it with `roll mlflow sync {target}`"
            )
        run_id, uri = spool.run_id, uri or spool.meta["tracking_uri"]
    uri = absolute_uri(uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    latest = {
        k: v
        for k, v in run.data.metrics.items()
        if k.startswith(
            ("val_correct/", "val_response_length/", "val_truncated/", "val_prompts/", "val_ci/", "val_change/")
        )
    }
    accuracy = {}
    for key in latest:
        parts = key.split("/")
        if parts[0] == "val_correct" and parts[-1] == "mean":
            accuracy[parts[1]] = {m.step: m.value for m in client.get_metric_history(run_id, key)}
    return RunReport(run_id, run.info.run_name or "", run.info.status, uri, accuracy, latest)


def validation_steps(report: RunReport) -> list[int]:
    """The steps at which the run validated, in order."""
    return sorted({step for series in report.accuracy.values() for step in series})


def _pick_steps(steps: list[int], most: int) -> list[int]:
    if len(steps) <= most:
        return steps
    picks = {steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def format_report(report: RunReport, max_columns: int = 8) -> str:
    """The per-tag table: accuracy at each validation step, then every validation metric at the last one."""
    scopes = sorted(report.accuracy, key=lambda s: (s != "all", s))
    lines = [f"run {report.run_name} ({report.run_id}), {report.status}, {report.uri}"]
    if not scopes:
        lines.append("no validation metrics logged")
        return "\n".join(lines)
    width = max(12, *(len(s) + 2 for s in scopes))
    steps = validation_steps(report)
    shown = _pick_steps(steps, max_columns)
    lines += [
        "",
        "validation accuracy (val_correct/<tag>/mean) by step",
        f"{'tag':<{width}}" + "".join(f"{'step ' + str(s):>11}" for s in shown),
    ]
    for scope in scopes:
        row = report.accuracy[scope]
        lines.append(
            f"{scope:<{width}}" + "".join(f"{row[s]:>11.3f}" if s in row else f"{'-':>11}" for s in shown)
        )

    suffixes = sorted(
        {k.split("/")[-1] for k in report.latest if k.startswith("val_correct/")} - {"mean"},
        key=lambda s: (s.split("_at_")[0], int(s.split("_at_")[-1])),
    )
    columns = [("mean@k", "val_correct/{}/mean", ".3f")]
    columns += [(s.replace("_at_", "@"), "val_correct/{}/" + s, ".3f") for s in suffixes]
    columns += [
        ("ci_low", "val_ci/{}/low", ".3f"),
        ("ci_high", "val_ci/{}/high", ".3f"),
        ("length", "val_response_length/{}/mean", ".1f"),
        ("truncated", "val_truncated/{}/rate", ".3f"),
        ("prompts", "val_prompts/{}/count", ".0f"),
    ]
    if any(k.startswith("val_change/") for k in report.latest):
        columns += [
            ("change", "val_change/{}/difference", "+.3f"),
            ("p_holm", "val_change/{}/p_adjusted", ".3f"),
            ("regressed", "val_change/{}/regressed", ".0f"),
        ]
    lines += [
        "",
        f"at the last validation (step {steps[-1]}; ci: Wilson interval over prompts; change: prompts solved"
        " against the validation before, p_holm: McNemar, Holm-adjusted over the tags)",
        f"{'tag':<{width}}" + "".join(f"{name:>11}" for name, _, _ in columns),
    ]
    for scope in scopes:
        values = [(report.latest.get(pattern.format(scope)), fmt) for _, pattern, fmt in columns]
        lines.append(
            f"{scope:<{width}}" + "".join(f"{'-':>11}" if v is None else f"{format(v, fmt):>11}" for v, fmt in values)
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ roll report A B


def validation_outcomes(report: RunReport, step: int) -> dict[str, PromptOutcome]:
    """The per-prompt outcomes of a run's validation at ``step`` (``validation/prompts_step_<N>.json``)."""
    import tempfile

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=report.uri)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(report.run_id, prompts_file(step), tmp)
        except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
            raise ValueError(
                f"run {report.run_id} has no per-prompt outcomes for its validation at step {step}: it "
                f"was validated by an older version, or the artifact {prompts_file(step)} did not arrive "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    return outcomes_from_table(table)


def last_validation_outcomes(report: RunReport) -> tuple[int, dict[str, PromptOutcome]]:
    """The step of a run's last validation and its per-prompt outcomes."""
    steps = validation_steps(report)
    if not steps:
        raise ValueError(f"run {report.run_id} has no validation")
    return steps[-1], validation_outcomes(report, steps[-1])


def format_run_change_report(report: RunReport, alpha: float = 0.05) -> str:
    """The run's first validation against its last, paired by prompt, per domain and tag (``run_change``); a line
    saying why not where the run validated once or its per-prompt outcomes are missing."""
    steps = validation_steps(report)
    if len(steps) < 2:
        return "over the run: one validation only, nothing to compare"
    try:
        first, last = (validation_outcomes(report, step) for step in (steps[0], steps[-1]))
    except ValueError as err:
        return f"over the run: {err}"
    lines = [f"over the run: step {steps[0]} against step {steps[-1]}, paired by prompt"]
    lines += format_run_change(run_change(first, last, alpha), steps[0], steps[-1], alpha)
    return "\n".join(lines)


def format_comparison(
    a: RunReport,
    b: RunReport,
    outcomes_a: tuple[int, Mapping[str, PromptOutcome]],
    outcomes_b: tuple[int, Mapping[str, PromptOutcome]],
    alpha: float = 0.05,
    confidence: float = 0.95,
) -> str:
    """Two runs' last validations, tag by tag: each accuracy with its Wilson interval, and the paired comparison
    of the prompts both judged (McNemar's exact test, Holm-adjusted over the tags), flagged where significant."""
    (step_a, before), (step_b, after) = outcomes_a, outcomes_b
    ci_a, ci_b = intervals(before, confidence), intervals(after, confidence)
    changes = compare(before, after, alpha)
    scopes = sorted(set(ci_a) | set(ci_b), key=lambda s: (s != ALL, s))
    width = max(12, *(len(s) + 2 for s in scopes))
    lines = [
        f"A: run {a.run_name} ({a.run_id}), last validation at step {step_a}",
        f"B: run {b.run_name} ({b.run_id}), last validation at step {step_b}",
        "",
        f"accuracy [{confidence:.0%} Wilson interval over prompts]; paired: prompts judged in both;",
        "B-A: change in the share of paired prompts solved; p_holm: McNemar's exact test, Holm-adjusted over the",
        f"tags; flagged where p_holm < {alpha:g}",
        "",
        f"{'tag':<{width}}{'A':>24}{'B':>24}{'paired':>8}{'B-A':>8}{'p_holm':>8}  flag",
    ]
    for scope in scopes:
        cells = [ci_text(ci_a.get(scope)), ci_text(ci_b.get(scope))]
        change = changes.get(scope)
        if change is None:
            tail = f"{0:>8}{'-':>8}{'-':>8}  no prompt in both"
        else:
            flag = ""
            if change.p_adjusted < alpha:
                flag = "B worse" if change.solved_after < change.solved_before else "B better"
            tail = f"{change.paired:>8}{change.difference:>+8.3f}{change.p_adjusted:>8.3f}  {flag}"
        lines.append(f"{scope:<{width}}" + "".join(f"{c:>24}" for c in cells) + tail)
    return "\n".join(lines)
