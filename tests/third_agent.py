"""A third agent with a data path of its own, for tests: one-step items that carry the env step index.

Its replay items are not the n-step Transitions of D4PG and DQN: a `StepItem` is one
environment step (o_t, a_t, r_{t+1}, gamma * d_{t+1}, o_{t+1}) plus `step_index`, the t of
o_t in its episode. The builder declares the item signature, an adder that writes
such items, a dataset that reads them back as `StepItem` batches, and a learner (a
linear Q-function regressed on one-step targets with optax) whose metrics report the
step indices it sampled: the running mean over every sampled item, and the last
batch's min and max.

Importing this module registers the agent as "third". Worker processes of a run find
it when this directory is on PYTHONPATH and ACTORQ_AGENT_MODULES names `third_agent`.
"""

import dataclasses
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import reverb
import tensorflow as tf

from actorq_jax.agents.builder import AgentBuilder
from actorq_jax.agents.registry import AgentEntry, register_agent
from actorq_jax.config import AgentConfig, check, check_positive, documented
from actorq_jax.networks import QNetwork
from actorq_jax.replay import ItemLayout, ReplayBatch, ReplayDataset, WriteTimeout, transition_signature

NAME = "third"
MODULE = "third_agent"


@dataclasses.dataclass(frozen=True)
class ThirdConfig(AgentConfig):
    """A linear Q-function on one-step items; the replay regime's defaults sized for a tiny run."""

    learning_rate: float = documented(0.01, "Adam step size")
    epsilon: float = documented(0.5, "probability of a uniformly random action")
    batch_size: int = documented(16, "items per SGD step")
    samples_per_insert: float = documented(8.0, "replay ratio")
    min_replay_size: int = documented(50, "items before learning")
    max_replay_size: int = documented(100_000, "replay capacity")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, ("learning_rate",))
        check(0.0 <= self.epsilon <= 1.0, self, "epsilon", "must be in [0, 1]")


class StepItem(NamedTuple):
    """One environment step and the index of its first observation in the episode."""

    observation: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    next_observation: np.ndarray
    step_index: np.ndarray


class ThirdState(NamedTuple):
    """Learner state: parameters, optimizer state, steps, and the sum and count of sampled step indices."""

    params: Any
    opt_state: Any
    steps: jnp.ndarray
    index_sum: jnp.ndarray
    index_count: jnp.ndarray


class StepAdder:
    """Writes one StepItem per environment step through a Reverb trajectory writer (the agent contract's Adder)."""

    FLUSH_ITEMS = 8

    def __init__(self, client: reverb.Client, table: str, discount: float, timeout_s: Optional[float]):
        self.timeout_s = timeout_s
        self.wait_s = 0.0
        self._client, self._table, self._gamma = client, table, float(discount)
        self._writer = client.trajectory_writer(num_keep_alive_refs=1)
        # The table stores items packed per dtype (make_item_table); its signature names the layout.
        self._layout = ItemLayout.from_table(client.server_info()[table].signature, table)
        self._observation: Optional[np.ndarray] = None
        self._t = 0

    def add_first(self, timestep: Any) -> None:
        """Starts an episode at its first observation (step index 0)."""
        self._observation, self._t = np.asarray(timestep.observation, np.float32), 0

    def add(self, action: Any, next_timestep: Any, priority: Optional[float] = None) -> None:
        """Writes the item of this step; ends the episode at a LAST timestep."""
        next_observation = np.asarray(next_timestep.observation, np.float32)
        discount = 1.0 if next_timestep.discount is None else float(next_timestep.discount)
        self._writer.append(self._layout.pack({
            "observation": self._observation,
            "action": np.asarray(action, np.int32),
            "reward": np.float32(0.0 if next_timestep.reward is None else next_timestep.reward),
            "discount": np.float32(self._gamma * discount),
            "next_observation": next_observation,
            "step_index": np.int32(self._t),
        }))
        history = self._writer.history
        self._writer.create_item(self._table, priority=1.0 if priority is None else priority,
                                 trajectory={column: history[column][-1] for column in self._layout.columns})
        self._observation, self._t = next_observation, self._t + 1
        if next_timestep.last():
            self._blocking(lambda ms: self._writer.end_episode(clear_buffers=True, timeout_ms=ms))
        else:
            self.wait()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Blocks until at most FLUSH_ITEMS items await the server (WriteTimeout past the timeout)."""
        self._blocking(lambda ms: self._writer.flush(block_until_num_items=self.FLUSH_ITEMS, timeout_ms=ms), timeout_s)

    def close(self, flush: bool = True, timeout_s: Optional[float] = None) -> None:
        """Sends the created items (unless flush=False) and closes the writer."""
        try:
            if flush:
                self._blocking(lambda ms: self._writer.flush(timeout_ms=ms), timeout_s)
        finally:
            self._writer.close()

    def _blocking(self, call: Callable[[Optional[int]], None], timeout_s: Optional[float] = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        timeout_ms = None if timeout_s is None else max(1, int(timeout_s * 1000))
        start = time.perf_counter()
        try:
            call(timeout_ms)
        except reverb.DeadlineExceededError as error:
            raise WriteTimeout(f"{self._client.server_address} did not confirm items within {timeout_ms} ms") from error
        finally:
            self.wait_s += time.perf_counter() - start


class ThirdBuilder(AgentBuilder):
    """The third agent behind the contract: its own items, adder, dataset and metrics; uniform replay."""

    def __init__(self, config: ThirdConfig, spec: Any):
        if not spec.discrete:
            raise ValueError("the third agent needs a discrete-action task")
        self.config, self.spec = config, spec
        self.actor_network = QNetwork(num_actions=int(spec.num_actions), layer_sizes=())  # linear
        self._optimizer = optax.adam(config.learning_rate)
        self._sgd_step = jax.jit(self._step)

    # -- data path ------------------------------------------------------------------------

    def item_signature(self) -> Dict[str, tf.TensorSpec]:
        """A one-step transition's fields plus the int32 step index."""
        observation = np.zeros((self.spec.observation_dim,), np.float32)
        return {**transition_signature(observation, self.example_action()), "step_index": tf.TensorSpec([], tf.int32)}

    def make_adder(self, client: Any, timeout_s: Optional[float], connect_timeout_s: float) -> StepAdder:
        """A StepAdder into the replay table."""
        return StepAdder(client, self.replay_config().name, self.config.discount, timeout_s)

    def make_dataset(self, address: str, rate_limiter_timeout_ms: int) -> Iterator[ReplayBatch]:
        """ReplayBatches whose data is a StepItem batch."""
        return ReplayDataset(address, self.replay_config().name, self.batch_size, with_info=True,
                             rate_limiter_timeout_ms=rate_limiter_timeout_ms, item_type=StepItem)

    # -- learner --------------------------------------------------------------------------

    def init_state(self, key: jax.Array) -> ThirdState:
        """Fresh parameters and counters."""
        params = self.actor_network.init(key, jnp.zeros((1, self.spec.observation_dim), jnp.float32))
        zero = jnp.zeros((), jnp.float32)
        return ThirdState(params, self._optimizer.init(params), jnp.zeros((), jnp.int32), zero, zero)

    def sgd_step(self, state: ThirdState, batch: ReplayBatch) -> Tuple[ThirdState, Dict[str, jnp.ndarray]]:
        """Regresses Q(o, a) on r + discount * max Q(o', .); reports the sampled step indices."""
        return self._sgd_step(state, batch)

    def _step(self, state: ThirdState, batch: ReplayBatch) -> Tuple[ThirdState, Dict[str, jnp.ndarray]]:
        data = batch.data
        target = data.reward + data.discount * jnp.max(self.actor_network.apply(state.params, data.next_observation), -1)

        def loss_fn(params: Any) -> jnp.ndarray:
            q = self.actor_network.apply(params, data.observation)
            chosen = jnp.take_along_axis(q, data.action[:, None].astype(jnp.int32), axis=1)[:, 0]
            return jnp.mean((chosen - jax.lax.stop_gradient(target)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = self._optimizer.update(grads, state.opt_state)
        index = data.step_index.astype(jnp.float32)
        index_sum, index_count = state.index_sum + jnp.sum(index), state.index_count + index.shape[0]
        new = ThirdState(optax.apply_updates(state.params, updates), opt_state, state.steps + 1, index_sum, index_count)
        return new, {"loss": loss, "step_index_running_mean": index_sum / index_count,
                     "step_index_min": jnp.min(index), "step_index_max": jnp.max(index)}

    def actor_params(self, state: ThirdState) -> Any:
        """The Q-function's parameters."""
        return state.params

    # -- actors and evaluator -------------------------------------------------------------

    def vector_behaviour_policy(self, actor_id: int, num_actors: int, envs_per_actor: int) -> Callable[..., Any]:
        """Epsilon-greedy on the linear Q-function, one key per environment."""
        epsilon = self.config.epsilon
        network = self.actor_network

        def policy(params: Any, keys: jax.Array, observations: jnp.ndarray) -> jnp.ndarray:
            greedy = jnp.argmax(network.apply(params, observations), -1).astype(jnp.int32)

            def explore(key: jax.Array, action: jnp.ndarray) -> jnp.ndarray:
                coin, pick = jax.random.split(key)
                random_action = jax.random.randint(pick, (), 0, int(self.spec.num_actions), jnp.int32)
                return jnp.where(jax.random.uniform(coin) < epsilon, random_action, action)

            return jax.vmap(explore)(keys, greedy)

        return jax.jit(policy)

    def greedy_policy(self) -> Callable[..., Any]:
        """Argmax Q."""
        network = self.actor_network
        return jax.jit(lambda params, observation: jnp.argmax(network.apply(params, observation[None])[0]).astype(jnp.int32))

    def example_action(self) -> np.ndarray:
        """An int32 scalar."""
        return np.zeros((), np.int32)


def prefix_mean_range(episode_lengths: List[int], first: int, last: int) -> Tuple[float, float]:
    """The smallest and largest mean step index over the first n items written, n from `first` to `last`.

    Items are the episodes' steps in order (0..L-1 each); past the completed episodes, the next episode's first
    steps (0, 1, ...), as an actor writes an episode under way.
    """
    indices = [i for length in episode_lengths for i in range(length)]
    indices += range(max(0, last - len(indices)))
    means = np.cumsum(indices[:last], dtype=np.float64) / np.arange(1, last + 1)
    chosen = means[first - 1:last]
    return float(chosen.min()), float(chosen.max())


ENTRY = register_agent(AgentEntry(
    name=NAME,
    config_class=ThirdConfig,
    builder=f"{MODULE}:ThirdBuilder",
    default_task="CartPole-v1",
    description="A test agent: one-step items with the env step index, a linear Q-function.",
    tiny=("--task", "CartPole-v1", "--actor_bits", "32", "--publish_period", "5", "--update_period", "50",
          "--eval_period", "100", "--checkpoint_period", "100"),
    quick=(),
))
