"""The driver's weight sync (roll_pipeline/driver/weight_sync.py) against a recording stand-in of the run's clusters:
when it syncs, which calls each transport makes, in which order, with which version. The real transports are
proven end to end by tests/test_pipeline_integration.py, test_worker_failures.py (a restarted actor_infer gets the
kept weights), test_partial_rollouts.py and the vLLM tests."""

from __future__ import annotations

from types import SimpleNamespace

from roll_pipeline.driver.loop_state import LoopState, Rollout
from roll_pipeline.driver.weight_sync import WeightSync


class Worker:
    def __init__(self, log: list, name: str) -> None:
        self.get_weights = SimpleNamespace(remote=lambda **kw: log.append((name, "get_weights", kw)) or f"{name}:w")


class Cluster:
    def __init__(self, log: list, name: str, ranks: int = 1) -> None:
        self.log, self.name = log, name
        self.workers = [Worker(log, f"{name}[{r}]") for r in range(ranks)]

    def call(self, method, *args):
        self.log.append((self.name, method, *args))

    def call_async(self, method, **kwargs):
        self.log.append((self.name, "call_async", method, kwargs))
        return [f"{self.name}[{r}]:w" for r in range(len(self.workers))]

    def call_names(self, method):
        return [f"{self.name}[{r}].{method}" for r in range(len(self.workers))]


class Runtime:
    def __init__(self, ranks: int = 1) -> None:
        self.log: list = []
        self.actor_train = Cluster(self.log, "actor_train", ranks)
        self.actor_infer = Cluster(self.log, "actor_infer", 2)

    def on_schedulers(self, method, *args):
        self.log.append(("schedulers", method, *args))

    def wait_for(self, refs, names):
        self.log.append(("wait_for", list(refs), list(names)))


def make(transport="rpc", zero_stage=0, partial=False, ranks=1):
    cfg = SimpleNamespace(
        partial_rule=partial,
        actor_infer=SimpleNamespace(weight_transport=transport),
        actor_train=SimpleNamespace(zero_stage=zero_stage),
    )
    runtime = Runtime(ranks)
    return WeightSync(cfg, runtime, LoopState(kl_ctrl=None)), runtime.log


def test_rpc_sends_rank_0s_packed_weights_and_tells_the_schedulers_the_version():
    sync, log = make()
    sync.ensure()
    assert log == [] and sync.version == 0  # actor_infer has the starting weights
    sync.loop.trained_version = 2
    sync.ensure()
    assert log == [
        ("actor_train[0]", "get_weights", {"packed": True}),
        ("actor_infer", "update_weights", "actor_train[0]:w", 2),
        ("schedulers", "set_weights", 2, ["actor_train[0]:w"]),  # kept for a worker that restarts
    ]
    assert sync.version == 2
    log.clear()
    sync.ensure()
    assert log == []  # nothing new to send


def test_a_version_is_compared_by_value_and_only_rank_0_is_asked_without_zero_3():
    sync, log = make(zero_stage=2, ranks=2, transport="".join(["r", "pc"]))  # a string built at run time, as loaded
    sync.loop.trained_version = 999
    sync.ensure()
    assert log[0] == ("actor_train[0]", "get_weights", {"packed": True}) and len(log) == 3
    log.clear()
    sync.loop.trained_version += 1
    sync.loop.trained_version -= 1  # the same number, another int object past CPython's cache of small ones
    sync.ensure()
    assert log == []


def test_under_zero_3_every_rank_gathers_and_rank_0s_weights_go_on():
    sync, log = make(zero_stage=3, ranks=2)
    sync.loop.trained_version = 1
    sync.ensure()
    assert log == [
        ("actor_train", "call_async", "get_weights", {"packed": True}),
        ("wait_for", ["actor_train[1]:w"], ["actor_train[1].get_weights"]),
        ("actor_infer", "update_weights", "actor_train[0]:w", 1),
        ("schedulers", "set_weights", 1, ["actor_train[0]:w"]),
    ]


def test_the_partial_rule_syncs_once_at_the_start_and_keeps_the_versions_still_generating():
    sync, log = make(partial=True)
    sync.ensure()  # the starting weights, once: the rule may need them again after newer ones
    assert log[1] == ("actor_infer", "update_weights", "actor_train[0]:w", 0, 0)
    log.clear()
    sync.ensure()
    assert log == []
    sync.loop.trained_version = 3
    # a rollout collected (its batch is in) needs no weights any more; those still generating do
    sync.loop.pending_rollouts = [Rollout(version=1, batch=object()), Rollout(version=2), Rollout(version=3)]
    sync.ensure()
    assert log[1] == ("actor_infer", "update_weights", "actor_train[0]:w", 3, 2)
    sync.loop.trained_version = 4
    sync.loop.pending_rollouts = []
    log.clear()
    sync.ensure()
    assert log[1] == ("actor_infer", "update_weights", "actor_train[0]:w", 4, 4)


def test_a_transfer_engine_sends_from_actor_train_and_nothing_is_kept():
    sync, log = make(transport="nccl")
    sync.loop.trained_version = 1
    sync.ensure()
    assert log == [
        ("actor_train", "send_weights", sync.runtime.actor_infer.workers, 1),
        ("schedulers", "set_weights", 1, [None]),
    ]
    assert sync.version == 1 and sync.synced_once
