"""``reward_model``: a discriminative reward model (a Hugging Face sequence- or token-classification model)
scores prompt + response.

The model reads the conversation rendered through its *own* tokenizer's chat template (the policy's tokenizer
may differ): the prompt's chat messages, then the response as the assistant's turn, ending at the end-of-turn
token (trailing whitespace stripped). Its score is the classification logit at the last token: the model's own
pooling for a ``...ForSequenceClassification`` (one label), the last valid token's logit of label 0 for a
``...ForTokenClassification`` (as verl's reward model reads it). A tokenizer without a chat template reads the
prompt's text, a newline and the response. Too long a conversation keeps its end (truncated on the left), since
the score is read at the end.

It is a ``BatchedRewardScorer``: the reward worker loads the model once on its device (a GPU when
``rewards.<domain>.num_gpus_per_worker`` > 0) and scores each batch in micro-batches. Whatever the response
says, it gets a score (an empty response too); only an infrastructure failure (the model raised, a non-finite
logit) masks the batch.

Options: ``model_path`` (a local folder), ``head`` (``auto``: from the model's architecture, or ``sequence`` /
``token``), ``batch_size`` (16), ``max_length`` (1024 tokens), ``dtype`` (``float32``; ``bfloat16`` on a GPU),
``scale`` (1.0) and ``shift`` (0.0): the reward is ``scale * logit + shift``; ``correct_threshold`` (0.0): the
response counts as correct when the logit is at least this; ``packing`` (false): each micro-batch's conversations
run as one row of their tokens, positions restarting per conversation, no padding (as a training section's
``use_sequence_packing``; the score read at each conversation's last token, through the sequence head's ``score``
layer), attention row by row with sdpa (roll_core/models/row_attention.py) unless ``attn_implementation`` names
another kernel (``flash_attention_2`` on a GPU). Per-sample metric: ``rm_logit``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

from roll_core.rewards.scorer import BatchedRewardScorer, RewardResult
from workers.rewards.registry import register_reward_worker

HEADS = ("auto", "sequence", "token")
DTYPES = ("float32", "bfloat16", "float16")


def render_conversation(tokenizer, messages: list[dict] | None, prompt: str, response: str) -> str:
    """The text a reward model scores (see the module's docstring)."""
    turns = [dict(m) for m in messages] if messages else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": response}], tokenize=False)
        return text.rstrip()
    return "\n".join([*(str(t.get("content", "")) for t in turns), response]).rstrip()


@register_reward_worker("reward_model")
class RewardModelScorer(BatchedRewardScorer):
    """See the module's docstring."""

    def __init__(
        self,
        *,
        model_path: str | None = None,
        head: str = "auto",
        batch_size: int = 16,
        max_length: int = 1024,
        dtype: str = "float32",
        scale: float = 1.0,
        shift: float = 0.0,
        correct_threshold: float = 0.0,
        packing: bool = False,
        attn_implementation: str | None = None,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if not model_path:
            raise ValueError("reward_model: options.model_path must name the reward model's folder")
        if not (Path(model_path) / "config.json").is_file():
            from roll_core.models.embedded import build_hint

            hint = build_hint(model_path) or "a folder written by save_pretrained (relative to the working directory)"
            raise ValueError(f"reward_model: options.model_path {model_path!r} is not a model folder (no config.json): {hint}")
        if head not in HEADS:
            raise ValueError(f"reward_model: head must be one of {list(HEADS)}, got {head!r}")
        if dtype not in DTYPES:
            raise ValueError(f"reward_model: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"reward_model: batch_size must be >= 1 and max_length >= 2, got {batch_size}, {max_length}")
        for name, value in (("scale", scale), ("shift", shift), ("correct_threshold", correct_threshold)):
            if not math.isfinite(value):
                raise ValueError(f"reward_model: {name} must be a finite number, got {value}")
        if not isinstance(packing, bool):
            raise ValueError(f"reward_model: packing must be true or false, got {packing!r}")
        if attn_implementation is not None and not isinstance(attn_implementation, str):
            raise ValueError(f"reward_model: attn_implementation must be a kernel's name, got {attn_implementation!r}")
        self.packing, self.attn_implementation = packing, attn_implementation
        self.model_path, self.head, self.dtype = str(model_path), head, dtype
        self.batch_size, self.max_length = batch_size, max_length
        self.scale, self.shift, self.correct_threshold = scale, shift, correct_threshold
        self.model = self.tokenizer = self.device = None

    @classmethod
    def check_row(cls, row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
        return iter(())  # the model judges prompt + response: no ground truth needed

    def load(self, device) -> None:
        import torch
        from transformers import (
            AutoConfig,
            AutoModelForSequenceClassification,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        config = AutoConfig.from_pretrained(self.model_path)
        head = self.head
        if head == "auto":
            archs = config.architectures or []
            if any(a.endswith("ForSequenceClassification") for a in archs):
                head = "sequence"
            elif any(a.endswith("ForTokenClassification") for a in archs):
                head = "token"
            else:
                raise ValueError(
                    f"reward_model: {self.model_path} is a {archs or 'model of unknown architecture'}, not a "
                    "...ForSequenceClassification or ...ForTokenClassification; set options.head to read it as one"
                )
        model_cls = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        kwargs = {"dtype": getattr(torch, self.dtype)}
        from roll_core.models import row_attention

        kernel = row_attention.kernel_for(self.attn_implementation, self.packing)
        if kernel is not None:
            kwargs["attn_implementation"] = kernel
        self.model = model_cls.from_pretrained(self.model_path, **kwargs).to(device).eval()
        if self.packing and head == "sequence" and not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise ValueError(
                f"reward_model: packing reads the sequence head at each conversation's last token through the "
                f"model's `score` layer, which {type(self.model).__name__} lacks; set options.packing to false"
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.head, self.device = head, device

    def score_batch(self, samples: list[dict]) -> list[RewardResult | None]:
        import torch

        if self.model is None:
            raise RuntimeError("reward_model: load(device) was not called")
        texts = [
            render_conversation(self.tokenizer, s.get("prompt_messages"), str(s.get("prompt", "")), str(s["response"]))
            for s in samples
        ]
        logits: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                part = texts[i : i + self.batch_size]
                values = self._packed_logits(part) if self.packing else self._padded_logits(part)
                logits += values.cpu().tolist()
        bad = [i for i, v in enumerate(logits) if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"reward_model: non-finite logits for samples {bad[:5]} of {self.model_path}")
        return [
            RewardResult(score=self.scale * v + self.shift, correct=v >= self.correct_threshold, metrics={"rm_logit": v})
            for v in logits
        ]

    def _padded_logits(self, texts: list[str]):
        """The logits of one micro-batch of conversations, right-padded to the longest."""
        import torch

        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        out = self.model(**enc).logits.float()
        if self.head == "sequence":
            return out[:, 0]
        last = enc["attention_mask"].sum(-1) - 1
        return out[torch.arange(out.shape[0], device=out.device), last, 0]

    def _packed_logits(self, texts: list[str]):
        """The logits of one micro-batch of conversations packed into one row: no attention mask and no cache, the
        positions restarting at each conversation, which keeps each one's attention inside it (as
        roll_core.models.forward.packed_sequence); each read at its last token."""
        import torch

        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        lengths = torch.tensor([len(x) for x in ids])
        inputs = {
            "input_ids": torch.tensor([t for x in ids for t in x], device=self.device)[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]).to(self.device)[None],
            "use_cache": False,
        }
        last = (lengths.cumsum(0) - 1).to(self.device)
        if self.head == "sequence":
            hidden = self.model.base_model(**inputs).last_hidden_state[0, last]
            return self.model.score(hidden).float()[:, 0]
        return self.model(**inputs).logits.float()[0, last, 0]
