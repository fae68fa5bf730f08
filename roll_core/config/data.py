"""The `data` section: the prompt files and how prompts are encoded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_files: list[str]
    """JSONL, JSON or Parquet files, or local Hugging Face dataset folders; relative to the config file."""
    val_files: list[str] = field(default_factory=list)
    messages_key: str = "messages"
    """Column with chat messages; rows without it use `prompt_key` as a single user message."""
    prompt_key: str = "prompt"
    prompt_length: int = 256
    """Longest prompt in tokens (after the chat template)."""
    on_long_prompt: Literal["error", "drop"] = "error"
    """A prompt longer than `prompt_length`: `error` stops before the run starts, naming its file, line and both
    lengths; `drop` leaves the row out and counts it per domain and split: a warning, the metric
    `data/<domain>/{train,val}_prompts_dropped` (step 0) and a line of `roll run --dry-run`."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if not self.train_files:
            yield "train_files", "must list at least one file"
        if self.prompt_length < 1:
            yield "prompt_length", "must be >= 1"
