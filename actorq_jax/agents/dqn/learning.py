"""DQN learning: the Q-network, the prioritized double-Q loss and the pure jitted SGD step."""

from typing import NamedTuple, Tuple

import chex
import jax
import jax.numpy as jnp
import optax
import rlax

from actorq_jax.agents.builder import Metrics, SgdStep
from actorq_jax.agents.dqn.config import DQNConfig
from actorq_jax.agents.dqn.networks import DQNNetworks, make_networks  # noqa: F401 (re-exported)
from actorq_jax.agents.optimizers import clipped_adam
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import QNetwork
from actorq_jax.replay import ReplayBatch, Transition


class DQNOptimizers(NamedTuple):
    """The optimizer of the Q-network."""

    q: optax.GradientTransformation


class TrainingState(NamedTuple):
    """Everything the learner updates, as one pytree (checkpointed as is)."""

    params: chex.ArrayTree
    target_params: chex.ArrayTree
    opt_state: chex.ArrayTree
    steps: jnp.ndarray  # int32 scalar: SGD steps taken


def make_optimizers(config: DQNConfig) -> DQNOptimizers:
    """Clipped Adam for the Q-network."""
    return DQNOptimizers(q=clipped_adam(config.learning_rate, config.max_grad_norm))


def init_state(config: DQNConfig, networks: DQNNetworks, spec: EnvironmentSpec, key: chex.PRNGKey) -> TrainingState:
    """Initial parameters (target equal to online) and optimiser state."""
    params = networks.q.init(key, jnp.zeros((1, spec.observation_dim), jnp.float32))
    return TrainingState(
        params=params,
        target_params=params,
        opt_state=make_optimizers(config).q.init(params),
        steps=jnp.zeros((), jnp.int32),
    )


def importance_weights(probabilities: jnp.ndarray, table_size: jnp.ndarray, exponent: float) -> jnp.ndarray:
    """Prioritized-replay correction (N * P)^-beta, normalised so the largest weight is 1."""
    weights = (table_size * probabilities) ** (-exponent)
    return weights / jnp.max(weights)


def td_errors(params: chex.ArrayTree, target_params: chex.ArrayTree, network: QNetwork, data: Transition) -> jnp.ndarray:
    """Double-Q n-step TD errors: the online net picks a', the target net values it."""
    chex.assert_rank([data.action, data.reward, data.discount], 1)
    q_tm1 = network.apply(params, data.observation)
    q_t_value = network.apply(target_params, data.next_observation)
    q_t_selector = network.apply(params, data.next_observation)
    # `discount` already holds gamma^n times the environment's discounts (replay convention), so it
    # is the bootstrap factor as is: 0 after termination, gamma^m after a truncation.
    return jax.vmap(rlax.double_q_learning)(
        q_tm1, data.action.astype(jnp.int32), data.reward, data.discount, q_t_value, q_t_selector
    )


def loss_fn(
    params: chex.ArrayTree,
    target_params: chex.ArrayTree,
    network: QNetwork,
    data: Transition,
    weights: jnp.ndarray,
    huber_delta: float,
) -> Tuple[jnp.ndarray, jnp.ndarray]:
    """Importance-weighted mean of Huber (or L2 when huber_delta is 0) TD losses; also returns the TD errors."""
    td = td_errors(params, target_params, network, data)
    chex.assert_equal_shape([td, weights])
    per_example = rlax.huber_loss(td, huber_delta) if huber_delta > 0 else rlax.l2_loss(td)
    return jnp.mean(weights * per_example), td


def make_sgd_step(config: DQNConfig, networks: DQNNetworks) -> SgdStep:
    """Returns the pure `sgd_step(state, batch) -> (state, metrics)`; metrics["priorities"] are |TD errors|."""
    optimizer = make_optimizers(config).q
    network = networks.q

    @jax.jit
    def step(
        state: TrainingState, data: Transition, probabilities: jnp.ndarray, table_size: jnp.ndarray
    ) -> Tuple[TrainingState, Metrics]:
        weights = importance_weights(probabilities, table_size, config.importance_sampling_exponent)
        (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.target_params, network, data, weights, config.huber_delta
        )
        updates, opt_state = optimizer.update(grads, state.opt_state)
        params = optax.apply_updates(state.params, updates)
        steps = state.steps + 1
        # Hard copy every target_update_period steps, counted after this update.
        target_params = optax.periodic_update(params, state.target_params, steps, config.target_update_period)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "td_abs_mean": jnp.mean(jnp.abs(td)),
            "importance_weight_mean": jnp.mean(weights),
            "priorities": jnp.abs(td),
        }
        return TrainingState(params, target_params, opt_state, steps), metrics

    def sgd_step(state: TrainingState, batch: ReplayBatch) -> Tuple[TrainingState, Metrics]:
        # Only the numeric parts enter jit: the uint64 item keys stay with the learner for the write-back.
        # jnp rather than np casts, so the step also traces under an outer jit (multi_sgd_step's scan).
        probabilities = jnp.asarray(batch.probabilities, jnp.float32)
        table_size = jnp.asarray(batch.table_size, jnp.float32)
        return step(state, batch.data, probabilities, table_size)

    return sgd_step
