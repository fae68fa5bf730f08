"""The multi-turn rollout (schedulers/multi_turn.py) in the scheduler, without Ray: the fakes of
tests/test_scheduler_steps.py, a scripted policy that calls a tool and answers with what the tool said, and a
calculator environment (a plugin class, by its path); the python tool in the real sandbox at the end."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from roll_core.config import GeneratingArgs
from roll_core.environment import Environment, EnvironmentUnavailable, EnvStep
from roll_core.rewards.scored import ScoredSample
from schedulers.multi_turn import turn_seed
from tests.test_dynamic_sampling import config
from tests.test_scheduler_steps import TOK, Handle, make
from workers.environments.tool_calls import parse_call

N = 4
ARGS = GeneratingArgs(max_new_tokens=64)
CALCULATOR = "tests.test_multi_turn:Calculator"


class Calculator(Environment):
    """Answers `<python>print(A*B)</python>` with the product; `down_for` rows' calls fail as infrastructure."""

    closed = 0

    def __init__(self, *, down_for: str | None = None, **options):
        super().__init__(**options)
        self.down_for = down_for

    def close(self):
        Calculator.closed += 1

    def reset(self, row):
        self.row = row

    def step(self, message):
        call = parse_call(message, "plain")
        if call is None:
            return EnvStep(done=True)
        if self.down_for is not None and self.down_for == self.row["id"]:
            raise EnvironmentUnavailable("the calculator service is down")
        product = re.fullmatch(r"print\((\d+)\*(\d+)\)", call.code.strip())
        if product is None:
            return EnvStep(observation="error: not a product", tool_calls=1, tool_errors=1)
        return EnvStep(observation=f"{int(product[1]) * int(product[2])}", tool_calls=1, tool_s=0.25)


class Policy:
    """actor_infer with a scripted policy: a prompt `mul A B` gets a call `<python>print(A*B)</python>`; a
    context that ends with a tool message gets the tool's answer as the final answer, except for prompts with
    `again` (they call the tool every turn) and `wrong` (they answer 0). Responses stop at the request's stop
    strings and at its max_new_tokens, as the engines do."""

    def __init__(self, log_probs: bool = True) -> None:
        self.log_probs = log_probs
        self.requests: list[tuple[str, int, int | None, int]] = []
        """(request id, prompts, seed, max_new_tokens) per call."""
        self.aborted: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.versions: int | None = None
        """When set: each answer's tokens carry this weights version, and the next call's the next one."""

    def answer(self, context: str) -> str:
        a, b = re.search(r"mul (\d+) (\d+)", context).groups()
        if "direct" in context:  # no tool: the answer at once
            return f"{int(a) * int(b)}" + TOK.eos_token
        tool = context.rsplit("<|im_start|>tool\n", 1)
        if len(tool) == 1 or "again" in context:
            return f"<python>\nprint({a}*{b})\n</python>"
        said = tool[1].split("<|im_end|>")[0].strip()
        return ("0" if "wrong" in context else said) + TOK.eos_token

    async def generate_request(
        self, request_id, prompts, args, n, seed=None, weights_version=None, switch_at=None, wave=None
    ):
        self.requests.append((request_id, len(prompts), seed, args.max_new_tokens))
        await self.gate.wait()
        rows, finish = [], []
        for prompt in prompts:
            text = self.answer(TOK.decode(prompt))
            assert any(text.endswith(s) for s in args.stop) or text.endswith(TOK.eos_token), (text, args.stop)
            ids = TOK.encode(text, add_special_tokens=False)
            for _ in range(n):
                rows.append(ids[: args.max_new_tokens])
                finish.append("length" if len(ids) > args.max_new_tokens else "stop")
        width = max(len(r) for r in rows)
        out = {
            "response_ids": torch.tensor([r + [TOK.pad_token_id] * (width - len(r)) for r in rows]),
            "response_mask": torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows]),
            "finish_reason": finish,
        }
        if self.log_probs:
            out["infer_log_probs"] = -torch.tensor([[0.5] * len(r) + [0.0] * (width - len(r)) for r in rows])
        if self.versions is not None:  # a weight sync after every call: each turn has the next version
            out["token_versions"] = torch.full_like(out["response_ids"], self.versions)
            self.versions += 1
        return out

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        return len(request_ids)


class Judge:
    """A reward worker: the response must be the row's ground truth; keeps every sample it was sent."""

    def __init__(self) -> None:
        self.samples: list[dict] = []

    def score_batch(self, samples):
        self.samples.extend(samples)
        return [
            ScoredSample(score=float(s["response"].strip() == s["ground_truth"]),
                         correct=s["response"].strip() == s["ground_truth"])
            for s in samples
        ]


def rows(*prompts):
    out = []
    for i, prompt in enumerate(prompts):
        a, b = (int(x) for x in re.search(r"mul (\d+) (\d+)", prompt).groups())
        out.append({"id": f"r{i}", "tag": "add", "ground_truth": str(a * b),
                    "messages": [{"role": "user", "content": prompt}]})
    return out


def multi_turn(*overrides, rollout="", options="{}"):
    return config([
        f"rewards.math.rollout={{type: multi_turn, environment: '{CALCULATOR}', environment_options: {options}"
        f"{rollout}}}",
        "rewards.math.group_filters={}", *overrides,
    ])


def run(scheduler, share, args=ARGS, group_size=N):
    return asyncio.run(scheduler.get_batch(share, group_size, args))


def texts_of(batch, row, key):
    return TOK.decode(batch["response_ids"][row][batch[key][row] > 0].tolist())


def test_a_trajectory_calls_the_tool_and_its_final_answer_is_scored_with_the_whole_trajectory():
    policy, judge = Policy(), Judge()
    s = make(multi_turn(), rows("mul 123 456", "mul 7 8 wrong"), Handle(policy).obj, rewards=[judge])
    batch, metrics = run(s, 2)
    assert batch["scores"].tolist() == [1.0] * N + [0.0] * N
    # the model's tokens and the tool's, apart: the call and the answer in response_mask, the template's tool
    # message (closing the call's turn, opening the next) in tool_mask
    assert texts_of(batch, 0, "response_mask") == "<python>\nprint(123*456)\n</python>56088<|im_end|>"
    assert texts_of(batch, 0, "tool_mask") == "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    assert not (batch["response_mask"] * batch["tool_mask"]).any()
    assert (batch["infer_log_probs"][batch["tool_mask"] > 0] == 0).all()
    assert (batch["infer_log_probs"][batch["response_mask"] > 0] == -0.5).all()
    assert batch.meta["response_text"][0] == "56088" and batch.meta["finish_reason"][:2] == ["stop", "stop"]
    # the reward worker saw the final answer and the trajectory
    sample = next(s for s in judge.samples if s["id"] == "r0")
    assert sample["response"] == "56088"
    assert sample["trajectory"] == [
        {"role": "assistant", "content": "<python>\nprint(123*456)\n</python>"},
        {"role": "tool", "content": "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"},
        {"role": "assistant", "content": "56088"},
    ]
    # one request per turn: the prompt's n samples, then each trajectory's context; the turns stop at the call
    first = [r for r in policy.requests if r[0].startswith("math/0/0")]
    assert [(r[0], r[1]) for r in first] == [("math/0/0", 1), ("math/0/0/turn1", N)]
    assert metrics["scheduler/math/prompts_drawn"] == 2
    # what the reports read: each response's turns and tool use, and its trajectory
    assert batch["turns"].tolist() == [2.0] * (2 * N) and batch["tool_calls"].tolist() == [1.0] * (2 * N)
    assert batch["tool_s"].tolist() == [0.25] * (2 * N) and batch.meta["trajectory"][0] == sample["trajectory"]


def test_a_sync_between_two_turns_gives_the_second_turn_the_newer_version():
    policy = Policy()
    policy.versions = 7
    s = make(multi_turn(), rows("mul 123 456"), Handle(policy).obj)
    batch, _ = run(s, 1)
    versions, model, tool = batch["token_versions"], batch["response_mask"] > 0, batch["tool_mask"] > 0
    first_turn = len(TOK.encode("<python>\nprint(123*456)\n</python>", add_special_tokens=False))
    for row in range(N):
        on = (model[row] | tool[row]).nonzero().flatten()
        assert versions[row, on[:first_turn]].eq(7).all()  # the call
        assert versions[row][tool[row]].eq(7).all()  # the tool's answer: the version of the turn before it
        assert versions[row][model[row]][first_turn:].eq(8).all()  # the final answer, after the sync


def test_the_reports_show_tool_use_and_whole_trajectories():
    from roll_pipeline.driver.report import sample_table
    from roll_pipeline.driver.validation import validation_metrics

    s = make(multi_turn(), rows("mul 123 456"), Policy(), rewards=[Judge()])
    batch, _ = run(s, 1)
    from roll_pipeline.driver.records import batch_records

    records = batch_records(batch)
    assert records[0].tool_use == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "tool_s": 0.25}
    metrics = validation_metrics(records)
    assert metrics["val_tool_calls/add/mean"] == 1.0 and metrics["val_turns/all/mean"] == 2.0
    table = sample_table(records, rows_per_tag=1)
    assert table["response"] == ["56088"]
    assert table["trajectory"][0].startswith("[assistant] <python>\nprint(123*456)\n</python>\n[tool] <|im_end|>")
    assert table["trajectory"][0].endswith("\n[assistant] 56088")


def test_turns_end_at_max_turns_and_the_last_turn_is_the_answer_whatever_it_holds():
    policy, judge = Policy(), Judge()
    s = make(multi_turn(rollout=", max_turns: 3"), rows("mul 2 3 again"), policy, rewards=[judge])
    batch, _ = run(s, 1)
    assert [r[0] for r in policy.requests] == ["math/0/0", "math/0/0/turn1", "math/0/0/turn2"]
    assert texts_of(batch, 0, "response_mask") == "<python>\nprint(2*3)\n</python>" * 3
    assert texts_of(batch, 0, "tool_mask").count("<|im_start|>tool\n6<|im_end|>") == 2  # no call answered after the last turn
    assert batch["scores"].tolist() == [0.0] * N  # the last turn, a call, is the final answer
    assert [m["role"] for m in judge.samples[0]["trajectory"]] == ["assistant", "tool"] * 2 + ["assistant"]
    # an even number of turns: still no tool answer after the last one
    policy = Policy()
    s = make(multi_turn(rollout=", max_turns: 2"), rows("mul 2 3 again"), policy, rewards=[Judge()])
    batch, _ = run(s, 1)
    assert len(policy.requests) == 2 and batch["tool_calls"].tolist() == [1.0] * N
    assert batch.meta["trajectory"][0][-1]["role"] == "assistant"


def test_the_token_budget_cuts_a_turn_and_ends_the_trajectory():
    call = len(TOK.encode("<python>\nprint(123*456)\n</python>", add_special_tokens=False))
    answer = len(TOK.encode("<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False))
    args = GeneratingArgs(max_new_tokens=call + 10)
    policy = Policy()
    budget = call + answer + 2
    s = make(multi_turn(rollout=f", max_total_tokens: {budget}"), rows("mul 123 456"), policy, rewards=[Judge()])
    batch, _ = run(s, 1, args=args)
    lengths = (batch["response_mask"] + batch["tool_mask"]).sum(1)
    assert (lengths == budget).all() and batch.meta["finish_reason"] == ["length"] * N
    # the second turn may generate what is left after the call and the tool's answer
    assert [r[3] for r in policy.requests] == [call + 10, 2]
    assert batch.meta["response_text"] == ["56"] * N and batch["scores"].tolist() == [0.0] * N
    # a budget that ends inside the tool's answer: the answer is cut and the trajectory ends there
    s = make(multi_turn(rollout=f", max_total_tokens: {call + 3}"), rows("mul 123 456"), Policy(), rewards=[Judge()])
    policy = Policy()
    s = make(multi_turn(rollout=f", max_total_tokens: {call + 3}"), rows("mul 123 456"), policy, rewards=[Judge()])
    batch, _ = run(s, 1, args=args)
    assert (batch["tool_mask"].sum(1) == 3).all() and batch.meta["finish_reason"] == ["length"] * N
    assert len(policy.requests) == 1 and batch["turns"].tolist() == [1.0] * N  # no turn without room


def test_prompts_of_one_request_keep_their_own_trajectories():
    """Several prompts in one generation request (wave mode): answers of different lengths come back padded, and
    each trajectory takes its own rows, turn after turn, whether it goes on or is done (a prompt answered at once
    beside prompts that call the tool)."""
    policy, judge = Policy(), Judge()
    cfg = multi_turn("dynamic_sampling.request_mode=wave", "actor_infer.infer_batch_size=12")
    s = make(cfg, rows("mul 2 3 direct", "mul 123 456", "mul 9 9"), policy, rewards=[judge])
    batch, _ = run(s, 3, group_size=2)
    assert [r[:2] for r in policy.requests] == [("math/0/0", 3), ("math/0/0/turn1", 4)]
    by_id = {}
    for i, row in enumerate(batch.meta["id"]):
        by_id.setdefault(row, []).append(
            (batch.meta["response_text"][i], batch["turns"][i].item(), texts_of(batch, i, "response_mask"))
        )
    assert by_id == {
        "r0": [("6", 1.0, "6<|im_end|>")] * 2,
        "r1": [("56088", 2.0, "<python>\nprint(123*456)\n</python>56088<|im_end|>")] * 2,
        "r2": [("81", 2.0, "<python>\nprint(9*9)\n</python>81<|im_end|>")] * 2,
    }
    assert batch["scores"].tolist() == [1.0] * 6


def sample(rollout, prompts, n=1, args=ARGS):
    """One generation request of the rollout, for these prompts in this order."""
    rows_ = rows(*prompts)
    ids = [TOK.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in rows_]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    return asyncio.run(rollout.sample(0, "math/0/0", rows_, ids, args, n, None, SimpleStats()))


@pytest.mark.parametrize("log_probs", [True, False])
def test_one_request_cuts_each_trajectory_at_its_own_budget(log_probs):
    """Trajectories of one request with different room left: the turn is asked for the most any has left, and
    each is cut at its own (with its log-probs, where the engine gave them); one that is done does not stop the
    ones after it."""
    call = len(TOK.encode("<python>\nprint(123*456)\n</python>", add_special_tokens=False))
    answer = len(TOK.encode("<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False))
    short_call = len(TOK.encode("<python>\nprint(2*3)\n</python>", add_special_tokens=False))
    s = make(multi_turn(rollout=f", max_total_tokens: {call + answer + 2}"), rows("mul 2 3"),
             Policy(log_probs=log_probs), rewards=[Judge()])
    out = sample(s.rollout, ["mul 9 9 direct", "mul 123 456", "mul 2 3"])
    finals = [t.final_answer() for t in out["trajectories"]]
    assert finals == ["81", "56", "6"]  # 56088 cut at the 2 tokens left; 2*3's call was shorter: room for "6"
    assert [t.finish for t in out["trajectories"]] == ["stop", "length", "stop"]
    assert short_call < call
    assert ("infer_log_probs" in out) == log_probs
    if log_probs:
        lengths = (out["response_mask"] > 0).sum(1)
        assert ((out["infer_log_probs"] != 0).sum(1) == lengths).all()


def test_the_budget_defaults_to_max_new_tokens_per_turn_and_an_exact_fit_is_no_cut():
    call = len(TOK.encode("<python>\nprint(2*3)\n</python>", add_special_tokens=False))
    answer = len(TOK.encode("<|im_end|>\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False))
    policy = Policy()
    # max_total_tokens unset: max_new_tokens (the call's length) times max_turns (4)
    s = make(multi_turn(rollout=", max_turns: 4"), rows("mul 2 3 again"), policy, rewards=[Judge()])
    run(s, 1, args=GeneratingArgs(max_new_tokens=call))
    left = 4 * call - call - answer
    assert [r[3] for r in policy.requests] == [call, call, min(call, left - call - answer)]
    assert len(policy.requests) == 3  # the third answer leaves no room: the trajectory ends at the budget
    # a final answer that fills the budget exactly was not cut: it stopped by itself
    final = len(TOK.encode("6" + TOK.eos_token, add_special_tokens=False))
    s = make(multi_turn(rollout=f", max_total_tokens: {call + answer + final}"), rows("mul 2 3"), Policy(),
             rewards=[Judge()])
    batch, _ = run(s, 1)
    assert batch.meta["finish_reason"] == ["stop"] * N and batch["scores"].tolist() == [1.0] * N
    # a tool answer that fills what is left exactly ends the trajectory: no room for a turn
    policy = Policy()
    s = make(multi_turn(rollout=f", max_total_tokens: {call + answer}"), rows("mul 2 3"), policy, rewards=[Judge()])
    batch, _ = run(s, 1)
    assert len(policy.requests) == 1 and batch.meta["finish_reason"] == ["length"] * N
    assert (batch["tool_mask"].sum(1) == answer).all()


def test_without_log_probs_from_the_engine_the_turns_still_add_up():
    policy = Policy(log_probs=False)
    call = len(TOK.encode("<python>\nprint(123*456)\n</python>", add_special_tokens=False))
    s = make(multi_turn(rollout=f", max_total_tokens: {call - 3}"), rows("mul 123 456"), policy, rewards=[Judge()])
    batch, _ = run(s, 1)
    assert "infer_log_probs" not in batch.tensors and (batch["response_mask"].sum(1) == call - 3).all()


def test_a_turn_cut_by_max_new_tokens_ends_its_trajectory_whatever_the_environment_says():
    policy = Policy()
    echo = "rewards.math.rollout={type: multi_turn, environment: 'tests.test_multi_turn:Echo', max_turns: 3}"
    s = make(multi_turn(echo), rows("mul 123 456"), policy, rewards=[Judge()])
    batch, _ = run(s, 1, args=GeneratingArgs(max_new_tokens=5))
    assert len(policy.requests) == 1 and batch.meta["finish_reason"] == ["length"] * N
    assert batch["tool_calls"].tolist() == [0.0] * N


def test_every_environment_is_closed_and_the_kind_says_it_needs_one(tmp_path):
    from roll_core.registry import ROLLOUTS
    from roll_pipeline.driver.names import load_run_config
    from tests.conftest import EXAMPLES

    Calculator.closed = 0
    run(make(multi_turn(), rows("mul 2 3", "mul 4 5"), Policy(), rewards=[Judge()]), 2)
    assert Calculator.closed == 2 * N
    assert ROLLOUTS.traits("multi_turn") == {"environment": True} and ROLLOUTS.traits("single_turn") == {}
    with pytest.raises(ValueError, match="rewards.math.rollout.environment: unknown environment 'calculator'"):
        load_run_config(EXAMPLES / "math_code.yaml", ["rewards.math.rollout={type: multi_turn, environment: calculator}"])


def test_an_environment_failure_masks_its_trajectories_only():
    s = make(multi_turn(options="{down_for: r1}"), rows("mul 2 3", "mul 4 5"), Policy(), rewards=[Judge()])
    batch, metrics = run(s, 2)
    assert batch.meta["mask_reason"] == [None] * N + ["error"] * N
    assert batch["in_loss"].tolist() == [1.0] * N + [0.0] * N and batch["scores"].tolist()[:N] == [1.0] * N


def test_identical_answers_with_different_trajectories_are_scored_apart():
    judge = Judge()
    s = make(multi_turn(), rows("mul 2 3"), Policy(), rewards=[judge])
    results = asyncio.run(s.rewards.score(
        [{**s.rows[0], "trajectory": [{"role": "tool", "content": t}]} for t in ("a", "b", "a")],
        ["6", "6", "6"], SimpleStats(),
    ))
    assert len(judge.samples) == 2 and [r.correct for r in results] == [True] * 3


class SimpleStats:
    scored_unique = scored_total = reward_failures = 0


def test_deterministic_turns_have_seeds_of_their_own():
    policy = Policy()
    s = make(multi_turn("deterministic=true"), rows("mul 2 3"), policy, rewards=[Judge()])
    run(s, 1)
    (first, second) = policy.requests
    assert first[2] is not None and second[2] == turn_seed(first[2], 1) != first[2]
    assert turn_seed(None, 1) is None and turn_seed(5, 0) == 5
    # fixed values: a resumed deterministic run must draw the same turns, whatever the code's version
    assert [turn_seed(12345, 1), turn_seed(12345, 2), turn_seed(7, 1)] == [1503201087, 3230684805, 2872319949]


def test_validation_is_multi_turn_too():
    policy, judge = Policy(), Judge()
    val = rows("mul 12 12", "mul 3 3 wrong")
    s = make(multi_turn(), rows("mul 2 3"), policy, rewards=[judge], val_rows=val)
    batch = asyncio.run(s.validate(GeneratingArgs(max_new_tokens=64, do_sample=False), 0, 2))
    assert batch["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch["tool_mask"].sum(1).gt(0).all() and "infer_log_probs" not in batch.tensors
    assert {r[0] for r in policy.requests} == {"math/val0/0", "math/val0/0/turn1"}


def test_an_abort_reaches_the_turn_that_is_generating():
    async def scenario():
        policy = Policy()
        s = make(multi_turn(), rows("mul 2 3"), policy, rewards=[Judge()])
        request = s.rollout.request(0, [(0, 0)])
        task = asyncio.ensure_future(s.rollout.generate(request, ARGS, 2, SimpleStats()))
        while len(policy.requests) < 1:
            await asyncio.sleep(0)
        policy.gate.clear()
        while len(policy.requests) < 2:
            await asyncio.sleep(0)
        await s.rollout.abort([request])
        task.cancel()
        return policy.aborted

    assert asyncio.run(scenario()) == ["math/0/0/turn1"]


@pytest.mark.slow
def test_the_python_tool_answers_in_the_sandbox_inside_a_rollout():
    """The built-in environment in a rollout: the policy's call runs in the real code sandbox."""
    from workers.environments.python_tool import PythonToolEnvironment
    from workers.rewards.sandbox.layers import IsolationUnavailable

    try:
        PythonToolEnvironment().runner()
    except IsolationUnavailable as err:
        pytest.skip(f"this host cannot isolate the sandbox: {err}")
    cfg = config([
        "rewards.math.rollout={type: multi_turn, environment: python, environment_options: {timeout_s: 5}}",
        "rewards.math.group_filters={}",
    ])
    judge = Judge()
    s = make(cfg, rows("mul 123 456"), Policy(), rewards=[judge])
    batch, _ = run(s, 1, group_size=2)
    PythonToolEnvironment.close_runners()
    assert batch["scores"].tolist() == [1.0, 1.0]
    assert judge.samples[0]["trajectory"][1]["content"] == (
        "<|im_end|>\n<|im_start|>tool\n56088\n<|im_end|>\n<|im_start|>assistant\n"
    )


class Echo(Environment):
    """Answers every model turn with `ok` (whatever it says) for `calls` turns, then takes the next as the final
    answer: real engines then produce trajectories with tool tokens although the tiny model never calls a tool."""

    def __init__(self, *, calls: int = 2, **options):
        super().__init__(**options)
        self.calls = calls

    def reset(self, row):
        self.made = 0

    def step(self, message):
        if self.made >= self.calls:
            return EnvStep(done=True)
        self.made += 1
        return EnvStep(observation="ok", tool_calls=1)


#: GAE: the tiny model's groups may all score alike, and a critic's values give advantages anyway (so an update
#: that moves the policy; the critic reads the tools' tokens too); uniform groups stay in the loss.
GAE_WHATEVER_THE_SCORES = [
    "adv_estimator=gae",
    "rewards.math.group_filters={}",
    "critic={training_args: {per_device_train_batch_size: 8, gradient_accumulation_steps: 2, learning_rate: 1e-3}}",
]
