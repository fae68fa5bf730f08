"""Loading prompt data with `datasets` (JSONL, JSON, Parquet, saved dataset folders) and routing rows to domains."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from roll_pipeline.config import DataConfig, RewardConfig

logger = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """A data file or row cannot be used; the message names the file (and row)."""


def load_rows(path: str) -> list[dict[str, Any]]:
    """All rows of one data file or saved dataset folder, each with `_source` ("file:row") for error messages."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DataError(f"dataset folder {path} has splits {list(ds)} and no 'train' split")
                ds = ds["train"]
        else:
            builder = _BUILDERS.get(p.suffix)
            if builder is None:
                raise DataError(f"data file {path}: unsupported format {p.suffix!r} (use .jsonl, .json, .parquet)")
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds; the user needs the file name and the reason
        raise DataError(f"cannot load data file {path}: {type(exc).__name__}: {exc}") from None
    return [{**row, "_source": f"{path}:{i + 1}"} for i, row in enumerate(ds)]


def route_by_domain(rows: list[dict[str, Any]], rewards: Mapping[str, RewardConfig]) -> dict[str, list[dict[str, Any]]]:
    """Group rows by the domain whose `tag_included` lists their tag; rows of unrouted tags are counted and left."""
    tag_to_domain = {tag: d for d, r in rewards.items() for tag in r.tag_included}
    routed: dict[str, list[dict[str, Any]]] = {d: [] for d in rewards}
    unrouted: Counter[str] = Counter()
    for row in rows:
        if "tag" not in row:
            raise DataError(f"{row['_source']}: row has no 'tag' field, so no domain can be chosen for it")
        domain = tag_to_domain.get(row["tag"])
        if domain is None:
            unrouted[row["tag"]] += 1
        else:
            routed[domain].append({**row, "domain": domain})
    if unrouted:
        logger.warning(
            "left out %d rows whose tag is in no rewards.<domain>.tag_included: %s",
            sum(unrouted.values()),
            dict(unrouted),
        )
    return routed


def prompt_messages(row: Mapping[str, Any], data: DataConfig) -> list[dict[str, str]]:
    messages = row.get(data.messages_key)
    if messages:
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "content" in m for m in messages):
            raise DataError(f"{row['_source']}: '{data.messages_key}' must be a list of {{role, content}} messages")
        return [{"role": m.get("role", "user"), "content": m["content"]} for m in messages]
    prompt = row.get(data.prompt_key)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{row['_source']}: row has neither '{data.messages_key}' nor a '{data.prompt_key}' string")
    return [{"role": "user", "content": prompt}]


def encode_prompts(tokenizer: Any, rows: list[dict[str, Any]], data: DataConfig) -> list[list[int]]:
    """Chat-template token ids of each row's prompt; a prompt over `data.prompt_length` tokens is an error."""
    encoded = []
    for row in rows:
        ids = tokenizer.apply_chat_template(prompt_messages(row, data), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) > data.prompt_length:
            raise DataError(
                f"{row['_source']}: prompt has {len(ids)} tokens, more than data.prompt_length={data.prompt_length}"
            )
        encoded.append(ids)
    return encoded


def collate_prompts(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and their mask, so every prompt ends where generation starts."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, width - len(toks) :] = torch.tensor(toks, dtype=torch.long)
            mask[i, width - len(toks) :] = 1
    return ids, mask


def load_domain_rows(files: list[str], rewards: Mapping[str, RewardConfig]) -> dict[str, list[dict[str, Any]]]:
    rows = [row for f in files for row in load_rows(f)]
    return route_by_domain(rows, rewards)
