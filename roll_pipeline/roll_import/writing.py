"""The imported config as it is written: `--set` edits applied, checked against this project's schema (the same
load `roll run` does, without touching models or data), and a header that carries the report's substance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.config import ConfigError
from roll_core.config.loader import apply_overrides, from_dict
from roll_pipeline.roll_import.convert import import_roll_config
from roll_pipeline.roll_import.report import ImportReport


@dataclass
class CheckedImport:
    config: dict[str, Any]
    report: ImportReport
    problems: str | None
    """Why the config does not load here (the schema's message, every problem), or None."""


def checked_config(source: str | Path, overrides: list[str]) -> CheckedImport:
    from roll_pipeline.driver.names import name_problems

    result = import_roll_config(source)
    config = apply_overrides(result.config, overrides)
    try:
        from_dict(config, (name_problems,))
    except ConfigError as exc:
        return CheckedImport(config, result.report, str(exc))
    return CheckedImport(config, result.report, None)


def header(source: str | Path, report: ImportReport) -> str:
    """Comment lines for the top of the written YAML: where it came from and what changed meaning."""
    lines = [
        f"# Imported from ROLL's {Path(source).name} by `roll config import`: {len(report.mapped)} key(s) mapped,",
        f"# {len(report.changed)} changed meaning, {len(report.unsupported)} not supported (left out).",
    ]
    for title, rows in (("Changed meaning", report.changed), ("Not supported, left out", report.unsupported)):
        if rows:
            lines.append(f"# {title}:")
            lines.extend(f"#   {key}: {' '.join(what.split())}" for key, what in rows)
    return "\n".join(lines) + "\n"
