"""Task names -> dm_env environments, for dm_control suite and gymnasium tasks."""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Tuple

import dm_env

from actorq_jax.environments import _mujoco_gl  # noqa: F401  (sets MUJOCO_GL before dm_control loads)

# Episode length (agent steps) of a dm_control task that has no time limit of its own.
UNLIMITED_TASK_EPISODE_STEPS = 1000

# The paper's DQN tasks (classic control: Box observations, Discrete actions).
GYMNASIUM_TASKS: Tuple[str, ...] = ("CartPole-v1", "MountainCar-v0", "Acrobot-v1")


@functools.lru_cache(maxsize=1)
def _dm_control_tasks() -> Dict[str, Tuple[str, str]]:
    # Imported lazily: gymnasium-only users do not pay for loading MuJoCo.
    from dm_control import suite

    # Domain and task names may both contain underscores (ball_in_cup_catch,
    # humanoid_CMU_run, lqr_lqr_2_1), so names resolve through this table,
    # never by splitting.
    return {f"{domain}_{task}": (domain, task) for domain, task in suite.ALL_TASKS}


def available_tasks() -> List[str]:
    """All task names make_environment accepts: dm_control "domain_task", then gymnasium ids."""
    return list(_dm_control_tasks()) + list(GYMNASIUM_TASKS)


def _check_positive_int(name: str, value: Optional[int], allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def make_environment(
    task: str,
    seed: int,
    *,
    action_repeat: int = 1,
    max_episode_steps: Optional[int] = None,
) -> dm_env.Environment:
    """Builds a seeded dm_env environment with flat float32 observations for a task name.

    Args:
      task: a dm_control suite task as "domain_task" (e.g. "walker_walk") or a
        gymnasium id from GYMNASIUM_TASKS (e.g. "CartPole-v1").
      seed: a non-negative integer; the same seed gives the same episodes.
      action_repeat: apply each action this many times (rewards summed).
      max_episode_steps: end episodes after this many agent steps as a
        truncation (LAST with discount 1.0); None keeps the task's own limit
        (UNLIMITED_TASK_EPISODE_STEPS for a task without one).

    Raises:
      ValueError: for an unknown task (the message lists the valid ones) or a
        bad seed / action_repeat / max_episode_steps.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    _check_positive_int("action_repeat", action_repeat, allow_none=False)
    _check_positive_int("max_episode_steps", max_episode_steps, allow_none=True)

    if task in GYMNASIUM_TASKS:
        import gymnasium

        from actorq_jax.environments.gymnasium_env import GymnasiumEnvironment

        kwargs = {}
        if max_episode_steps is not None:
            # gymnasium's TimeLimit counts underlying steps, so with action
            # repeat the agent-step limit is scaled to match.
            kwargs["max_episode_steps"] = max_episode_steps * action_repeat
        gym_env = gymnasium.make(task, disable_env_checker=True, **kwargs)
        return GymnasiumEnvironment(gym_env, seed=seed, action_repeat=action_repeat)

    dm_tasks = _dm_control_tasks()
    if task in dm_tasks:
        from dm_control import suite

        from actorq_jax.environments.dm_control_env import DmControlEnvironment

        domain, task_name = dm_tasks[task]
        env = suite.load(domain, task_name, task_kwargs={"random": seed})
        if max_episode_steps is None and math.isinf(getattr(env, "_step_limit", 0.0)):
            # The LQR tasks have no time limit and end only near the origin, which an untrained policy never
            # reaches: an evaluation episode would never end. They get the suite's usual 1,000 steps.
            max_episode_steps = UNLIMITED_TASK_EPISODE_STEPS
        return DmControlEnvironment(env, action_repeat=action_repeat, max_episode_steps=max_episode_steps)

    raise ValueError(f"unknown task {task!r}; valid tasks are: {', '.join(available_tasks())}")
