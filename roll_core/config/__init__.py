"""The pipeline's configuration: the schema (frozen dataclasses, each field documented once, at the field) and the
strict loader (loader.py).

The schema has a module per section of the YAML: pipeline.py (the top level, PipelineConfig, and the checks that
span sections), clusters.py (actor_train, actor_infer, reference, critic), rewards.py (rewards.<domain>,
reward_audit), shaping.py (reward_shaping), data.py, validation.py, sampling.py (dynamic_sampling, domain_mixer),
tracking.py, ray.py; errors.py holds ConfigError. `validate()` methods only check values and yield (relative key,
message) pairs; the loader prefixes the key paths and reports every problem at once. Field names follow ROLL's
where they mean the same thing.
"""

from roll_core.config.clusters import (
    ActorInferConfig,
    ActorTrainConfig,
    ClusterConfig,
    CriticConfig,
    GeneratingArgs,
    ModelArgs,
    ReferenceConfig,
    StrategyArgs,
    TrainingArgs,
)
from roll_core.config.data import DataConfig
from roll_core.config.errors import ConfigError
from roll_core.config.loader import (
    ResolvedConfig,
    apply_overrides,
    from_dict,
    interpolate,
    load_config,
    load_raw,
    parse_override,
    resolve,
)
from roll_core.config.pipeline import PipelineConfig
from roll_core.config.ray import RayConfig
from roll_core.config.rewards import RewardConfig
from roll_core.config.sampling import DynamicSamplingConfig
from roll_core.config.shares import domain_shares
from roll_core.config.tracking import TrackingConfig
from roll_core.config.validation import ValidationConfig

__all__ = [
    "ActorInferConfig",
    "ActorTrainConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "GeneratingArgs",
    "ModelArgs",
    "PipelineConfig",
    "RayConfig",
    "ReferenceConfig",
    "ResolvedConfig",
    "RewardConfig",
    "StrategyArgs",
    "TrackingConfig",
    "TrainingArgs",
    "ValidationConfig",
    "apply_overrides",
    "domain_shares",
    "from_dict",
    "interpolate",
    "load_config",
    "load_raw",
    "parse_override",
    "resolve",
]
