"""D4PG learning: networks, losses and the pure jitted SGD step."""

from typing import NamedTuple, Tuple

import chex
import jax
import jax.numpy as jnp
import optax
import rlax

from actorq_jax.agents.builder import Metrics, SgdStep
from actorq_jax.agents.d4pg.config import D4PGConfig
from actorq_jax.agents.d4pg.networks import D4PGNetworks, make_networks  # noqa: F401 (re-exported)
from actorq_jax.agents.optimizers import clipped_adam
from actorq_jax.environments import EnvironmentSpec
from actorq_jax.networks import categorical_mean
from actorq_jax.replay import ReplayBatch, Transition


class TrainingState(NamedTuple):
    """Everything the learner updates, as one pytree (checkpointed as is)."""

    policy_params: chex.ArrayTree
    critic_params: chex.ArrayTree
    target_policy_params: chex.ArrayTree
    target_critic_params: chex.ArrayTree
    policy_opt_state: chex.ArrayTree
    critic_opt_state: chex.ArrayTree
    steps: jnp.ndarray  # int32 scalar: SGD steps taken


class D4PGOptimizers(NamedTuple):
    """One optimizer per network."""

    policy: optax.GradientTransformation
    critic: optax.GradientTransformation


def make_optimizers(config: D4PGConfig) -> D4PGOptimizers:
    """Clipped Adam for the policy and for the critic."""
    return D4PGOptimizers(
        policy=clipped_adam(config.policy_learning_rate, config.max_grad_norm),
        critic=clipped_adam(config.critic_learning_rate, config.max_grad_norm),
    )


def init_state(config: D4PGConfig, networks: D4PGNetworks, spec: EnvironmentSpec, key: chex.PRNGKey) -> TrainingState:
    """Initial parameters (targets equal to online) and optimiser states."""
    policy_key, critic_key = jax.random.split(key)
    obs = jnp.zeros((1, spec.observation_dim), jnp.float32)
    act = jnp.zeros((1, spec.action_dim), jnp.float32)
    policy_params = networks.policy.init(policy_key, obs)
    critic_params = networks.critic.init(critic_key, obs, act)
    optimizers = make_optimizers(config)
    return TrainingState(
        policy_params=policy_params,
        critic_params=critic_params,
        target_policy_params=policy_params,
        target_critic_params=critic_params,
        policy_opt_state=optimizers.policy.init(policy_params),
        critic_opt_state=optimizers.critic.init(critic_params),
        steps=jnp.zeros((), jnp.int32),
    )


def critic_loss(
    critic_params: chex.ArrayTree,
    target_critic_params: chex.ArrayTree,
    target_policy_params: chex.ArrayTree,
    networks: D4PGNetworks,
    batch: Transition,
) -> jnp.ndarray:
    """Distributional TD loss: cross-entropy to the projected n-step target distribution."""
    chex.assert_rank([batch.reward, batch.discount], 1)
    logits_tm1 = networks.critic.apply(critic_params, batch.observation, batch.action)
    next_action = networks.policy.apply(target_policy_params, batch.next_observation)
    logits_t = networks.critic.apply(target_critic_params, batch.next_observation, next_action)
    # rlax.categorical_td_learning in its two parts, the same target and loss. Its projection builds an
    # [atoms, atoms] weight matrix per example; fused into the loss, XLA:CPU recomputes that matrix for each
    # consumer of the target (3% of the step at 256x3); held apart by the barrier it is computed once.
    target = jax.lax.optimization_barrier(jax.lax.stop_gradient(projected_targets(networks.atoms, batch, logits_t)))
    return jnp.mean(jax.vmap(rlax.categorical_cross_entropy)(target, logits_tm1))


def projected_targets(atoms: jnp.ndarray, batch: Transition, logits_t: jnp.ndarray) -> jnp.ndarray:
    """The n-step target distributions r + discount * z under softmax(logits_t), projected onto `atoms`."""
    # `discount` already holds gamma^n times the environment's discounts (replay convention).
    def one(reward: jnp.ndarray, discount: jnp.ndarray, logits: jnp.ndarray) -> jnp.ndarray:
        return rlax.categorical_l2_project(reward + discount * atoms, jax.nn.softmax(logits), atoms)

    return jax.vmap(one)(batch.reward, batch.discount, logits_t)


def policy_loss(
    policy_params: chex.ArrayTree, critic_params: chex.ArrayTree, networks: D4PGNetworks, observation: jnp.ndarray
) -> jnp.ndarray:
    """Deterministic policy gradient through the critic's mean value."""
    action = networks.policy.apply(policy_params, observation)

    def total_value(a: jnp.ndarray) -> jnp.ndarray:
        return jnp.sum(categorical_mean(networks.critic.apply(critic_params, observation, a), networks.atoms))

    # Rows are independent, so the gradient of the batch sum is each row's dQ/da.
    # dpg_loss treats dQ/da as a constant target, but it stops the gradient with lax.select, whose
    # derivative runs through both branches: without this stop_gradient the policy gradient also
    # computes a Hessian-vector product through the critic (a fifth of the step's FLOPs at 256x3)
    # only to multiply it by zero. The gradient is the same either way.
    dqda = jax.lax.stop_gradient(jax.grad(total_value)(action))
    per_example = jax.vmap(rlax.dpg_loss)(action, dqda)
    return jnp.mean(jnp.sum(per_example, axis=-1))


def make_sgd_step(config: D4PGConfig, networks: D4PGNetworks) -> SgdStep:
    """Returns the pure `sgd_step(state, batch) -> (state, metrics)` (jitted on the transitions)."""
    optimizers = make_optimizers(config)

    @jax.jit
    def step(state: TrainingState, batch: Transition) -> Tuple[TrainingState, Metrics]:
        c_loss, c_grads = jax.value_and_grad(critic_loss)(
            state.critic_params, state.target_critic_params, state.target_policy_params, networks, batch
        )
        p_loss, p_grads = jax.value_and_grad(policy_loss)(
            state.policy_params, state.critic_params, networks, batch.observation
        )
        c_updates, critic_opt_state = optimizers.critic.update(c_grads, state.critic_opt_state)
        p_updates, policy_opt_state = optimizers.policy.update(p_grads, state.policy_opt_state)
        critic_params = optax.apply_updates(state.critic_params, c_updates)
        policy_params = optax.apply_updates(state.policy_params, p_updates)
        steps = state.steps + 1
        # Hard copy every target_update_period steps, counted after this update.
        target_critic = optax.periodic_update(critic_params, state.target_critic_params, steps, config.target_update_period)
        target_policy = optax.periodic_update(policy_params, state.target_policy_params, steps, config.target_update_period)
        new_state = TrainingState(
            policy_params=policy_params,
            critic_params=critic_params,
            target_policy_params=target_policy,
            target_critic_params=target_critic,
            policy_opt_state=policy_opt_state,
            critic_opt_state=critic_opt_state,
            steps=steps,
        )
        metrics = {
            "critic_loss": c_loss,
            "policy_loss": p_loss,
            "critic_grad_norm": optax.global_norm(c_grads),
            "policy_grad_norm": optax.global_norm(p_grads),
        }
        return new_state, metrics

    def sgd_step(state: TrainingState, batch: ReplayBatch) -> Tuple[TrainingState, Metrics]:
        # Uniform replay: only the transitions enter jit, the sampling info is not needed.
        return step(state, batch.data)

    return sgd_step
