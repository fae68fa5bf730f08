"""What a run was made of, as MLflow tags: code version, inputs and their hashes, domains, validation."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from importlib import metadata
from pathlib import Path

from roll_core.config import ResolvedConfig

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[2]


def content_hash(path: str | Path) -> str:
    """sha256 of a file, or of a folder: over its files' relative paths and own sha256, in sorted order."""
    path = Path(path)
    if path.is_file():
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{content_hash(file)}\n".encode())
    return digest.hexdigest()


def package_version() -> str:
    try:
        return metadata.version("roll-pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_state(repo: Path = _REPO) -> dict[str, str]:
    """The commit of the checkout the code runs from and whether tracked files differ from it; empty when the
    code is not in a git checkout (an installed wheel) or git is missing."""
    if not (repo / ".git").exists():
        return {}
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("could not read the git commit of %s: %s", repo, exc)
        return {}
    return {"mlflow.source.git.commit": commit, "roll.git.dirty": str(bool(status.strip())).lower()}


def build_seed(model_path: Path) -> str | None:
    """The seed recorded by `roll model build-tiny` (build_info.json), for the embedded model."""
    info = model_path / "build_info.json"
    if not info.is_file():
        return None
    return str(json.loads(info.read_text()).get("seed"))


def run_tags(resolved: ResolvedConfig, hash_inputs: bool = True) -> dict[str, str]:
    """Tags describing a run's code and inputs (docs/tracking.md names them)."""
    cfg = resolved.config
    tags = {
        "roll.version": package_version(),
        **git_state(),
        "roll.config_path": resolved.config_path,
        "domains": ",".join(cfg.domain_interleave_probs),
    }
    for domain, reward in cfg.rewards.items():
        tags[f"roll.domain.{domain}.worker"] = ",".join(
            c.worker if len(reward.components()) == 1 else f"{c.label}={c.worker}*{c.weight:g}"
            for c in reward.components()
        )
        tags[f"roll.domain.{domain}.tags"] = ",".join(reward.tag_included)
    v = cfg.validation
    tags["roll.validation.mode"] = "sampled" if v.generating_args.do_sample else "greedy"
    tags["roll.validation.k"] = str(v.num_samples)

    models = {"pretrain": cfg.pretrain}
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        section = getattr(cfg, name)
        if section is not None and section.model_args.model_name_or_path != cfg.pretrain:
            models[name] = section.model_args.model_name_or_path
    for name, path in models.items():
        prefix = "roll.model" if name == "pretrain" else f"roll.model.{name}"
        tags[f"{prefix}.path"] = path
        local = Path(path)
        if local.exists():
            if hash_inputs:
                tags[f"{prefix}.sha256"] = content_hash(local)
            seed = build_seed(local)
            if seed is not None:
                tags[f"{prefix}.build_seed"] = seed
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        for i, f in enumerate(files):
            tags[f"roll.data.{split}.{i}.path"] = f
            if hash_inputs and Path(f).exists():
                tags[f"roll.data.{split}.{i}.sha256"] = content_hash(f)
    return tags
