"""The entry points that code outside the project (the benchmarks, a reward plugin, a user's own scripts) builds
on, by one name each, wherever the code behind them lives: a refactoring that moves one changes this table, not
its callers.

Names load on first use (`roll_pipeline.api.RLVRPipeline` imports the pipeline then, not at `import
roll_pipeline.api`). tests/test_api.py resolves every name, and holds benchmarks/ to importing the project only
through here.
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> "module:attribute".
ENTRY_POINTS: dict[str, str] = {
    # a run
    "load_run_config": "roll_pipeline.driver.names:load_run_config",
    "RLVRPipeline": "roll_pipeline.driver.pipeline:RLVRPipeline",
    "start_local_ray": "roll_pipeline.driver.runtime:start_local_ray",
    "worker_env": "roll_pipeline.driver.runtime:worker_env",
    "Cluster": "roll_pipeline.distributed.cluster:Cluster",
    # data and batches
    "Batch": "roll_core.batch:Batch",
    "load_rows": "roll_core.data.loading:load_rows",
    "encode_prompt": "roll_core.data.loading:encode_prompt",
    "collate_prompts": "roll_core.data.loading:collate_prompts",
    # models
    "load_tokenizer": "workers.strategies.loading:load_tokenizer",
    "eos_token_ids": "workers.strategies.loading:eos_token_ids",
    "truncate_at_eos": "workers.strategies.hf_infer:truncate_at_eos",
    "batched_log_probs": "roll_core.models.forward:batched_log_probs",
    "SamplingDistribution": "roll_core.models.sampling:SamplingDistribution",
    "row_lengths": "roll_core.models.microbatches:row_lengths",
    "prompt_groups": "roll_core.models.microbatches:prompt_groups",
    "token_budget_plan": "roll_core.models.microbatches:token_budget_plan",
    "over_budget": "roll_core.models.microbatches:over_budget",
    "cut": "roll_core.models.microbatches:cut",
    "padding": "roll_core.models.microbatches:padding",
    "LoraArgs": "roll_core.config.clusters:LoraArgs",
    "with_lora": "workers.strategies.lora:with_lora",
    "adapter_state": "workers.strategies.lora:adapter_state",
    "load_adapter_state": "workers.strategies.lora:load_adapter_state",
    # algorithms
    "ADVANTAGES": "roll_core.algorithms:ADVANTAGES",
    "place_at_last_token": "roll_core.algorithms.advantages:place_at_last_token",
    # a reward plugin: the scorer contract and its registry
    "RewardScorer": "roll_core.rewards.scorer:RewardScorer",
    "BatchedRewardScorer": "roll_core.rewards.scorer:BatchedRewardScorer",
    "RewardResult": "roll_core.rewards.scorer:RewardResult",
    "reward_sample": "roll_core.rewards.scorer:reward_sample",
    "ScoredSample": "roll_core.rewards.scored:ScoredSample",
    "register_reward_worker": "workers.rewards.registry:register_reward_worker",
    # a multi-turn environment plugin: the contract and its registry
    "Environment": "roll_core.environment:Environment",
    "EnvStep": "roll_core.environment:EnvStep",
    "EnvironmentUnavailable": "roll_core.environment:EnvironmentUnavailable",
    "register_environment": "workers.environments.registry:register_environment",
    "PythonToolEnvironment": "workers.environments.python_tool:PythonToolEnvironment",
    "replay_program": "workers.environments.tool_calls:replay_program",
    # workers
    "ActorTrainWorker": "workers.actor_train:ActorTrainWorker",
    "ActorInferWorker": "workers.actor_infer:ActorInferWorker",
    "make_infer_strategy": "workers.actor_infer:make_infer_strategy",
    "RewardWorker": "workers.rewards.worker:RewardWorker",
    "MathRuleScorer": "workers.rewards.math_rule:MathRuleScorer",
    "CodeSandboxScorer": "workers.rewards.code_sandbox:CodeSandboxScorer",
    "Sandbox": "workers.rewards.sandbox.process:Sandbox",
    "run_checked": "workers.rewards.sandbox.relay:run_checked",
}

__all__ = sorted(ENTRY_POINTS)


def __getattr__(name: str) -> Any:
    target = ENTRY_POINTS.get(name)
    if target is None:
        raise AttributeError(f"roll_pipeline.api has no {name!r}; its entry points: {', '.join(__all__)}")
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
