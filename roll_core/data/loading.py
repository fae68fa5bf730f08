"""Loading prompt data, routing rows to domains by tag, checking rows against their domain's reward scorer, and
encoding prompts.

JSONL files are read line by line, so that every row and every error names its 1-based line (`datasets` skips
blank lines, which shifts row numbers, and hides the JSON error); JSON, Parquet and saved dataset folders load
with `datasets`. Every problem is a `DataError` whose message names the file, the line or row, and the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll_core.config import DataConfig, RewardConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".parquet": "parquet"}
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
#: Problems one error lists before it only counts the rest.
MAX_LISTED = 5

#: A reward scorer's row check: (field, what is wrong) for each problem of one row.
RowCheck = Callable[[Mapping[str, Any]], Iterable[tuple[str, str]]]


class DataError(ValueError):
    """A data file or row cannot be used; the message names the file (and line or row, and field)."""


def _listing(head: str, items: list[str], total: int) -> str:
    more = f"\n  ... and {total - len(items)} more" if total > len(items) else ""
    return head + "".join(f"\n  {item}" for item in items) + more


def load_rows(path: str) -> list[dict[str, Any]]:
    """All rows of one data file or saved dataset folder, each with `_source` for messages: "file:line" (the
    1-based line) for JSONL, "file row N" for the other formats."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    if p.is_file() and p.suffix == ".jsonl":
        return _read_jsonl(p)
    import datasets

    datasets.disable_progress_bars()
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
                raise DataError(
                    f"data file {path}: unsupported format {p.suffix!r} (use .jsonl, .json, .parquet)"
                )
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds; the user needs the file name and the reason
        raise DataError(f"cannot load data file {path}: {type(exc).__name__}: {exc}") from None
    return [{**row, "_source": f"{path} row {i + 1}"} for i, row in enumerate(ds)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(row, dict):
                kind = "null" if row is None else _JSON_KINDS.get(type(row), type(row).__name__)
                raise DataError(
                    f"{path}:{lineno}: a JSONL line must hold one JSON object, this one holds {kind}"
                )
            rows.append({**row, "_source": f"{path}:{lineno}"})
    return rows


def _tag_lists(rewards: Mapping[str, RewardConfig]) -> str:
    return "; ".join(f"rewards.{d}.tag_included: {list(r.tag_included)}" for d, r in rewards.items())


def route_by_domain(
    rows: list[dict[str, Any]], rewards: Mapping[str, RewardConfig]
) -> dict[str, list[dict[str, Any]]]:
    """Group rows by the domain whose `tag_included` lists their tag; a row whose tag no domain claims is an error
    (a typo in a tag or in `tag_included` would otherwise silently shrink the data)."""
    tag_to_domain = {tag: d for d, r in rewards.items() for tag in r.tag_included}
    routed: dict[str, list[dict[str, Any]]] = {d: [] for d in rewards}
    unclaimed: dict[str, list[str]] = {}
    for row in rows:
        tag = row.get("tag")
        if not isinstance(tag, str):
            problem = "is missing" if tag is None else f"must be a string, got {tag!r}"
            raise DataError(
                f"{row['_source']}: field 'tag' {problem}, so no domain can be chosen for the row"
            )
        domain = tag_to_domain.get(tag)
        if domain is None:
            unclaimed.setdefault(tag, []).append(row["_source"])
        else:
            routed[domain].append({**row, "domain": domain})
    if unclaimed:
        items = [
            f"{sources[0]}: tag {tag!r} ({len(sources)} row{'s' if len(sources) > 1 else ''})"
            for tag, sources in unclaimed.items()
        ]
        head = f"{len(unclaimed)} tag(s) claimed by no domain ({_tag_lists(rewards)}):"
        raise DataError(_listing(head, items[:MAX_LISTED], len(items)))
    return routed


def check_rows(routed: Mapping[str, list[dict[str, Any]]], row_checks: Mapping[str, RowCheck]) -> None:
    """Raise one DataError listing the rows (the first `MAX_LISTED`, and a count) whose domain's reward scorer
    cannot use them, each with its file, line and field; domains without a check in `row_checks` pass."""
    items: list[str] = []
    total = 0
    for domain, rows in routed.items():
        check = row_checks.get(domain)
        if check is None:
            continue
        for row in rows:
            for field, problem in check(row):
                total += 1
                if len(items) < MAX_LISTED:
                    items.append(f"{row['_source']}: field {field!r}: {problem} (domain {domain})")
    if total:
        raise DataError(_listing(f"{total} problem(s) in rows the reward scorers cannot use:", items, total))


def require_rows(
    routed: Mapping[str, list[dict[str, Any]]], rewards: Mapping[str, RewardConfig], files: list[str]
) -> None:
    """Every domain needs training rows: name the domain, its tags and the files searched when one has none."""
    empty = [d for d, rows in routed.items() if not rows]
    if empty:
        found = sorted({row["tag"] for rows in routed.values() for row in rows})
        raise DataError(
            "\n".join(
                f"rewards.{d}: no training row has a tag in its tag_included {list(rewards[d].tag_included)}"
                for d in empty
            )
            + f"\n  searched data.train_files: {', '.join(files)} (tags found there: {found or 'none'})"
        )


def require_unique_ids(routed: Mapping[str, list[dict[str, Any]]]) -> None:
    """Validation rows need ids of their own within a domain: validation scores a prompt by its `id` (its k
    responses share it; pass@k, maj@k and the per-prompt outcomes the significance tests compare group by it), so
    two rows with one id would be scored as one prompt with 2k responses. A row without an id is named by its file
    and line, which are its own. Ids compare as text, as the per-prompt outcomes store them."""
    items: list[str] = []
    total = 0
    for domain, rows in routed.items():
        sources: dict[str, list[str]] = {}
        for row in rows:
            if "id" in row:
                sources.setdefault(str(row["id"]), []).append(row["_source"])
        for key, where in sources.items():
            if len(where) > 1:
                total += 1
                if len(items) < MAX_LISTED:
                    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
                    items.append(f"id {key!r} (domain {domain}) in {len(where)} rows: {shown}")
    if total:
        head = f"{total} id(s) given to more than one validation row of a domain (each prompt needs its own id):"
        raise DataError(_listing(head, items, total))


def prompt_messages(row: Mapping[str, Any], data: DataConfig) -> list[dict[str, str]]:
    messages = row.get(data.messages_key)
    if messages:
        if not isinstance(messages, list) or not all(
            isinstance(m, Mapping) and "content" in m for m in messages
        ):
            raise DataError(
                f"{row['_source']}: field '{data.messages_key}' must be a list of {{role, content}} messages"
            )
        return [{"role": m.get("role", "user"), "content": m["content"]} for m in messages]
    prompt = row.get(data.prompt_key)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(
            f"{row['_source']}: row has neither '{data.messages_key}' nor a '{data.prompt_key}' string"
        )
    return [{"role": "user", "content": prompt}]


def encode_prompt(
    tokenizer: Any, row: Mapping[str, Any], data: DataConfig, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Chat-template token ids of one row's prompt, ending where generation starts; `tools` (function
    descriptions) rendered by the template's tools support."""
    described = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(
        prompt_messages(row, data), add_generation_prompt=True, tokenize=True, **described
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _too_long(rows: list[Mapping[str, Any]], lengths: list[int], data: DataConfig) -> DataError:
    items = [
        f"{row['_source']}: field '{_prompt_field(row, data)}': {n} tokens"
        for row, n in zip(rows, lengths, strict=True)
    ]
    head = (
        f"{len(rows)} prompt(s) longer than data.prompt_length={data.prompt_length} tokens "
        "(raise data.prompt_length, or set data.on_long_prompt: drop to leave them out):"
    )
    return DataError(_listing(head, items[:MAX_LISTED], len(items)))


def _prompt_field(row: Mapping[str, Any], data: DataConfig) -> str:
    return data.messages_key if row.get(data.messages_key) else data.prompt_key


def encode_prompts(tokenizer: Any, rows: list[dict[str, Any]], data: DataConfig) -> list[list[int]]:
    """Token ids of every row's prompt; a prompt over `data.prompt_length` tokens is an error (`fit_prompts`
    applies `data.on_long_prompt`)."""
    encoded = [encode_prompt(tokenizer, row, data) for row in rows]
    long = [(row, len(ids)) for row, ids in zip(rows, encoded, strict=True) if len(ids) > data.prompt_length]
    if long:
        raise _too_long([r for r, _ in long], [n for _, n in long], data)
    return encoded


@dataclass(frozen=True)
class DomainPrompts:
    """One domain's rows whose prompts fit `data.prompt_length`, with their token ids (same order)."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    #: Rows left out because their prompt was too long (`data.on_long_prompt: drop`).
    dropped: int = 0


def fit_prompts(
    tokenizer: Any,
    routed: Mapping[str, list[dict[str, Any]]],
    data: DataConfig,
    split: str,
    *,
    tools: Mapping[str, list[dict[str, Any]]] | None = None,
    warn: bool = True,
) -> dict[str, DomainPrompts]:
    """Encode each domain's prompts (with the tools `tools` gives the domain described, require_tools_rendered)
    and apply `data.on_long_prompt` to those over `data.prompt_length`: an error naming every such row's file,
    line and length, or leave them out, counted per domain (and logged unless `warn` is off, for callers that
    report the counts themselves). A training domain left with no row is an error."""
    out: dict[str, DomainPrompts] = {}
    for domain, rows in routed.items():
        described = (tools or {}).get(domain)
        if described:
            require_tools_rendered(tokenizer, domain, described)
        encoded = [encode_prompt(tokenizer, row, data, described) for row in rows]
        long = [i for i, ids in enumerate(encoded) if len(ids) > data.prompt_length]
        if long and data.on_long_prompt == "error":
            raise _too_long([rows[i] for i in long], [len(encoded[i]) for i in long], data)
        if long and warn:
            logger.warning(
                "data.on_long_prompt=drop: left out %d of %d %s prompts of domain %s longer than "
                "data.prompt_length=%d (the first at %s)",
                len(long),
                len(rows),
                split,
                domain,
                data.prompt_length,
                rows[long[0]]["_source"],
            )
        if long and split == "train" and len(long) == len(rows):
            raise DataError(
                f"rewards.{domain}: all {len(rows)} training prompts are longer than "
                f"data.prompt_length={data.prompt_length}, so data.on_long_prompt: drop left none"
            )
        keep = sorted(set(range(len(rows))) - set(long))
        out[domain] = DomainPrompts([rows[i] for i in keep], [encoded[i] for i in keep], len(long))
    return out


def require_tools_rendered(tokenizer: Any, domain: str, tools: list[dict[str, Any]]) -> None:
    """A domain whose environment describes its tools needs a chat template that renders them: one that ignores
    `tools` would leave the model with a call format nobody told it about."""
    probe = [{"role": "user", "content": "?"}]
    plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    described = tokenizer.apply_chat_template(probe, tools=tools, add_generation_prompt=True, tokenize=False)
    if described == plain:
        names = ", ".join(repr(t.get("function", t).get("name")) for t in tools)
        raise DataError(
            f"rewards.{domain}.rollout: the environment describes its tools ({names}) for the prompt, but the chat "
            f"template of {getattr(tokenizer, 'name_or_path', 'the model')} does not render tools; use a model "
            "whose template has tools support, or a call format the model was taught (the python environment's "
            "call_format: plain)"
        )


@dataclass(frozen=True)
class RunData:
    """A run's prompts, loaded, checked and tokenized once: the preflight checks make it and the run uses it."""

    train: dict[str, DomainPrompts]
    val: dict[str, DomainPrompts]

    def dropped(self) -> dict[str, int]:
        """`data/<domain>/<split>_prompts_dropped`: prompts left out as longer than data.prompt_length."""
        return {
            f"data/{d}/{split}_prompts_dropped": p.dropped
            for split, prompts in (("train", self.train), ("val", self.val))
            for d, p in prompts.items()
        }


def collate_prompts(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and their mask, so every prompt ends where generation starts."""
    import torch

    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, width - len(toks) :] = torch.tensor(toks, dtype=torch.long)
            mask[i, width - len(toks) :] = 1
    return ids, mask


def load_domain_rows(
    files: list[str], rewards: Mapping[str, RewardConfig]
) -> dict[str, list[dict[str, Any]]]:
    rows = [row for f in files for row in load_rows(f)]
    return route_by_domain(rows, rewards)
