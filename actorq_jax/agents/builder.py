"""The agent contract: everything the launcher, actors, evaluator and learner loop may call on an agent.

An agent is one folder under `actorq_jax/agents/` holding a frozen config
dataclass, a builder that subclasses `AgentBuilder`, and a `register_agent`
call in its `__init__.py` (see `actorq_jax.agents.registry`). Nothing in
`launch/` knows an agent by name: it reads the registry and calls only what
this class declares.
"""

import abc
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import ReplayBatch, ReplayTableConfig

Metrics = Dict[str, jnp.ndarray]
# `sgd_step(state, batch) -> (state, metrics)`: pure, jitted where it matters; state is a pytree.
SgdStep = Callable[[Any, ReplayBatch], Tuple[Any, Metrics]]
# `(params, key, observation) -> action` of an exploring actor; `(params, observation) -> action` greedy.
BehaviourPolicy = Callable[[chex.ArrayTree, chex.PRNGKey, jnp.ndarray], jnp.ndarray]
GreedyPolicy = Callable[[chex.ArrayTree, jnp.ndarray], jnp.ndarray]


class AdderConfig(NamedTuple):
    """How an actor turns its steps into replay items: the replay table and the n-step return."""

    table: str
    n_step: int
    discount: float


class PriorityUpdate(NamedTuple):
    """New priorities for sampled items (keys as in ReplayBatch.keys)."""

    keys: np.ndarray
    priorities: np.ndarray


class AgentBuilder(abc.ABC):
    """Base of every agent's builder; the launcher's whole view of an agent.

    Subclasses set `config` (the agent's frozen config), `spec` (the task's
    EnvironmentSpec) and `actor_network` (the flax module actors and the
    evaluator run) in `__init__(config, spec)`, and implement the abstract
    methods. The config subclasses `actorq_jax.config.AgentConfig`, whose fields
    (n-step return, batch size, replay regime) this class reads.
    """

    config: Any
    spec: EnvironmentSpec
    actor_network: Any

    # -- learner ------------------------------------------------------------------------

    @abc.abstractmethod
    def init_state(self, key: chex.PRNGKey) -> Any:
        """A fresh learner state pytree (checkpointed as is)."""

    @abc.abstractmethod
    def sgd_step(self, state: Any, batch: ReplayBatch) -> Tuple[Any, Metrics]:
        """One pure SGD step on a sampled batch: `(state, batch) -> (state, metrics)`."""

    @abc.abstractmethod
    def actor_params(self, state: Any) -> chex.ArrayTree:
        """The float parameters actors and the evaluator run, taken from a learner state."""

    def priority_update(self, batch: ReplayBatch, metrics: Metrics) -> Optional[PriorityUpdate]:
        """Priorities the learner writes back after `sgd_step` (None: the replay is uniform)."""
        del batch, metrics
        return None

    @property
    def batch_size(self) -> int:
        """Transitions per SGD step."""
        return int(self.config.batch_size)

    # -- replay ---------------------------------------------------------------------------

    @property
    def prioritized(self) -> bool:
        """Whether the replay table samples by priority."""
        return False

    def replay_config(self) -> ReplayTableConfig:
        """The replay table: FIFO removal; rate-limited to samples_per_insert, or free with a cap on samples per item."""
        c = self.config
        ratio = c.rate_limiter == "ratio"
        return ReplayTableConfig(
            name="replay",
            max_size=c.max_replay_size,
            min_size=c.min_replay_size,
            samples_per_insert=c.samples_per_insert if ratio else None,
            max_times_sampled=0 if ratio else c.max_times_sampled,
            prioritized=self.prioritized,
            **({"priority_exponent": c.priority_exponent} if self.prioritized else {}),
        )

    def adder_config(self) -> AdderConfig:
        """The replay table actors write to and their n-step return."""
        return AdderConfig(self.replay_config().name, int(self.config.n_step), float(self.config.discount))

    @abc.abstractmethod
    def example_action(self) -> np.ndarray:
        """An action with the replay table's dtype and shape."""

    # -- actors and evaluator -------------------------------------------------------------

    @abc.abstractmethod
    def behaviour_policy(self, actor_id: int, num_actors: int) -> BehaviourPolicy:
        """The exploring policy of one actor; ids beyond num_actors (remote actors) act as the last one."""

    @abc.abstractmethod
    def greedy_policy(self) -> GreedyPolicy:
        """The policy without exploration, for evaluation."""

    def params_template(self) -> chex.ArrayTree:
        """Float actor parameters of the right structure (for checking incoming payloads)."""
        obs = jnp.zeros((1, self.spec.observation_dim), jnp.float32)
        return self.actor_network.init(jax.random.PRNGKey(0), obs)
