"""The agent contract: everything the launcher, actors, evaluator and learner loop may call on an agent.

An agent is one folder under `actorq_jax/agents/` holding a frozen config
dataclass, a builder that subclasses `AgentBuilder`, and a `register_agent`
call in its `__init__.py` (see `actorq_jax.agents.registry`). Nothing in
`launch/` knows an agent by name: it reads the registry and calls only what
this class declares, data path included (the replay tables and their item
signature, the adder actors write with, the dataset the learner reads, the
metrics it logs, and the priorities written back).
"""

import abc
import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from actorq_jax.agents.priorities import PriorityFeedback, PriorityUpdate
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.replay import (
    NStepAdder,
    ReplayBatch,
    ReplayDataset,
    ReplayTableConfig,
    make_item_table,
    transition_signature,
)

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


class Adder(Protocol):
    """What an actor writes one environment's steps with (launch/actor.py calls only this).

    A write the server does not confirm within `timeout_s` raises replay.WriteTimeout (the items stay
    queued: `wait` waits for them again); a broken stream raises RuntimeError or ConnectionError.
    """

    timeout_s: Optional[float]
    wait_s: float  # seconds spent blocked until the server took the items (the rate limiter's hold)

    def add_first(self, timestep: Any) -> None:
        """Starts an episode at a FIRST timestep."""

    def add(self, action: Any, next_timestep: Any, priority: Optional[float] = None) -> None:
        """Records an action and the timestep it led to (new items at `priority`, None: the adder's default)."""

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Blocks until few enough items await the server (WriteTimeout past `timeout_s`)."""

    def close(self, flush: bool = True, timeout_s: Optional[float] = None) -> None:
        """Flushes created items (unless flush=False) and closes the stream."""


class LearningModule:
    """For a builder whose losses and SGD step live in a module of their own (`learning_module`, which defines
    `init_state(config, networks, spec, key)` and `make_sgd_step(config, networks)`): that module is imported on
    first use, so only the learner pays for it."""

    learning_module: str  # dotted name of the agent's learning module

    @functools.cached_property
    def _learning(self) -> ModuleType:
        # The losses (rlax, optax) only the learner needs: actors, the evaluator and the replay service never
        # import them, which saves each of those processes about 1.4 CPU-s of start-up.
        return importlib.import_module(self.learning_module)

    @functools.cached_property
    def _sgd_step(self) -> SgdStep:
        return self._learning.make_sgd_step(self.config, self.networks)

    def init_state(self, key: chex.PRNGKey) -> Any:
        """Fresh learner state."""
        return self._learning.init_state(self.config, self.networks, self.spec, key)


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

    def priority_feedback(self) -> Optional[PriorityFeedback]:
        """The write-back loop of a prioritized table (priority_update's priorities, new items at the largest);
        None for uniform replay. The learner and every actor each make their own."""
        if not self.prioritized:
            return None
        return PriorityFeedback(self.replay_config().name, self.priority_update)

    def loggable_metrics(self, metrics: Metrics) -> Dict[str, float]:
        """The learner.csv columns of a step's metrics: each metric's mean."""
        return {k: float(np.mean(v)) for k, v in jax.device_get(metrics).items()}

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

    def item_signature(self) -> Dict[str, Any]:
        """The replay items' signature (field -> tf.TensorSpec): an n-step Transition of this task."""
        return transition_signature(np.zeros((self.spec.observation_dim,), np.float32), self.example_action())

    def replay_tables(self, config: Optional[ReplayTableConfig] = None) -> List[Any]:
        """The Reverb tables of replay on the run's server: replay_config()'s (or `config`'s) of item_signature()."""
        return [make_item_table(config or self.replay_config(), self.item_signature())]

    def make_adder(self, client: Any, timeout_s: Optional[float], connect_timeout_s: float) -> Adder:
        """What one environment of an actor writes with, through a Reverb client: an n-step adder."""
        config = self.adder_config()
        return NStepAdder(client, config.table, config.n_step, config.discount, timeout_s=timeout_s,
                          connect_timeout_s=connect_timeout_s)

    def make_dataset(self, address: str, rate_limiter_timeout_ms: int) -> Iterator[Any]:
        """The batches sgd_step takes, sampled from the replay service at `address` (StopIteration once the
        rate limiter held a sample for `rate_limiter_timeout_ms`, tf.errors.OpError when the service went away):
        ReplayBatches of n-step Transitions."""
        return ReplayDataset(address, self.replay_config().name, self.batch_size, with_info=True,
                             rate_limiter_timeout_ms=rate_limiter_timeout_ms)

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
        """The float actor parameters' structure, shapes and dtypes (jax.ShapeDtypeStruct leaves; computes nothing)."""
        # Only the structure is wanted (checking incoming payloads): an eager init would compile and run every
        # initializer in each actor and the evaluator at start-up, about a CPU-second each.
        return jax.eval_shape(self.init_actor_params, jax.random.PRNGKey(0))

    def init_actor_params(self, key: chex.PRNGKey) -> chex.ArrayTree:
        """Freshly initialised float actor parameters (a policy to run without a learner: benchmarks, tests)."""
        return self.actor_network.init(key, jnp.zeros((1, self.spec.observation_dim), jnp.float32))
