"""The llm_judge reward: verdict parsing, the prompt, the HTTP client's retries and timeouts, the shared
limits, and the scorer under the generic reward worker against a stub judge and against the tiny judge served
by a real `roll serve` process."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import threading
import time

import pytest
import yaml

from roll_pipeline.data.synthetic import TINY_JUDGE_TEMPLATE
from tests.judge_servers import (
    JUDGE_MODEL,
    ROOT,
    HeldReply,
    ServeProcess,
    StubJudge,
    assert_judges_own_verdicts,
)
from workers.rewards.judge.errors import JudgeRejected, JudgeUnreachable, JudgeVerdictUnparseable
from workers.rewards.judge.limits import ConcurrencySlots, RateLimiter, gcra
from workers.rewards.llm_judge import (
    DEFAULT_TEMPLATE,
    MISSING_QUESTION,
    LLMJudgeScorer,
    check_template,
    parse_verdict,
    question_of,
    render_prompt,
)
from workers.rewards.retry import RetryPolicy, is_retried_status
from workers.rewards.worker import RewardWorker

FAST_RETRY = {"backoff_s": 0.01, "backoff_max_s": 0.05}


def _answer(text: str, status: int = 200):
    return lambda number, body: (status, text)


def _scorer(stub: StubJudge, **options) -> LLMJudgeScorer:
    return LLMJudgeScorer(base_url=stub.url, model="stub", **{**FAST_RETRY, **options})


# --- verdicts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Verdict: YES", 1.0),
        ("verdict: no", 0.0),
        ("The response says 12, the reference 12.\n\n**Verdict:** Yes", 1.0),
        ("Verdict - NO.", 0.0),
        ("Verdict: correct", 1.0),
        ("Verdict: YES\nOn second thought the units differ.\nVerdict: NO", 0.0),
        ("[[YES]]", 1.0),
        ("yes", 1.0),
        ("  No.  ", 0.0),
        ("**YES**", 1.0),
        ("The response is wrong. NO", 0.0),
        ("<think>Is it YES? Looks like NO at first.</think>\nVerdict: YES", 1.0),
        ("YES or NO, hard to say", None),
        ("I think the response is fine", None),
        ("there is no doubt it matches", None),
        ("", None),
        ("Verdict: maybe", None),
    ],
)
def test_yes_no_verdicts(reply, expected):
    assert parse_verdict(reply, "yes_no") == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Rating: [[7]]", 0.7),
        ("[[10]]", 1.0),
        ("[[0]]", 0.0),
        ("The answer is close. [[ 8.5 ]]", 0.85),
        ("[[7/10]]", 0.7),
        ("First [[3]], after checking again [[8]]", 0.8),
        ("[[11]]", None),
        ("[[-1]]", None),
        ("I would give it 7", None),
        ("[7]", None),
    ],
)
def test_score_verdicts(reply, expected):
    verdict = parse_verdict(reply, "score")
    assert verdict == pytest.approx(expected) if expected is not None else verdict is None


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"score": 8}', 0.8),
        ('```json\n{"verdict": "yes", "reason": "same number"}\n```', 1.0),
        ('{"correct": false}', 0.0),
        ('{"Score": "6"}', 0.6),
        ('Reasoning first. {"reason": "x"} then {"verdict": "INCORRECT"}', 0.0),
        ('{"score": 12}', None),
        ('{"score": true}', None),
        ('{"reason": "no verdict here"}', None),
        ("no json at all", None),
        ('{"score": 8', None),
    ],
)
def test_json_verdicts(reply, expected):
    verdict = parse_verdict(reply, "json")
    assert verdict == pytest.approx(expected) if expected is not None else verdict is None


def test_score_max_scales_scores():
    assert parse_verdict("[[4]]", "score", score_max=5) == pytest.approx(0.8)
    assert parse_verdict('{"score": 5}', "json", score_max=5) == 1.0
    with pytest.raises(ValueError, match="unknown verdict_format"):
        parse_verdict("Verdict: YES", "stars")


def test_the_verdict_is_read_after_the_judges_thinking_wherever_it_ends():
    # "<think>" and 17 characters put "</think>" at 24: only the text after it, "Yes", is a bare verdict
    assert parse_verdict("<think>" + "a" * 17 + "</think>Yes", "yes_no") == 1.0
    assert parse_verdict("<think>[[YES]]</think>Verdict: NO", "yes_no") == 0.0


def test_a_later_broken_object_does_not_hide_an_earlier_verdict():
    assert parse_verdict('{"score": 7} and then {broken', "json") == pytest.approx(0.7)
    assert parse_verdict('{"score": "high"}', "json") is None  # a score that is not a number is no verdict


@pytest.mark.parametrize("verdict_format", ["yes_no", "score", "json"])
def test_the_verdict_format_as_a_config_file_gives_it(verdict_format):
    """A format read from YAML is a string of its own (not the interned literal)."""
    replies = {"yes_no": "Verdict: YES", "score": "[[10]]", "json": '{"verdict": "yes"}'}
    assert parse_verdict(replies[verdict_format], "".join(list(verdict_format))) == 1.0


def test_the_final_answer_is_what_follows_the_last_think_close():
    from workers.rewards.llm_judge import final_answer_text

    assert final_answer_text("</think> 5") == " 5"  # the close at the very start
    assert final_answer_text("<think>a</think> 5") == " 5"  # at 8
    assert final_answer_text("<think>a</think>b</think> 5") == " 5"
    assert final_answer_text("<think>never closed 5") is None
    assert final_answer_text("plain 5") == "plain 5"


# --- the prompt and the options -----------------------------------------------------------------------------


def test_default_template_fills_every_field():
    prompt = render_prompt(DEFAULT_TEMPLATE, "What is 2 + 2?", "4", "It is {four}.")
    assert "Question: What is 2 + 2?\nReference answer: 4\nResponse: It is {four}.\n" in prompt
    assert MISSING_QUESTION in render_prompt(DEFAULT_TEMPLATE, None, "4", "4")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{question} {answer} {response}", "unknown placeholder"),
        ("{question} {reference}", "must contain {response}"),
        ("{response", "not a valid format string"),
    ],
)
def test_bad_templates_are_refused(template, message):
    with pytest.raises(ValueError, match=message):
        check_template(template)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model": "m"}, "base_url is required"),
        ({"base_url": "127.0.0.1:8000/v1", "model": "m"}, "must start with http"),
        ({"base_url": "http://h/v1"}, "model is required"),
        ({"base_url": "http://h/v1", "model": "m", "verdict_format": "stars"}, "verdict_format"),
        ({"base_url": "http://h/v1", "model": "m", "requests_per_minute": 0}, "requests_per_minute"),
        ({"base_url": "http://h/v1", "model": "m", "api_key": "sk-123"}, "unknown option"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LLMJudgeScorer(**options)


def test_multi_domain_example_uses_the_tiny_judges_template():
    config = yaml.safe_load((ROOT / "examples" / "multi_domain.yaml").read_text())
    assert config["rewards"]["open"]["options"]["template"] == TINY_JUDGE_TEMPLATE
    LLMJudgeScorer(**config["rewards"]["open"]["options"])


def test_gpu_example_loads_and_its_judge_options_are_valid():
    # The GPU example's models come from the hub, so `roll run --dry-run` checks it only on a GPU host; its
    # schema and the judge's options are checked here.
    from roll_core.config import load_config

    resolved = load_config(ROOT / "examples" / "gpu" / "multi_domain_vllm.yaml", [])
    judge = resolved.config.rewards["open"]
    assert judge.worker == "llm_judge" and resolved.config.actor_infer.strategy_args.strategy_name == "vllm"
    scorer = LLMJudgeScorer(**judge.options)
    assert scorer.template == DEFAULT_TEMPLATE and scorer.api_key_env is None


def test_registered_as_llm_judge():
    # In a fresh interpreter: here the module is already imported, which would register the name anyway.
    code = (
        "from workers.rewards.registry import get_reward_scorer_cls; "
        "print(get_reward_scorer_cls('llm_judge').__qualname__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.stdout.strip() == "LLMJudgeScorer", result.stderr


# --- scoring against a stub judge ---------------------------------------------------------------------------


def test_the_question_is_the_prompts_last_user_message():
    """In a run the sample carries the prompt the policy saw; `roll rewards score` gives a `question` field."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the opposite of hot?"},
        {"role": "assistant", "content": "cold"},
        {"role": "user", "content": "And of wet?"},
    ]
    assert question_of({"prompt_messages": messages, "question": "ignored"}) == "And of wet?"
    assert question_of({"prompt_messages": messages[:1], "question": "asked"}) == "asked"
    assert question_of({"question": "asked"}) == "asked"
    assert question_of({"question": "  "}) is None
    assert question_of({"prompt_messages": None}) is None


def test_yes_and_no_become_rewards_and_the_request_carries_the_sample():
    replies = iter(["Verdict: YES", "Verdict: NO"])
    with StubJudge(lambda n, body: (200, next(replies))) as stub:
        scorer = _scorer(stub, system_prompt="You are a strict grader.")
        right = scorer.score("The opposite of hot is cold.", "cold", question="What is the opposite of hot?")
        wrong = scorer.score("warm", "cold", question="What is the opposite of hot?")
    assert (right.score, right.correct) == (1.0, True)
    assert (wrong.score, wrong.correct) == (0.0, False)
    assert right.metrics["judge_verdict"] == 1.0 and right.metrics["judge_attempts"] == 1.0
    body = stub.bodies[0]
    assert body["model"] == "stub" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "You are a strict grader."}
    assert body["messages"][1]["content"] == render_prompt(
        DEFAULT_TEMPLATE, "What is the opposite of hot?", "cold", "The opposite of hot is cold."
    )
    assert "authorization" not in {k.lower() for k in stub.headers[0]}


def test_scores_map_linearly_between_wrong_and_correct_score():
    with StubJudge(_answer("Mostly right. [[7]]")) as stub:
        result = _scorer(
            stub, verdict_format="score", wrong_score=-1.0, correct_score=1.0, correct_threshold=0.8
        ).score("x", "y", question="q")
    assert result.score == pytest.approx(0.4)
    assert result.correct is False


def test_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("ROLL_TEST_JUDGE_KEY", "sk-test-123")
    with StubJudge(_answer("Verdict: YES")) as stub:
        _scorer(stub, api_key_env="ROLL_TEST_JUDGE_KEY").score("a", "a", question="q")
    assert stub.headers[0]["Authorization"] == "Bearer sk-test-123"
    monkeypatch.delenv("ROLL_TEST_JUDGE_KEY")
    with pytest.raises(RuntimeError, match="ROLL_TEST_JUDGE_KEY"):
        LLMJudgeScorer(
            base_url="http://127.0.0.1:1/v1", model="m", api_key_env="ROLL_TEST_JUDGE_KEY"
        ).warm_up()


def test_no_answer_is_wrong_without_asking_and_no_reference_is_not_applicable():
    with StubJudge(_answer("Verdict: YES")) as stub:
        scorer = _scorer(stub)
        unclosed = scorer.score("<think>cold? warm?", "cold", question="q")
        empty = scorer.score("   ", "cold", question="q")
        no_reference = scorer.score("cold", "", question="q")
        after_thinking = scorer.score("<think>maybe warm</think>cold", "cold")
    assert (unclosed.score, unclosed.correct, unclosed.metrics["answer_found"]) == (0.0, False, 0.0)
    assert empty.correct is False
    assert no_reference is None
    assert after_thinking.correct is True and after_thinking.metrics["question_given"] == 0.0
    assert stub.requests == 1
    assert "Response: cold\n" in stub.bodies[0]["messages"][0]["content"]
    assert f"Question: {MISSING_QUESTION}\n" in stub.bodies[0]["messages"][0]["content"]


def test_server_errors_are_retried_until_the_judge_recovers():
    with StubJudge(lambda n, body: (500, "overloaded") if n < 2 else (200, "Verdict: YES")) as stub:
        result = _scorer(stub, max_retries=3).score("cold", "cold", question="q")
    assert result.correct is True
    assert stub.requests == 3
    assert result.metrics["judge_attempts"] == 3.0


@pytest.mark.parametrize("status", [429, 408, 502, 503])
def test_busy_statuses_are_retried(status):
    with StubJudge(lambda n, body: (status, "busy") if n == 0 else (200, "Verdict: NO")) as stub:
        assert _scorer(stub).score("warm", "cold").score == 0.0
    assert stub.requests == 2


def test_a_judge_that_keeps_failing_is_unreachable_after_the_retries():
    with StubJudge(_answer("boom", status=500)) as stub, pytest.raises(JudgeUnreachable, match="3 attempt"):
        _scorer(stub, max_retries=2).score("cold", "cold")
    assert stub.requests == 3


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_client_errors_are_not_retried(status):
    with (
        StubJudge(_answer("bad request", status=status)) as stub,
        pytest.raises(JudgeRejected, match=str(status)),
    ):
        _scorer(stub, max_retries=3).score("cold", "cold")
    assert stub.requests == 1


def test_a_refused_connection_is_unreachable():
    scorer = LLMJudgeScorer(base_url="http://127.0.0.1:9/v1", model="m", max_retries=1, **FAST_RETRY)
    with pytest.raises(JudgeUnreachable, match="connection failed"):
        scorer.score("cold", "cold")


@pytest.mark.parametrize("reply", ["The response looks fine to me.", "YES and NO", ""])
def test_garbage_verdicts_are_unparseable(reply):
    with StubJudge(_answer(reply)) as stub, pytest.raises(JudgeVerdictUnparseable, match="no yes_no verdict"):
        _scorer(stub).score("cold", "cold")
    assert stub.requests == 1


def test_a_slow_judge_times_out_and_each_attempt_is_bounded():
    """A judge that never answers while the client waits: two attempts, each cut at its timeout; the client gave
    up before any reply was sent (an order of events, not a duration)."""
    held = HeldReply()
    with StubJudge(held) as stub:
        try:
            with pytest.raises(JudgeUnreachable, match=r"no reply within 0.3s"):
                _scorer(stub, request_timeout_s=0.3, max_retries=1).score("cold", "cold")
            assert held.answered == 0, "the client waited for the judge's reply"
        finally:
            held.release.set()
    assert stub.requests == 2


def test_total_timeout_stops_the_retries():
    """50 retries allowed, within a total of 0.5 s. Each wait is drawn from the upper half of the 0.2 s backoff
    (0.1 to 0.2 s) and no retry starts whose wait would end past the total, so the waits before attempt k sum to
    at least 0.1 * (k - 1) < 0.5: at most 5 attempts however fast the machine (a slow one makes fewer), never the
    51 the retries alone allow. (A bound of 4 failed in CI: four waits near 0.1 s fit in 0.5 s.)"""
    with StubJudge(_answer("down", status=503)) as stub, pytest.raises(JudgeUnreachable):
        LLMJudgeScorer(
            base_url=stub.url,
            model="stub",
            max_retries=50,
            backoff_s=0.2,
            backoff_max_s=0.2,
            total_timeout_s=0.5,
        ).score("cold", "cold")
    assert 1 <= stub.requests <= 5


def test_retry_policy():
    rng = random.Random(0)
    policy = RetryPolicy(backoff_s=0.5, backoff_max_s=4.0)
    for retry, full in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)]:
        waits = [policy.delay(retry, rng) for _ in range(50)]
        assert all(full / 2 <= w <= full for w in waits), retry
    assert policy.delay(1, rng, retry_after_s=3.0) == 3.0
    assert policy.delay(1, rng, retry_after_s=60.0) == 4.0
    assert [s for s in (400, 401, 403, 404, 408, 422, 429, 500, 503) if is_retried_status(s)] == [
        408,
        429,
        500,
        503,
    ]


# --- limits shared between processes ------------------------------------------------------------------------


def test_gcra_spaces_requests_by_their_cost():
    assert gcra(tat=0.0, now=10.0, cost=1, interval_s=0.5) == (0.0, 10.5)
    assert gcra(tat=10.5, now=10.2, cost=1, interval_s=0.5) == (pytest.approx(0.3), 10.5)
    assert gcra(tat=10.5, now=10.5, cost=3, interval_s=0.5) == (0.0, 12.0)


def test_rate_limiter_holds_both_budgets(tmp_path):
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(
        tmp_path / "rate.json",
        requests_per_minute=60,
        tokens_per_minute=600,
        clock=lambda: now[0],
        sleep=sleep,
    )
    starts = []
    for tokens in (5, 5, 50, 5):
        limiter.acquire(tokens)
        starts.append(now[0])
    # 1 request a second; 10 tokens a second: the 50-token request holds the next one back 5 s.
    assert starts == [100.0, 101.0, 102.0, 107.0]
    limiter.settle_tokens(booked=5, used=25)  # the last request used 20 tokens more than booked: 2 s more
    limiter.acquire(1)
    assert now[0] == pytest.approx(109.5)
    other = RateLimiter(
        tmp_path / "rate.json",
        requests_per_minute=60,
        tokens_per_minute=None,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert other.acquire(1) == pytest.approx(1.0), "a second limiter on the same file shares the budget"


def test_concurrency_slots_admit_at_most_their_size(tmp_path):
    slots = ConcurrencySlots(tmp_path, 3)
    lock, active, peak = threading.Lock(), [0], [0]

    def work() -> None:
        with slots.hold():
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.05)
            with lock:
                active[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 3


# --- under the generic reward worker ------------------------------------------------------------------------


def _samples(n: int, question: str = "What is the opposite of hot?") -> list[dict]:
    return [
        {
            "response": f"cold {i}",
            "ground_truth": "cold",
            "question": question,
            "id": f"s{i}",
            "tag": "opposite",
        }
        for i in range(n)
    ]


@pytest.mark.slow
def test_worker_masks_and_counts_garbage_and_unreachable_and_scores_the_rest(caplog):
    def behaviour(number, body):
        response = body["messages"][-1]["content"].split("Response: ")[1].split("\n")[0]
        if response.endswith("garbage"):
            return 200, "I am not sure what you mean."
        if response.endswith("down"):
            return 503, "down"
        return 200, "Verdict: YES" if response.startswith("cold") else "Verdict: NO"

    samples = [
        {"response": "cold", "ground_truth": "cold", "question": "q", "id": "a"},
        {"response": "warm", "ground_truth": "cold", "question": "q", "id": "b"},
        {"response": "cold garbage", "ground_truth": "cold", "question": "q", "id": "c"},
        {"response": "cold down", "ground_truth": "cold", "question": "q", "id": "d"},
    ]
    with StubJudge(behaviour) as stub, caplog.at_level(logging.WARNING, logger="workers.rewards.worker"):
        options = {"base_url": stub.url, "model": "stub", "max_retries": 1, **FAST_RETRY}
        with RewardWorker("open", "llm_judge", options, timeout_s=20, processes=2) as worker:
            records = worker.score_batch(samples)
            stats = worker.stats()
    assert [r.score for r in records] == [1.0, 0.0, None, None]
    assert [r.mask_reason for r in records] == [None, None, "error", "error"]
    assert stats["scored"] == 2 and stats["masked_error"] == 2
    metrics = worker.domain_metrics(records)
    assert metrics["reward/open/masked"] == 2.0 and metrics["reward/open/correct"] == 0.5
    assert "JudgeVerdictUnparseable" in caplog.text and "JudgeUnreachable" in caplog.text


@pytest.mark.slow
def test_worker_timeout_masks_a_judge_slower_than_the_sample_limit():
    """The judge holds its reply until the batch is back: the sample was cut at the worker's 1 s limit, not the
    client's 30 s request timeout, and masked."""
    held = HeldReply()
    with StubJudge(held) as stub:
        options = {"base_url": stub.url, "model": "stub", "request_timeout_s": 30.0}
        try:
            with RewardWorker("open", "llm_judge", options, timeout_s=1.0, processes=1) as worker:
                records = worker.score_batch(_samples(1))
                assert held.answered == 0, "the worker waited for the judge's reply"
        finally:
            held.release.set()
    assert stub.requests == 1
    assert records[0].masked and records[0].mask_reason == "timeout"


@pytest.mark.slow
def test_concurrency_and_rate_limits_hold_across_scoring_processes():
    """Four scoring processes, one judge. Concurrency: each request is held until two are in flight, then a little
    longer so that a third, if the limit let it through, would be seen; the stub counts the most at once. Rate:
    one request a minute shared by three processes, each sample cut at 5 s: one request goes, the two others wait
    for the budget and time out. Per-process limits would send all three. Counts, not durations."""
    stub: StubJudge

    def held_until_two(number, body):
        deadline = time.monotonic() + 20
        while stub.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        return 200, "Verdict: YES"

    with StubJudge(held_until_two) as stub:
        options = {"base_url": stub.url, "model": "stub", "max_concurrency": 2}
        with RewardWorker("open", "llm_judge", options, timeout_s=60, processes=4) as worker:
            records = worker.score_batch(_samples(10))
    assert all(r.correct for r in records)
    assert stub.requests == 10
    assert stub.max_in_flight == 2

    with StubJudge(_answer("Verdict: YES")) as stub:
        options = {"base_url": stub.url, "model": "stub", "requests_per_minute": 1}
        with RewardWorker("open", "llm_judge", options, timeout_s=5, processes=3) as worker:
            records = worker.score_batch(_samples(3))
    assert stub.requests == 1
    assert sorted(str(r.mask_reason) for r in records) == ["None", "timeout", "timeout"]


# --- against the tiny judge served by `roll serve` ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_judge_server():
    if not (JUDGE_MODEL / "config.json").exists():
        pytest.fail(f"{JUDGE_MODEL} is missing: run `make judge-model` (make test does it) before the tests")
    server = ServeProcess(JUDGE_MODEL, "tiny-judge").start()
    yield server
    server.stop()


def _known_verdicts(n: int) -> tuple[list[dict], list[dict]]:
    """The first ``n`` rows of the judge's validation set, and the reward samples made from them."""
    rows = [json.loads(line) for line in (JUDGE_MODEL.parents[1] / "data" / "judge_val.jsonl").open()][:n]
    samples = [
        {"response": r["response"], "ground_truth": r["reference"], "question": r["question"], "id": r["id"]}
        for r in rows
    ]
    return rows, samples


@pytest.mark.slow
def test_tiny_judge_rewards_for_known_verdicts(tiny_judge_server):
    rows, samples = _known_verdicts(48)
    options = {
        "base_url": tiny_judge_server.url,
        "model": "tiny-judge",
        "max_tokens": 8,
        "template": TINY_JUDGE_TEMPLATE,
    }
    with RewardWorker("open", "llm_judge", options, timeout_s=30, processes=2) as worker:
        records = worker.score_batch(samples)
    assert not any(r.masked for r in records), records
    for record in records:
        assert record.score == (1.0 if record.correct else 0.0)
    assert_judges_own_verdicts(records, rows)


@pytest.mark.slow
def test_judge_killed_mid_step_masks_the_rest_and_scoring_goes_on(tiny_model):
    server = ServeProcess(JUDGE_MODEL, "tiny-judge").start()
    rows, samples = _known_verdicts(40)
    options = {
        "base_url": server.url,
        "model": "tiny-judge",
        "max_tokens": 8,
        "template": TINY_JUDGE_TEMPLATE,
        "max_retries": 1,
        "request_timeout_s": 5.0,
        **FAST_RETRY,
    }
    try:
        with RewardWorker("open", "llm_judge", options, timeout_s=30, processes=2) as worker:
            worker.score_batch(samples[:2])  # the processes are up and the judge answers
            result: dict = {}
            step = threading.Thread(target=lambda: result.update(records=worker.score_batch(samples)))
            step.start()
            deadline = time.monotonic() + 60
            while server.health()["completed"] < 2 + 8 and time.monotonic() < deadline:
                time.sleep(0.02)
            server.kill()
            step.join(60)
            records = result["records"]
            scored = [r for r in records if not r.masked]
            masked = [r for r in records if r.masked]
            assert len(scored) >= 6, "samples judged before the kill keep their rewards"
            assert masked and all(r.mask_reason == "error" for r in masked)
            assert worker.domain_metrics(records)["reward/open/masked_error"] == len(masked)

            # the next step: the judge is still down, so every sample is masked, and nothing raises
            down = worker.score_batch(samples[:4])
            assert all(r.masked for r in down)

            # the judge comes back on the same port: the step after that is scored again
            server = ServeProcess(JUDGE_MODEL, "tiny-judge", port=server.port).start()
            back = worker.score_batch(samples[:4])
            assert not any(r.masked for r in back)
            assert worker.stats()["masked_error"] == len(masked) + 4
    finally:
        server.stop()
