"""Starting and stopping what a run runs on: Ray (a local cluster of its own, or a joined one), every cluster of
workers, and the data the schedulers draw from; and what a worker's death means for the run."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import ray
from ray.exceptions import RayActorError

from roll_core.config import PipelineConfig
from roll_core.config.rewards import RewardComponentConfig
from roll_core.data.loading import RunData, fit_prompts, load_domain_rows, require_rows
from roll_pipeline.distributed.cluster import Cluster
from roll_pipeline.distributed.fit import check_fit, run_actors, total
from roll_pipeline.distributed.joining import join_ray
from roll_pipeline.distributed.placement import DevicePool, plan_for, reward_start_waves, start_stages
from roll_pipeline.distributed.starting import init_local_ray
from roll_pipeline.distributed.waiting import wait_for, wait_started
from roll_pipeline.driver.checkpoint import checkpoint_root, latest_checkpoint

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker that holds training state (actor_train, critic) died; the message says how to resume."""


# The GCS keeps an event record of every task and actor call, 100,000 by default, for the dashboard and the state
# API (`ray list tasks`). A local run has neither, and at some 45 calls a step the record alone grew the GCS
# from 61 to 133 MB over 500 steps (benchmarks/soak.py). Keep the last 2,000: enough to debug the current step.
#
# Ray starts its workers at niceness 15, below everything else on the machine; in a run the workers are the work
# (training, generation, scoring), so on a shared machine any other busy process starved them: under two busy
# processes at niceness 0 on 2 cores, DeepSpeed's first start (it compiles a C++ op) did not finish in 10 minutes.
# The run's own cluster runs them at the driver's priority.
LOCAL_RAY_SYSTEM_CONFIG = {"task_events_max_num_task_in_gcs": 2000, "worker_niceness": 0}


def load_run_data(tokenizer: Any, cfg: PipelineConfig) -> RunData:
    """The run's prompts, loaded and encoded before Ray starts, so that a prompt over data.prompt_length stops
    the run in seconds."""
    from roll_pipeline.driver.names import domain_tools

    train_rows = load_domain_rows(cfg.data.train_files, cfg.rewards)
    require_rows(train_rows, cfg.rewards, cfg.data.train_files)
    val_rows = load_domain_rows(cfg.data.val_files, cfg.rewards) if cfg.data.val_files else {}
    tools = domain_tools(cfg)
    return RunData(
        fit_prompts(tokenizer, train_rows, cfg.data, "train", tools=tools),
        fit_prompts(tokenizer, val_rows, cfg.data, "val", tools=tools),
    )


def log_dropped(data: RunData, prompt_length: int) -> None:
    """The warning `fit_prompts` gives for prompts left out, for data the preflight checks loaded quietly."""
    for name, count in data.dropped().items():
        if count:
            logger.warning(
                "data.on_long_prompt=drop: left out %d prompts longer than data.prompt_length=%d (%s)",
                count, prompt_length, name,
            )


def worker_env(torch_threads: int) -> dict[str, str]:
    # MALLOC_ARENA_MAX: glibc gives each thread that allocates an arena of its own, up to 8 per core, and each
    # arena keeps its freed pages; Ray's and the batcher's threads made a worker's memory creep up (see
    # workers.base.release_free_memory). Two arenas are enough for one torch thread and the rest.
    return {"OMP_NUM_THREADS": str(torch_threads), "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}


def init_ray(cfg: PipelineConfig) -> bool:
    """Join the configured (or RAY_ADDRESS) cluster, or start a local one sized for every actor of the run.

    Returns whether this call connected (False when Ray was already initialised by the caller)."""
    if ray.is_initialized():
        return False
    address = ray_address(cfg)
    if address:
        join_ray(address)
        return True
    needed = total(run_actors(cfg)).get("CPU", 0.0)
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(needed - 1e-6))
    start_local_ray(num_cpus)
    return True


def ray_address(cfg: PipelineConfig) -> str | None:
    """The Ray cluster a run joins (ray.address, else RAY_ADDRESS), or None: it starts a local one."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def start_local_ray(num_cpus: int, *, num_gpus: int | None = None, log_to_driver: bool = True) -> None:
    """A Ray cluster of this process's own (address "local": even when another one, `ray start`, runs on the
    machine) with LOCAL_RAY_SYSTEM_CONFIG; a run's and every test's local cluster start here. A node that did not
    register in time (its raylet aborted beside a slow dashboard agent, on a busy machine) is started again:
    init_local_ray."""
    init_local_ray(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        logging_level=logging.WARNING,
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )


class ReferenceOnTrainer:
    """The reference where actor_train trains LoRA adapters (cfg.reference_cluster false): the base model is the
    reference, and actor_train computes its log-probs with the adapter disabled. Stands where a reference cluster
    would (the driver asks both for `compute_log_probs`), with no workers of its own."""

    def __init__(self, actor_train: Cluster) -> None:
        self.actor_train = actor_train

    def dispatch(self, method: str, batch: Any) -> list[Any]:
        if method != "compute_log_probs":
            raise AttributeError(f"the reference on actor_train's base model has no {method!r}")
        return self.actor_train.dispatch("compute_ref_log_probs", batch)


class ClusterRuntime:
    """What a run runs on, held by `RLVRPipeline` (its `runtime`): Ray, every cluster of workers and the
    domains' schedulers. Starts them (`start_clusters`, `start_schedulers`), waits on their calls within the
    config's bounds, tells a dead training worker from a passing failure, and shuts everything down."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.owns_ray = False
        """Whether this runtime started or joined Ray (and so disconnects at shutdown)."""
        self.device_pool: DevicePool | None = None
        self.actor_train: Cluster | None = None
        self.actor_infer: Cluster | None = None
        self.reference: Cluster | ReferenceOnTrainer | None = None
        self.critic: Cluster | None = None
        self.rewards: dict[str, dict[str, Cluster]] = {}
        """Per domain, its reward clusters by component label."""
        self.schedulers: dict[str, Any] = {}
        """Per domain, its scheduler actor."""

    def start_clusters(self) -> None:
        """Ray, the device plan, and every cluster: actor_train, actor_infer, the reference and the critic where
        the config needs them, one reward cluster per domain; the trained ones initialised."""
        from workers.actor_infer import ActorInferWorker
        from workers.actor_train import ActorTrainWorker
        from workers.critic import CriticWorker
        from workers.reference import ReferenceWorker

        cfg = self.cfg
        plan = plan_for(cfg)  # before Ray starts: a mapping that cannot be placed stops the run at once
        self.owns_ray = init_ray(cfg)
        address = ray_address(cfg)
        where = f"at {address}" if address else "started for this run" if self.owns_ray else "this process joined"
        check_fit(run_actors(cfg, plan), where)  # before any actor starts: one that cannot be placed never starts
        self.device_pool = DevicePool.reserve(plan) if plan.slots else None

        def make(
            name: str, cls: type, section: Any, max_concurrency: int | None = None, restarts: int = 0, **kwargs: Any
        ) -> Cluster:
            return Cluster(
                name,
                cls,
                world_size=section.world_size,
                num_cpus=section.num_cpus_per_worker,
                num_gpus=section.num_gpus_per_worker,
                worker_kwargs={"pipeline_config": cfg, **kwargs},
                env_vars=worker_env(section.torch_threads),
                max_concurrency=max_concurrency,
                placement=section.placement,
                device_slots=self.device_pool.worker_options(name) if name in plan.slots else None,
                max_restarts=restarts,
                # actor_infer's requests are re-sent by the schedulers (with the current weights first).
                max_task_retries=restarts if cls is not ActorInferWorker else 0,
                rpc_timeout_s=cfg.ray.rpc_timeout_s,
                resources=section.resources,
            )

        restarts = cfg.ray.worker_restarts
        builders = {
            "actor_train": lambda: make(
                "actor_train", ActorTrainWorker, cfg.actor_train,
                total_optimizer_steps=cfg.optimizer_steps(cfg.actor_train),
            ),
            "actor_infer": lambda: make(
                "actor_infer", ActorInferWorker, cfg.actor_infer,
                max_concurrency=ActorInferWorker.MAX_CONCURRENCY, restarts=restarts,
            ),
            "reference": lambda: make("reference", ReferenceWorker, cfg.reference, restarts=restarts),
            "critic": lambda: make(
                "critic", CriticWorker, cfg.critic, total_optimizer_steps=cfg.optimizer_steps(cfg.critic)
            ),
        }
        self.reference = self.critic = None
        stages = start_stages(cfg)
        for stage in stages:
            for name in stage:
                setattr(self, name, builders[name]())
            if stage == ["actor_infer"] and len(stages) > 1:  # vLLM first, alone, then asleep (start_stages)
                self.wait_started([self.actor_infer])
                self.actor_infer.call("offload", False)
        if cfg.needs_reference and not cfg.reference_cluster:  # LoRA: the base model is the reference
            self.reference = ReferenceOnTrainer(self.actor_train)
        started: dict[tuple[str, str], Cluster] = {}
        for wave in reward_start_waves(cfg):  # pinned ones first: an unpinned one could take their node's CPU
            if started:
                self.wait_started(list(started.values()))
            started |= {
                (domain, c.label): self._reward_cluster(domain, c, len(cfg.rewards[domain].components()) > 1)
                for domain, c in wave
            }
        self.rewards = {
            domain: {c.label: started[domain, c.label] for c in cfg.rewards[domain].components()}
            for domain in cfg.domain_interleave_probs
        }
        self.wait_started(self.clusters())
        trained = self.trained_clusters()
        for cluster in trained:
            cluster.init_process_group()
        self.wait_for([ref for c in trained for ref in c.call_async("initialize")],
                      [name for c in trained for name in c.call_names("initialize")])

    def start_schedulers(self, train: dict[str, Any], val: dict[str, Any]) -> None:
        """One scheduler actor per domain, drawing from its train prompts (and validating on its val prompts),
        generating on actor_infer and scoring on the domain's reward clusters; waited for until started."""
        from schedulers.dynamic_sampling import start_scheduler

        cfg = self.cfg
        self.schedulers = {
            domain: start_scheduler(
                domain,
                rows=train[domain].rows,
                prompt_ids=train[domain].prompt_ids,
                val_rows=val[domain].rows if domain in val else [],
                val_prompt_ids=val[domain].prompt_ids if domain in val else [],
                pipeline_config=cfg,
                infer_workers=self.actor_infer.workers,
                reward_workers={name: cluster.workers for name, cluster in self.rewards[domain].items()},
            )
            for domain in cfg.domain_interleave_probs
        }
        wait_started([s.__ray_ready__.remote() for s in self.schedulers.values()],
                     [f"scheduler[{d}]" for d in self.schedulers], cfg.ray.actor_start_timeout_s)

    def scheduler_states(self) -> dict[str, Any]:
        """Each domain's scheduler state (its data position and counters), for a checkpoint."""
        return dict(zip(self.schedulers, self.on_schedulers("state_dict"), strict=True))

    def placement_record(self) -> dict[str, Any]:
        """Where every worker and scheduler runs: per cluster the Ray node of each rank, and each node's address
        (output_dir/placement.json: which node wrote which part of a checkpoint)."""
        clusters = self.clusters()
        refs = [s.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                for s in self.schedulers.values()]
        names = [f"scheduler[{d}].node_id" for d in self.schedulers]
        record = {"workers": {c.name: c.node_ids() for c in clusters},
                  "schedulers": dict(zip(self.schedulers, self.wait_for(refs, names), strict=True))}
        used = {n for ids in record["workers"].values() for n in ids} | set(record["schedulers"].values())
        record["nodes"] = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes() if n["NodeID"] in used}
        return record

    def wait_started(self, clusters: list[Cluster]) -> None:
        """Every worker of `clusters` placed and started, within ray.actor_start_timeout_s (else an error naming
        the ones still waiting)."""
        calls = [c.ready_calls() for c in clusters]
        wait_started([r for refs, _ in calls for r in refs], [n for _, names in calls for n in names],
                     self.cfg.ray.actor_start_timeout_s)

    def wait_for(self, refs: list[ray.ObjectRef], names: list[str]) -> list[Any]:
        """Results of calls to workers, within ray.rpc_timeout_s (roll_pipeline/distributed/waiting.py)."""
        return wait_for(refs, names, self.cfg.ray.rpc_timeout_s)

    def on_schedulers(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every domain's scheduler, waited for; results in domain order."""
        refs = [getattr(s, method).remote(*args) for s in self.schedulers.values()]
        return self.wait_for(refs, [f"scheduler[{d}].{method}" for d in self.schedulers])

    def _reward_cluster(self, domain: str, component: RewardComponentConfig, several: bool) -> Cluster:
        """The Ray cluster of one reward of `domain`: `reward_<domain>`, or `reward_<domain>_<name>` for one of
        several (rewards.<domain>.workers)."""
        from workers.rewards.worker import RewardWorker

        return Cluster(
            f"reward_{domain}_{component.label}" if several else f"reward_{domain}",
            RewardWorker,
            world_size=component.world_size,
            num_cpus=component.num_cpus_per_worker,
            num_gpus=component.num_gpus_per_worker,
            worker_kwargs={
                "domain": f"{domain}/{component.label}" if several else domain,
                "worker_spec": component.worker,
                "options": component.options,
                "timeout_s": component.timeout_s,
                "processes": component.num_processes,
                "num_gpus": component.num_gpus_per_worker,
            },
            env_vars=worker_env(1),
            pass_rank=False,
            max_concurrency=RewardWorker.MAX_CONCURRENT_BATCHES,
            max_restarts=self.cfg.ray.worker_restarts,
            max_task_retries=self.cfg.ray.worker_restarts,
            rpc_timeout_s=self.cfg.ray.rpc_timeout_s,
            resources=component.resources,
        )

    def clusters(self) -> list[Cluster]:
        """Every cluster started: actor_train, actor_infer, the reference and critic where there are, the rewards."""
        trained_and_infer = [self.actor_train, self.actor_infer, self.reference, self.critic]
        return [c for c in trained_and_infer if isinstance(c, Cluster)] + self.reward_clusters()

    def trained_clusters(self) -> list[Cluster]:
        """The clusters that hold training state: actor_train, and the critic where there is one."""
        return [c for c in (self.actor_train, self.critic) if c is not None]

    def reward_clusters(self) -> list[Cluster]:
        return [cluster for by_name in self.rewards.values() for cluster in by_name.values()]

    def shutdown(self) -> None:
        for scheduler in self.schedulers.values():
            ray.kill(scheduler)
        self.schedulers = {}
        for cluster in self.clusters():
            cluster.shutdown()
        if self.device_pool is not None:
            self.device_pool.release()
            self.device_pool = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    def dead_training_workers(self) -> list[str]:
        """Ranks of actor_train and critic that no longer answer."""
        dead = []
        for cluster in self.trained_clusters():
            for rank, worker in enumerate(cluster.workers):
                try:
                    ray.get(worker.ready.remote(), timeout=30)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    dead.append(f"{cluster.name}[{rank}]")
        return dead

    def death_message(self, dead: list[str], exc: BaseException, step: int) -> str:
        checkpoint = latest_checkpoint(checkpoint_root(self.cfg.output_dir))
        if checkpoint is not None:
            how = f"resume from its last checkpoint, {checkpoint}, with `roll run CONFIG --resume`"
        else:
            how = "no checkpoint was saved to resume from (save_steps is 0 or no save came yet)"
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return (
            f"{', '.join(dead)} died at step {step} ({cause}). actor_train and critic hold the training "
            f"state and are not restarted, so the run stops; {how}"
        )
