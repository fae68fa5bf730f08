"""The per-domain scheduler actor on a real local Ray cluster: exact filter counts with scripted responses and a
rule reward, the redraw bound, aborts, data order, and the overlap of generation with reward."""

from __future__ import annotations

import os
import time
import zlib

import pytest
import ray
import torch
from transformers import AutoTokenizer

from roll_core.config import GeneratingArgs, load_config
from roll_core.data.loading import encode_prompts
from roll_core.rewards.scorer import RewardResult, RewardScorer
from roll_pipeline.distributed.cluster import Cluster
from schedulers.draws import PromptSampler, request_seed
from schedulers.dynamic_sampling import start_scheduler
from schedulers.step import SamplingBoundError
from tests.conftest import EXAMPLES, TINY_MODEL
from workers.rewards.worker import RewardWorker

N = 4
#: Scripted responses per prompt pattern; math_rule with ground truth "1" scores "1" as 1 and "0" as 0.
PATTERNS = {
    "same1": ["1", "1", "1", "1"],  # all equal: std_filter drops it
    "same0": ["0", "0", "0", "0"],  # all equal: std_filter drops it
    "half": ["1", "0", "1", "0"],  # mean 0.5: kept
    "low": ["1", "0", "0", "0"],  # mean 0.25: mean_filter(low=0.3) drops it
    "cut": ["1", "0", "1", "0"],  # the first two are truncated: the truncated response filter masks them
}


class ScriptedInfer:
    """Stands in for actor_infer: answers a prompt by the pattern word in it, and records every request and
    abort (the scheduler's logic is under test here, not generation). The k-th request of a step takes
    `delay_s * (1 + k % 8)`, so requests sent together finish one after another."""

    def __init__(self, delay_s: float = 0.0, reverse: bool = False, hold_from: int | None = None) -> None:
        self.tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
        self.reset(delay_s, reverse, hold_from)

    def reset(self, delay_s: float = 0.0, reverse: bool = False, hold_from: int | None = None) -> None:
        """Start over, as a new stand-in would: the module's tests share one (`scripted`), each from its reset."""
        self.delay_s = delay_s
        self.reverse = reverse
        """Make the k-th request take `delay_s * (8 - k % 8)`: the later drawn, the sooner done."""
        self.hold_from = hold_from
        """Requests k >= hold_from answer only when aborted (60 s at most): in flight whatever the timing."""
        self.seeds: dict[str, int | None] = {}
        self.requests: list[str] = []
        self.aborted: list[str] = []

    def generate_request(
        self, request_id, prompts, args, n, seed=None, weights_version=None, switch_at=None, wave=None
    ):
        self.requests.append(request_id)
        self.seeds[request_id] = seed
        k = int(request_id.rsplit("/", 1)[1])
        delay = self.delay_s * ((8 - k % 8) if self.reverse else (1 + k % 8))
        if self.hold_from is not None and k >= self.hold_from:
            delay = 60.0
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            if request_id in self.aborted:
                return None
            time.sleep(0.005)
        rows, finish = [], []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            pattern = next(p for p in PATTERNS if p in text)
            for j, answer in enumerate(PATTERNS[pattern][:n]):
                rows.append(self.tok.encode(answer, add_special_tokens=False) + [self.tok.eos_token_id])
                finish.append("length" if pattern == "cut" and j < 2 else "stop")
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
        return {"response_ids": ids, "response_mask": mask, "finish_reason": finish}

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        return len(request_ids)

    def log(self):
        return self.requests, self.aborted

    def seeds_sent(self):
        return dict(self.seeds)


class SleepyScorer(RewardScorer):
    """Takes `sleep_s` per sample, then scores like math_rule would on "1"."""

    def __init__(self, sleep_s: float = 0.0, **options):
        super().__init__(**options)
        self.sleep_s = sleep_s

    def score(self, response, ground_truth, **fields):
        time.sleep(self.sleep_s)
        return RewardResult(score=float(response.strip().endswith("1")), correct=response.strip().endswith("1"))



def config(overrides=(), group_filters="{}", response_filters="{}"):
    """math_code.yaml with one request per prompt (the scheduling logic most tests follow request by request;
    later overrides win, so a test can ask for waves)."""
    return load_config(
        EXAMPLES / "math_code.yaml",
        [
            "dynamic_sampling.request_mode=prompt",
            f"num_return_sequences_in_group={N}",
            "actor_train.training_args.gradient_accumulation_steps=1",
            f"rewards.math.group_filters={group_filters}",
            f"rewards.math.response_filters={response_filters}",
            *overrides,
        ],
    ).config


def rows_of(patterns):
    return [
        {"id": f"r{i}", "tag": "add", "ground_truth": "1", "test_cases": "",
         "messages": [{"role": "user", "content": f"{p} {i}"}]}
        for i, p in enumerate(patterns)
    ]


def reward_cluster(reward_spec="math_rule", reward_options=None) -> Cluster:
    return Cluster(
        "reward_math", RewardWorker, world_size=1, num_cpus=0, num_gpus=0, pass_rank=False,
        worker_kwargs={"domain": "math", "worker_spec": reward_spec, "options": reward_options or {},
                       "timeout_s": 30.0, "processes": 1},
    )


#: What the module's tests share, started once on the shared Ray cluster (each stand-in imports torch and
#: transformers: about 5 s of CPU apiece, for each of the 13 schedulers these tests start): the scripted actor_infer
#: (reset by `scripted` before each use) and the math_rule reward cluster, which keeps no state between batches.
_stand_ins: dict = {}


@pytest.fixture(scope="module", autouse=True)
def shared_stand_ins(request):
    """Stops the shared stand-ins after the module. It takes the shared Ray cluster (so that it stops them before
    `local_ray` ends) only where a test of the module that runs needs Ray: the fast tests alone (`make
    test-fast`, a mutation run's "not slow") start no Ray cluster."""
    if any("local_ray" in item.fixturenames for item in request.session.items
           if getattr(item, "module", None) is request.module):
        request.getfixturevalue("local_ray")
    yield
    for handle in _stand_ins.pop("infer", []):
        ray.kill(handle)
    if "reward" in _stand_ins:
        _stand_ins.pop("reward").shutdown()


def scheduler(cfg, rows, infer, reward_spec="math_rule", reward_options=None, val_rows=()):
    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    if reward_spec == "math_rule" and not reward_options:
        if "reward" not in _stand_ins:
            _stand_ins["reward"] = reward_cluster()
        reward = _stand_ins["reward"]
    else:
        reward = reward_cluster(reward_spec, reward_options)
    actor = start_scheduler(
        "math",
        rows=rows,
        prompt_ids=encode_prompts(tok, rows, cfg.data),
        val_rows=list(val_rows),
        val_prompt_ids=encode_prompts(tok, list(val_rows), cfg.data),
        pipeline_config=cfg,
        infer_workers=infer,
        reward_workers=reward.workers,
    )
    return actor, reward


def scripted(delay_s=0.0, reverse=False, hold_from=None):
    """The module's ScriptedInfer, reset for a new scheduler (one is started on first use)."""
    if "infer" not in _stand_ins:
        _stand_ins["infer"] = [ray.remote(ScriptedInfer).options(num_cpus=0, max_concurrency=64).remote()]
    ray.get(_stand_ins["infer"][0].reset.remote(delay_s, reverse, hold_from))
    return _stand_ins["infer"]


def draw_order(cfg, n_rows, k):
    return PromptSampler(n_rows, seed=cfg.seed + zlib.crc32(b"math")).take(k)


ARGS = GeneratingArgs(max_new_tokens=4)


def filtered_in_order(patterns, order, share):
    """What std_filter and mean_filter(low=0.3) do to PATTERNS' rows taken in `order` until `share` pass: the rows
    kept, and the count each filter dropped."""
    kept, dropped = [], {"std_filter": 0, "mean_filter": 0}
    for i in order:
        if patterns[i] in ("same1", "same0"):
            dropped["std_filter"] += 1
        elif patterns[i] == "low":
            dropped["mean_filter"] += 1
        else:
            kept.append(i)
        if len(kept) == share:
            break
    return kept, dropped


@pytest.mark.slow
def test_filter_counts_and_batch_composition_are_exact(local_ray):
    patterns = ["same1", "same0", "half", "low", "cut"] * 4
    cfg = config(
        ["dynamic_sampling.max_running_requests=1"],
        group_filters="{std_filter: {}, mean_filter: {low: 0.3, high: 1.0}}",
        response_filters="{truncated: {}}",
    )
    rows = rows_of(patterns)
    actor, _ = scheduler(cfg, rows, scripted())
    share = 5
    batch, m = ray.get(actor.get_batch.remote(share, N, ARGS))

    # One prompt in flight at a time, so the scheduler resolves prompts exactly in its seeded draw order.
    kept, dropped = filtered_in_order(patterns, draw_order(cfg, len(rows), 40), share)
    resolved = len(kept) + sum(dropped.values())
    # Prompts drawn while the last group was being scored are aborted or, if they finished, surplus.
    extra = m["scheduler/math/aborted"] + m["scheduler/math/surplus"]
    assert m["scheduler/math/prompts_drawn"] == resolved + extra
    assert extra <= 1
    assert m["scheduler/math/groups_kept"] == share
    assert m["scheduler/math/dropped_std_filter"] == dropped["std_filter"]
    assert m["scheduler/math/dropped_mean_filter"] == dropped["mean_filter"]
    assert m["scheduler/math/dropped_response_filters"] == 0
    assert m["scheduler/math/bound_hit"] == 0
    assert m["scheduler/math/peak_in_flight"] == 1

    # The batch: the kept groups in draw order, N responses each; truncated responses left out of the loss.
    assert len(batch) == share * N
    assert batch.meta["id"][::N] == [f"r{i}" for i in kept]
    expected_scores = [float(a == "1") for i in kept for a in PATTERNS[patterns[i]]]
    assert batch["scores"].tolist() == expected_scores
    expected_mask = [0.0 if patterns[i] == "cut" and j < 2 else 1.0 for i in kept for j in range(N)]
    assert batch["in_loss"].tolist() == expected_mask
    assert m["scheduler/math/responses_masked_by_filters"] == expected_mask.count(0.0)

    # The next step continues the same seeded order where this one stopped.
    _, m2 = ray.get(actor.get_batch.remote(1, N, ARGS))
    state = ray.get(actor.state_dict.remote())
    assert state["sampler"]["position"] == m["scheduler/math/prompts_drawn"] + m2["scheduler/math/prompts_drawn"]


@pytest.mark.slow
def test_no_filters_means_exactly_the_share_is_drawn(local_ray):
    cfg = config()
    actor, _ = scheduler(cfg, rows_of(["same1", "half"] * 5), scripted())
    batch, m = ray.get(actor.get_batch.remote(6, N, ARGS))
    assert len(batch) == 6 * N
    assert m["scheduler/math/prompts_drawn"] == 6 and m["scheduler/math/groups_dropped"] == 0
    assert m["scheduler/math/redraws"] == 0


@pytest.mark.slow
def test_a_wave_goes_out_as_requests_of_one_batch_each(local_ray):
    """request_mode wave: the 6 prompts drawn together go as 3 requests of 2 prompts (infer_batch_size 8 = 2
    groups of 4), and each request's rows are split back to their own prompts (each group's scores follow its
    own row's pattern, in draw order)."""
    patterns = ["same1", "half", "same0", "low", "half", "same0"] * 3
    cfg = config(
        [
            "dynamic_sampling.request_mode=wave",
            "dynamic_sampling.max_running_requests=6",
            "actor_infer.infer_batch_size=8",
        ]
    )
    infer = scripted()
    actor, _ = scheduler(cfg, rows_of(patterns), infer)
    batch, m = ray.get(actor.get_batch.remote(6, N, ARGS))
    requests, aborted = ray.get(infer[0].log.remote())
    assert sorted(requests) == ["math/0/0", "math/0/2", "math/0/4"] and aborted == []
    assert m["scheduler/math/prompts_drawn"] == 6 and m["scheduler/math/peak_in_flight"] == 6
    order = draw_order(cfg, len(patterns), 6)
    assert batch.meta["id"][::N] == [f"r{i}" for i in order]
    assert batch["scores"].tolist() == [float(a == "1") for i in order for a in PATTERNS[patterns[i]]]


@pytest.mark.slow
def test_waves_with_filters_redraw_until_the_share_is_full(local_ray):
    """Waves and the group filters: dropped groups are redrawn in later waves, every drawn prompt ends kept,
    dropped, aborted or surplus, and the batch holds only passing groups, each with its own row's scores."""
    patterns = ["same1", "half", "same0"] * 8
    cfg = config(
        ["dynamic_sampling.request_mode=wave", "dynamic_sampling.max_running_requests=6",
         "actor_infer.infer_batch_size=8"],
        group_filters="{std_filter: {}}",
    )
    infer = scripted(delay_s=0.01)
    actor, _ = scheduler(cfg, rows_of(patterns), infer)
    batch, m = ray.get(actor.get_batch.remote(3, N, ARGS))
    drawn = m["scheduler/math/prompts_drawn"]
    assert m["scheduler/math/groups_kept"] == 3 and m["scheduler/math/bound_hit"] == 0
    assert drawn == (
        3 + m["scheduler/math/groups_dropped"] + m["scheduler/math/aborted"] + m["scheduler/math/surplus"]
    )
    assert drawn > 3  # two thirds of the rows fail the filter: the first wave cannot fill the share
    ids = [int(i[1:]) for i in batch.meta["id"][::N]]
    assert all(patterns[i] == "half" for i in ids)
    assert batch["scores"].tolist() == [1.0, 0.0, 1.0, 0.0] * 3
    assert batch["in_loss"].sum() == 3 * N


@pytest.mark.slow
def test_redraw_bound_trains_on_what_passed(local_ray):
    # the domain's own bound overrides the global one
    cfg = config(["dynamic_sampling.max_prompts_factor=4", "rewards.math.max_prompts_factor=2.5"],
                 group_filters="{std_filter: {}}")
    patterns = ["same1"] * 9 + ["half"]
    actor, _ = scheduler(cfg, rows_of(patterns), scripted())
    batch, m = ray.get(actor.get_batch.remote(4, N, ARGS))
    assert m["scheduler/math/bound"] == 10 and m["scheduler/math/prompts_drawn"] == 10
    assert m["scheduler/math/bound_hit"] == 1
    assert m["scheduler/math/groups_kept"] == 1 and m["scheduler/math/dropped_std_filter"] == 9
    # The batch keeps its shape: the one group that passed, then dropped groups left out of the loss.
    assert len(batch) == 4 * N
    assert batch["in_loss"].tolist() == [1.0] * N + [0.0] * (3 * N)
    assert batch.meta["id"][0].startswith("r9")


@pytest.mark.slow
def test_redraw_bound_can_stop_the_run(local_ray):
    cfg = config(["dynamic_sampling.max_prompts_factor=2", "dynamic_sampling.on_bound=error"],
                 group_filters="{std_filter: {}}")
    actor, _ = scheduler(cfg, rows_of(["same0"] * 6), scripted())
    with pytest.raises(SamplingBoundError, match=r"domain 'math': only 0 of 3 groups passed the filters \['std_filter'\]"):
        ray.get(actor.get_batch.remote(3, N, ARGS))


@pytest.mark.slow
def test_in_flight_requests_are_aborted_when_the_batch_is_full(local_ray):
    cfg = config(["dynamic_sampling.max_running_requests=6", "dynamic_sampling.max_prompts_factor=4"],
                 group_filters="{std_filter: {}}")
    infer = scripted(hold_from=2)
    actor, _ = scheduler(cfg, rows_of(["half"] * 20), infer)
    # A low pass-rate estimate (as after many drops) makes the scheduler keep 6 prompts in flight for a share of 2;
    # requests 0 and 1 answer at once and 2.. answer only when aborted, so 2..5 are still running, whatever the
    # machine's speed.
    state = ray.get(actor.state_dict.remote())
    ray.get(actor.load_state_dict.remote({**state, "pass_rate": 0.2}))
    batch, m = ray.get(actor.get_batch.remote(2, N, ARGS))
    requests, aborted = ray.get(infer[0].log.remote())
    drawn = int(m["scheduler/math/prompts_drawn"])
    assert m["scheduler/math/peak_in_flight"] == 6
    # Every drawn prompt is in the batch, aborted, or surplus; requests 2..5 at least were still generating.
    assert m["scheduler/math/aborted"] + m["scheduler/math/surplus"] == drawn - 2
    assert {f"math/0/{k}" for k in range(2, 6)} <= set(aborted)
    assert not {"math/0/0", "math/0/1"} & set(aborted)
    assert sorted(requests, key=lambda r: int(r.rsplit("/", 1)[1])) == [f"math/0/{k}" for k in range(drawn)]
    assert len(batch) == 2 * N and batch["in_loss"].sum() == 2 * N
    # Nothing of the aborted requests leaks into the next step: its groups come from its own requests.
    batch2, m2 = ray.get(actor.get_batch.remote(2, N, ARGS))
    assert m2["scheduler/math/groups_kept"] == 2 and len(batch2) == 2 * N


class GatedInfer(ScriptedInfer):
    """ScriptedInfer whose requests after the first hold their answer until a reward has been computed (the
    scorer writes `gate`): generation can only go on if scoring started while generation was still under way.
    `waited_out` lists the requests that gave up waiting (at `limit_s`, a bound on a hang, not a measure)."""

    def __init__(self, gate: str, limit_s: float = 60.0) -> None:
        super().__init__()
        self.gate, self.limit_s = gate, limit_s
        self.waited_out: list[str] = []

    def generate_request(
        self, request_id, prompts, args, n, seed=None, weights_version=None, switch_at=None, wave=None
    ):
        if not request_id.endswith("/0"):
            deadline = time.monotonic() + self.limit_s
            while not os.path.exists(self.gate):
                if time.monotonic() > deadline:
                    self.waited_out.append(request_id)
                    break
                time.sleep(0.01)
        return super().generate_request(request_id, prompts, args, n, seed, weights_version, switch_at)

    def gave_up(self):
        return list(self.waited_out)


class GateScorer(RewardScorer):
    """Scores like math_rule on "1", after marking (the file `gate`) that a reward was computed."""

    def __init__(self, gate: str, **options):
        super().__init__(**options)
        self.gate = gate

    def score(self, response, ground_truth, **fields):
        open(self.gate, "a").close()  # noqa: SIM115
        return RewardResult(score=float(response.strip().endswith("1")), correct=response.strip().endswith("1"))


@pytest.mark.slow
def test_generation_and_reward_overlap(local_ray, tmp_path):
    """Scoring starts while generation is still under way: four requests go out at once, and the three after the
    first answer only once a reward has been computed. A scheduler that scored only after all generation would
    leave them waiting. Events, not durations."""
    cfg = config(["dynamic_sampling.max_running_requests=4"])
    gate = str(tmp_path / "a_reward_was_computed")
    infer = [ray.remote(GatedInfer).options(num_cpus=0, max_concurrency=64).remote(gate)]
    spec = "tests.test_dynamic_sampling:GateScorer"
    actor, _ = scheduler(cfg, rows_of(["half"] * 8), infer, spec, {"gate": gate})
    batch, metrics = ray.get(actor.get_batch.remote(4, N, ARGS))
    assert len(batch) == 4 * N
    requests, _ = ray.get(infer[0].log.remote())
    assert len(requests) >= 4
    assert ray.get(infer[0].gave_up.remote()) == [], "generation waited for a reward that never came"


@pytest.mark.slow
def test_validation_goes_through_the_same_requests_without_filters(local_ray):
    cfg = config(group_filters="{std_filter: {}}")
    val = rows_of(["same1", "same0", "half"] * 7)
    actor, _ = scheduler(cfg, rows_of(["half"] * 3), scripted(), val_rows=val)
    batch = ray.get(actor.validate.remote(GeneratingArgs(do_sample=False, max_new_tokens=4), 0))
    assert len(batch) == len(val)  # one response per prompt, none filtered
    assert batch.meta["id"] == [r["id"] for r in val]
    assert batch["scores"].tolist() == [float(PATTERNS[p][0] == "1") for p in ["same1", "same0", "half"] * 7]


@pytest.mark.slow
def test_validation_with_k_samples_groups_them_by_prompt(local_ray):
    cfg = config()
    val = rows_of(["half", "low", "same0"] * 3)
    actor, _ = scheduler(cfg, rows_of(["half"] * 3), scripted(), val_rows=val)
    batch = ray.get(actor.validate.remote(GeneratingArgs(max_new_tokens=4), 5, N))
    assert len(batch) == 5 * N
    assert batch.meta["id"] == [r["id"] for r in val[:5] for _ in range(N)]
    patterns = ["half", "low", "same0"] * 3
    assert batch["scores"].tolist() == [float(a == "1") for p in patterns[:5] for a in PATTERNS[p]]


@pytest.mark.slow
def test_identical_responses_to_a_prompt_are_scored_once(local_ray):
    cfg = config()
    actor, _ = scheduler(cfg, rows_of(["same1", "half"] * 4), scripted())
    batch, m = ray.get(actor.get_batch.remote(8, N, ARGS))
    # "same1" groups send 1 distinct response of 4, "half" groups 2 of 4: 12 of 32 samples reach the worker
    assert m["scheduler/math/scored_unique_frac"] == 12 / 32
    patterns = [PATTERNS[["same1", "half"][int(rid[1:]) % 2]] for rid in batch.meta["id"][::N]]
    assert batch["scores"].tolist() == [float(a == "1") for answers in patterns for a in answers]


@pytest.mark.slow
def test_deterministic_mode_fills_the_share_in_draw_order_whatever_the_timing(local_ray):
    """Later draws finish first here; deterministic mode still resolves every drawn prompt, aborts nothing, and
    keeps the first passing groups in draw order, with a seed per request that depends only on (seed, domain,
    call, draw). Two schedulers with opposite timings give the same batches."""
    patterns = ["same1", "half", "same0", "half", "low", "half"] * 4
    cfg = config(
        ["deterministic=true", "dynamic_sampling.max_running_requests=8"],
        group_filters="{std_filter: {}, mean_filter: {low: 0.3, high: 1.0}}",
    )
    rows = rows_of(patterns)
    results = []
    for reverse in (False, True):
        infer = scripted(delay_s=0.02, reverse=reverse)
        actor, _ = scheduler(cfg, rows, infer)
        steps = [ray.get(actor.get_batch.remote(3, N, ARGS)) for _ in range(2)]
        requests, aborted = ray.get(infer[0].log.remote())
        assert aborted == []
        seeds = ray.get(infer[0].seeds_sent.remote())
        assert all(isinstance(seeds[r], int) for r in requests)
        assert seeds["math/0/0"] == request_seed(cfg.seed, "math", 0, 0) != seeds["math/1/0"]
        results.append((steps, seeds, ray.get(actor.state_dict.remote())))

    for (batch, m), (batch2, m2) in zip(results[0][0], results[1][0], strict=True):
        assert batch.meta["id"] == batch2.meta["id"]
        assert m["scheduler/math/aborted"] == 0 == m2["scheduler/math/aborted"]
        counts = ["prompts_drawn", "groups_kept", "dropped_std_filter", "dropped_mean_filter", "surplus"]
        assert [m[f"scheduler/math/{c}"] for c in counts] == [m2[f"scheduler/math/{c}"] for c in counts]
    assert results[0][1] == results[1][1]
    assert results[0][2] == results[1][2]

    # The first step's batch: the first three passing prompts in draw order.
    order = draw_order(cfg, len(rows), int(results[0][0][0][1]["scheduler/math/prompts_drawn"]))
    passing = [i for i in order if patterns[i] == "half"][:3]
    assert results[0][0][0][0].meta["id"][::N] == [f"r{i}" for i in passing]
