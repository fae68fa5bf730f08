"""Multi-turn responses as token ids (schedulers/trajectory.py), and the trainer's log-probs of such a response
against the generator's, token by token (issue 44's exact token accounting)."""

from __future__ import annotations

import pytest
import torch

from roll_core.batch import Batch, loss_mask
from roll_core.config.clusters import GeneratingArgs
from roll_core.data.loading import collate_prompts
from roll_core.environment import EnvStep
from roll_core.models.forward import batched_log_probs
from roll_core.models.sampling import SamplingDistribution
from schedulers.trajectory import Trajectory, plain_tool_message, trajectory_rows
from tests.conftest import EXAMPLES
from tests.test_sampling import strategy  # noqa: F401 (actor_infer's strategy on the embedded model)


def test_a_trajectory_keeps_model_and_tool_tokens_apart():
    t = Trajectory(prompt=[1, 2])
    t.add_turn([10, 11], [-0.5, -0.25], "<python>x</python>", "stop")
    t.add_tool([20, 21, 22], "7", EnvStep(observation="7", tool_calls=1, tool_errors=1, tool_s=0.5))
    t.add_turn([12], [-1.0], "The answer is 7.", "stop")
    assert t.context() == [1, 2, 10, 11, 20, 21, 22, 12]
    assert (t.turns, t.tool_calls, t.tool_errors, t.tool_s) == (2, 1, 1, 0.5)
    assert t.final_answer() == "The answer is 7." and [m["role"] for m in t.messages] == ["assistant", "tool", "assistant"]
    short = Trajectory(prompt=[1])
    short.add_turn([13, 14], None, "out of budget", "length")
    empty = Trajectory(prompt=[1])
    rows = trajectory_rows([t, short, empty], pad_id=0, with_log_probs=True)
    assert rows["response_ids"].tolist() == [[10, 11, 20, 21, 22, 12], [13, 14, 0, 0, 0, 0], [0] * 6]
    assert rows["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0], [0] * 6]
    assert rows["tool_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0] * 6, [0] * 6]
    assert rows["infer_log_probs"].tolist() == [[-0.5, -0.25, 0, 0, 0, -1.0], [0] * 6, [0] * 6]
    assert rows["finish_reason"] == ["stop", "length", "length"] and empty.final_answer() == ""
    assert "infer_log_probs" not in trajectory_rows([t], 0, with_log_probs=False)
    assert trajectory_rows([empty], 5, True)["response_ids"].tolist() == [[5]]
    assert t.log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]  # a tool's tokens have none
    # an empty trajectory before others leaves theirs as they are
    first_empty = trajectory_rows([empty, short, t], pad_id=0, with_log_probs=True)
    assert first_empty["response_ids"].tolist() == [[0] * 6, [13, 14, 0, 0, 0, 0], [10, 11, 20, 21, 22, 12]]
    # a trajectory that ended on a tool's answer (its budget spent) still answers with its last model turn
    cut = Trajectory(prompt=[1])
    cut.add_turn([10], None, "<python>x</python>", "stop")
    cut.add_tool([20], "7", EnvStep("7", tool_calls=1))
    assert cut.final_answer() == "<python>x</python>"


def test_a_trajectory_keeps_the_version_that_sampled_each_token():
    """A sync between two turns (or inside one) gives the later tokens the newer version; a tool's tokens carry the
    version of the turn before them; padding repeats the last one (under no mask)."""
    t = Trajectory(prompt=[1])
    t.add_turn([10, 11], None, "<python>x</python>", "stop", versions=[3, 4])
    t.add_tool([20, 21], "7", EnvStep("7", tool_calls=1))
    t.add_turn([12], None, "7", "stop", versions=[5])
    short = Trajectory(prompt=[1])
    short.add_turn([13, 16, 17], None, "7", "stop", versions=[6, 7, 8])  # three versions: the last one is padded
    unversioned = Trajectory(prompt=[1])
    unversioned.add_turn([14, 15], None, "7", "stop")
    rows = trajectory_rows([t, short, unversioned, Trajectory(prompt=[1])], pad_id=0, with_log_probs=False)
    assert rows["token_versions"].tolist() == [[3, 4, 4, 4, 5], [6, 7, 8, 8, 8], [0] * 5, [0] * 5]


@pytest.mark.parametrize(
    "args",
    [GeneratingArgs(max_new_tokens=8, temperature=1.0), GeneratingArgs(max_new_tokens=8, temperature=0.8, top_k=6)],
    ids=["full", "top_k"],
)
def test_the_trainers_log_probs_of_a_multi_turn_response_equal_the_generators(strategy, args):  # noqa: F811
    """Three turns with two tool answers between them, sampled turn by turn by actor_infer's strategy from the
    growing context (token ids in, token ids out): the trainer's forward over the whole response, with the tools'
    tokens in its sequence (tool_mask), gives each sampled token the log-prob the generator sampled it with, and
    the tools' tokens are out of the loss. Without tool_mask the later turns' log-probs differ: the forward would
    not read the tools' answers."""
    tokenizer = strategy.tokenizer
    chat = [[{"role": "user", "content": text}] for text in ("12+7=", "3+4=", "40+2=")]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chat]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    trajectories = [Trajectory(prompt=list(p)) for p in prompts]
    torch.manual_seed(0)
    for turn in range(3):
        ids, mask = collate_prompts([t.context() for t in trajectories], strategy.pad_id)
        out = strategy.generate(ids, mask, args, 1, with_log_probs=True)
        for row, t in enumerate(trajectories):
            kept = out["response_mask"][row] > 0
            tokens = out["response_ids"][row][kept].tolist()
            t.add_turn(tokens, out["infer_log_probs"][row][kept].tolist(), tokenizer.decode(tokens), out["finish_reason"][row])
            if turn < 2:
                answer = plain_tool_message(f"{row * 7 + turn}")
                t.add_tool(tokenizer.encode(answer, add_special_tokens=False), answer, EnvStep(answer, tool_calls=1))
    rows = trajectory_rows(trajectories, strategy.pad_id, with_log_probs=True)
    prompt_ids, prompt_mask = collate_prompts(prompts, strategy.pad_id)
    batch = Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": rows["response_ids"],
            "response_mask": rows["response_mask"],
            "tool_mask": rows["tool_mask"],
            "in_loss": torch.ones(len(prompts)),
        }
    )
    sampling = SamplingDistribution.of(args)
    trainer = batched_log_probs(strategy.model, batch, 2, sampling)
    model_tokens = rows["response_mask"] > 0
    assert int(rows["tool_mask"].sum()) > 0 and int(model_tokens.sum()) > 3 * len(prompts)
    gap = (trainer - rows["infer_log_probs"]).abs()
    assert float(gap[model_tokens].max()) < 1e-4, float(gap.max())
    assert not trainer[rows["tool_mask"] > 0].any() and not loss_mask(batch)[rows["tool_mask"] > 0].any()
    blind = batched_log_probs(strategy.model, Batch({k: v for k, v in batch.tensors.items() if k != "tool_mask"}), 2,
                              sampling)
    after_a_tool = model_tokens & (rows["tool_mask"].cumsum(1) > 0)
    assert float((blind - rows["infer_log_probs"]).abs()[after_a_tool].max()) > 1e-2


@pytest.mark.parametrize("model", ["tiny-qwen2", "smollm2-135m-instruct"])
def test_a_tool_answer_closes_the_turn_and_opens_the_next_through_the_chat_template(model):
    from transformers import AutoTokenizer

    from schedulers.trajectory import tool_answer_ids, tool_answer_text

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "models" / model)
    text = tool_answer_text(tokenizer, "56088", "template")
    assert text == "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    # the whole conversation renders as the turns and the answer put together
    chat = [{"role": "user", "content": "123 * 456?"}, {"role": "assistant", "content": "<python>print(123 * 456)</python>"}]
    start = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(
        [*chat, {"role": "tool", "content": "56088"}], add_generation_prompt=True, tokenize=False
    )
    assert start + chat[1]["content"] + text == whole
    assert tool_answer_text(tokenizer, "56088", "inline") == "\n<output>\n56088\n</output>\n"
    ids, shown = tool_answer_ids(tokenizer, "x" * 4000, "template", max_tokens=8)
    assert shown.endswith("\n[cut at 8 tokens]<|im_end|>\n<|im_start|>assistant\n")
    frame = tokenizer.encode(tool_answer_text(tokenizer, "\n[cut at 8 tokens]", "template"), add_special_tokens=False)
    assert len(ids) <= 8 + len(frame) + 1  # the first 8 tokens of the output, the note and the template
    assert tokenizer.decode(ids) == shown
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_end  # the template's own token, not its characters


def test_a_template_without_tool_messages_is_an_error_that_says_what_to_do():
    from schedulers.trajectory import tool_answer_text

    class NoTools:
        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages if m["role"] != "tool")

    with pytest.raises(ValueError, match="set the rollout's tool_message: inline"):
        tool_answer_text(NoTools(), "7", "template")


    class ToolsOnly:  # renders the tool's message but not the assistant's turn
        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages if m["role"] == "tool")

    with pytest.raises(ValueError, match="does not render a tool message after an assistant turn"):
        tool_answer_text(ToolsOnly(), "7", "template")

    class Bare:  # a template with nothing before the assistant's turn
        def apply_chat_template(self, messages, **kwargs):
            return "".join(f"{m['content']}|" for m in messages if m["role"] != "user") + "go:"

    assert tool_answer_text(Bare(), "7", "template") == "|7|go:"


def test_an_answer_of_exactly_the_limit_is_not_cut():
    from transformers import AutoTokenizer

    from schedulers.trajectory import tool_answer_ids

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "models" / "tiny-qwen2")
    observation = "12345"
    n = len(tokenizer.encode(observation, add_special_tokens=False))
    assert "[cut" not in tool_answer_ids(tokenizer, observation, "inline", max_tokens=n)[1]
    assert "[cut at" in tool_answer_ids(tokenizer, observation, "inline", max_tokens=n - 1)[1]
