"""The agent contract: everything the launcher, actors, evaluator and learner loop may call on an agent.

An agent is one folder under `actorq_jax/agents/` holding a frozen config
dataclass, a builder that subclasses `AgentBuilder`, and a `register_agent`
call in its `__init__.py` (see `actorq_jax.agents.registry`). Nothing in
`launch/` knows an agent by name: it reads the registry and calls only what
this class declares.
"""

import abc
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

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
# `(params, keys[K], observations[K, obs]) -> actions[K, ...]`: K environments of one actor in one policy call,
# each row with its own key and its own exploration.
VectorPolicy = Callable[[chex.ArrayTree, jax.Array, jnp.ndarray], jnp.ndarray]


def exploration_slots(actor_id: int, num_actors: int, envs_per_actor: int) -> List[Tuple[int, int]]:
    """(slot, num_slots) of each environment of an actor: env k of actor i explores as actor i*K+k of N*K would.

    With K = 1 that is the actor itself, so one environment per actor keeps the per-actor spread.
    """
    if envs_per_actor < 1:
        raise ValueError(f"envs_per_actor must be >= 1, got {envs_per_actor}")
    slots = num_actors * envs_per_actor
    return [(actor_id * envs_per_actor + k, slots) for k in range(envs_per_actor)]


def single_env(vector_policy: VectorPolicy) -> BehaviourPolicy:
    """The one-environment form `(params, key, observation) -> action` of a K = 1 vector policy."""
    return jax.jit(lambda params, key, observation: vector_policy(params, key[None], observation[None])[0])


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
    def vector_behaviour_policy(self, actor_id: int, num_actors: int, envs_per_actor: int) -> VectorPolicy:
        """The exploring policy of an actor's K environments (see exploration_slots); ids beyond num_actors
        (remote actors) act as the last one."""

    def behaviour_policy(self, actor_id: int, num_actors: int) -> BehaviourPolicy:
        """The exploring policy of a one-environment actor."""
        return single_env(self.vector_behaviour_policy(actor_id, num_actors, 1))

    @abc.abstractmethod
    def greedy_policy(self) -> GreedyPolicy:
        """The policy without exploration, for evaluation."""

    def params_template(self) -> chex.ArrayTree:
        """Float actor parameters of the right structure (for checking incoming payloads)."""
        obs = jnp.zeros((1, self.spec.observation_dim), jnp.float32)
        return self.actor_network.init(jax.random.PRNGKey(0), obs)
