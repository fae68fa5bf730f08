"""Environments of multi-turn rollouts found by name (``rewards.<domain>.rollout.environment``): built-in names,
``package.module:Class`` paths, and the entry-point group ``roll_pipeline.environments`` of installed packages.
The lookup is roll_core/plugins.py's, shared with the reward workers.
"""

from __future__ import annotations

from roll_core.environment import Environment
from roll_core.plugins import PluginRegistry

ENTRY_POINT_GROUP = "roll_pipeline.environments"

ENVIRONMENTS: PluginRegistry[type[Environment]] = PluginRegistry(
    "environment", Environment, ENTRY_POINT_GROUP, ("workers.environments.python_tool",)
)



def register_environment(name: str):
    """Class decorator: ``@register_environment("name")`` on an Environment subclass."""
    return ENVIRONMENTS.register(name)


def get_environment_cls(spec: str) -> type[Environment]:
    """The environment class for a registered name, an entry-point name, or ``package.module:Class``."""
    return ENVIRONMENTS.get(spec)
