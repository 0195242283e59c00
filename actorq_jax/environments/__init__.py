"""dm_control suite and gymnasium tasks behind one dm_env interface.

Every environment returned by `make_environment` has a flat float32
observation vector, float32 rewards and discounts, and ends episodes with a
LAST step whose discount is 0.0 on termination and 1.0 on time-limit
truncation. Importing this package sets MUJOCO_GL=disable unless it is set.
"""

from actorq_jax.environments import _mujoco_gl  # noqa: F401  (must precede dm_control imports)
from actorq_jax.environments.dm_control_env import DmControlEnvironment
from actorq_jax.environments.gymnasium_env import GymnasiumEnvironment
from actorq_jax.environments.registry import GYMNASIUM_TASKS, available_tasks, make_environment
from actorq_jax.environments.spec import EnvironmentSpec, environment_spec

__all__ = [
    "DmControlEnvironment",
    "EnvironmentSpec",
    "GYMNASIUM_TASKS",
    "GymnasiumEnvironment",
    "available_tasks",
    "environment_spec",
    "make_environment",
]
