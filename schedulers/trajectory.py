"""A multi-turn response as token ids: the model's turns and the tools' outputs, in the order they happened.

Token ids in, token ids out: a turn's tokens are kept exactly as the engine sampled them (with their log-probs), a
tool's output is encoded once when it is appended, and nothing is ever decoded and encoded again. The rows a
trajectory becomes keep the two kinds apart: `response_mask` is 1 on the tokens the model sampled (the loss, the
KL, the importance weights and the sampling-distribution rule cover those only), `tool_mask` is 1 on the tokens a
tool wrote (in the sequence the model reads, so the trainer's forward attends to them, never in the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from roll_core.environment import EnvStep

TOOL_MESSAGES = ("template", "inline")


def plain_tool_message(observation: str) -> str:
    """The tool's answer inline (`tool_message: inline`): it follows the call's closing tag in the same assistant
    message, and the model goes on after it."""
    return f"\n<output>\n{observation}\n</output>\n"


def tool_answer_text(tokenizer: Any, observation: str, mode: str) -> str:
    """The text that follows a model turn ending in a tool call, up to where the model goes on.

    `template`: the chat template closes the model's turn, renders the answer as a `tool` message, and opens the
    next assistant turn (ChatML templates, the embedded models' and SmolLM2's, write `<|im_start|>tool`; Qwen2.5's
    a `<tool_response>` in a user turn): the text between a placeholder assistant message and the end of the
    rendered conversation. `inline`: plain_tool_message."""
    if mode == "inline":
        return plain_tool_message(observation)
    marker = "\x00turn\x00"
    chat = [{"role": "user", "content": "\x00question\x00"}, {"role": "assistant", "content": marker}]
    text = tokenizer.apply_chat_template(
        [*chat, {"role": "tool", "content": observation}], add_generation_prompt=True, tokenize=False
    )
    at = text.find(marker)
    if at < 0 or observation not in text[at:]:
        raise ValueError(
            "the model's chat template does not render a tool message after an assistant turn; set the rollout's "
            "tool_message: inline"
        )
    return text[at + len(marker) :]


def tool_answer_ids(tokenizer: Any, observation: str, mode: str, max_tokens: int) -> tuple[list[int], str]:
    """The token ids of a tool's answer (tool_answer_text), the observation cut to `max_tokens` tokens first
    (saying so), and the text they encode. Encoded once, never decoded and encoded again with the model's
    tokens around it."""
    ids = tokenizer.encode(observation, add_special_tokens=False)
    if len(ids) > max_tokens:
        observation = tokenizer.decode(ids[:max_tokens]) + f"\n[cut at {max_tokens} tokens]"
    text = tool_answer_text(tokenizer, observation, mode)
    return tokenizer.encode(text, add_special_tokens=False), text


@dataclass
class Trajectory:
    """One response being built, turn by turn, for one prompt."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    from_tool: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weights version that sampled each token; a tool's tokens carry the version of the turn before."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The trajectory as chat messages (assistant turns and tool answers), for the reward worker and the logs."""
    finish: str = "length"
    """The last turn's finish reason (`stop` or `length`); `length` also when the token budget ended it."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0

    def context(self) -> list[int]:
        """What the model reads before its next turn: the prompt and everything so far."""
        return self.prompt + self.tokens

    def add_turn(
        self, ids: list[int], log_probs: list[float] | None, text: str, finish: str, versions: list[int] | None = None,
    ) -> None:
        """A model turn, its tokens as sampled (and their log-probs under the sampling distribution, and the
        weights version that sampled each)."""
        self.tokens += ids
        self.from_tool += [False] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [self.last_version()] * len(ids)
        self.messages.append({"role": "assistant", "content": text})
        self.finish = finish
        self.turns += 1

    def add_tool(self, ids: list[int], text: str, step: EnvStep) -> None:
        """A tool's answer, as the tokens the model will read (out of the loss)."""
        self.tokens += ids
        self.from_tool += [True] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [self.last_version()] * len(ids)
        self.messages.append({"role": "tool", "content": text})
        self.tool_calls += step.tool_calls
        self.tool_errors += step.tool_errors
        self.tool_s += step.tool_s

    def last_version(self) -> int:
        return self.versions[-1] if self.versions else 0

    def final_answer(self) -> str:
        """The text of the last model turn: what the domain's reward judges."""
        turns = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return turns[-1] if turns else ""


def trajectory_rows(trajectories: list[Trajectory], pad_id: int, with_log_probs: bool) -> dict[str, Any]:
    """Trajectories as one generation output (right-padded rows, as actor_infer returns them): response_ids,
    response_mask (the model's tokens), tool_mask (the tools'), finish_reason, infer_log_probs when asked,
    token_versions, and per trajectory its chat messages (`trajectory`) and its turns, tool_calls, tool_errors and
    tool_s."""
    width = max((len(t.tokens) for t in trajectories), default=0) or 1
    shape = (len(trajectories), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    model_mask, tool_mask, log_probs = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    versions = torch.zeros(shape, dtype=torch.long)
    for row, t in enumerate(trajectories):
        n = len(t.tokens)
        if not n:
            continue
        ids[row, :n] = torch.tensor(t.tokens, dtype=torch.long)
        tool = torch.tensor(t.from_tool, dtype=torch.bool)
        model_mask[row, :n] = (~tool).float()
        tool_mask[row, :n] = tool.float()
        log_probs[row, :n] = torch.tensor(t.log_probs, dtype=torch.float32) * (~tool).float()
        versions[row, :n] = torch.tensor(t.versions, dtype=torch.long)
        versions[row, n:] = t.versions[-1]
    out = {
        "response_ids": ids,
        "response_mask": model_mask,
        "tool_mask": tool_mask,
        "finish_reason": [t.finish for t in trajectories],
        "token_versions": versions,
        "trajectory": [list(t.messages) for t in trajectories],
        **{
            key: torch.tensor([float(getattr(t, key)) for t in trajectories])
            for key in ("turns", "tool_calls", "tool_errors", "tool_s")
        },
    }
    if with_log_probs:
        out["infer_log_probs"] = log_probs
    return out
