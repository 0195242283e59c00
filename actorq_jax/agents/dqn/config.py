"""DQN configuration (no JAX import here: entry points parse flags into it cheaply)."""

import dataclasses
from typing import Tuple

from actorq_jax.config import (
    AgentConfig,
    actor_position,
    check,
    check_ints,
    check_layers,
    check_non_negative,
    check_positive,
    documented,
)


@dataclasses.dataclass(frozen=True)
class DQNConfig(AgentConfig):
    """Hyper-parameters of DQN (double Q-learning, prioritized replay) beside AgentConfig's; in the spirit of Acme.

    Every field is a flag; samples_per_insert and max_replay_size have DQN's own defaults.
    """

    # Network.
    q_layers: Tuple[int, ...] = documented((256, 256), "hidden sizes of the Q-network MLP (comma list; the paper went to 2048x3)")
    # Learning.
    learning_rate: float = documented(1e-3, "Adam step size")
    max_grad_norm: float = documented(10.0, "global-norm gradient clipping")
    huber_delta: float = documented(1.0, "Huber loss delta on the TD error; 0 gives the plain L2 loss 0.5 * td^2")
    target_update_period: int = documented(100, "hard target update every this many SGD steps")
    # Replay (Reverb): prioritized sampling, and DQN's own defaults for the ratio and capacity.
    priority_exponent: float = documented(0.6, "alpha: items are sampled with probability priority^alpha / sum")
    importance_sampling_exponent: float = documented(0.2, "beta: IS weights (N * P)^-beta correct the prioritized sampling")
    samples_per_insert: float = documented(8.0, "replay ratio enforced by Reverb's rate limiter (rate_limiter ratio)")
    max_replay_size: int = documented(100_000, "FIFO capacity of the replay table")
    # Exploration: actor i of N uses epsilon ** (1 + epsilon_alpha * i / (N - 1)) (Ape-X); one actor uses epsilon.
    epsilon: float = documented(0.4, "base exploration rate (every actor's rate when epsilon_alpha is 0)")
    epsilon_alpha: float = documented(7.0, "Ape-X spread: actor i of N uses epsilon ** (1 + alpha * i / (N - 1))")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layers(self, ("q_layers",))
        check_ints(self, ("target_update_period",))
        check(0.0 <= self.epsilon <= 1.0, self, "epsilon", "must be in [0, 1]")
        check_positive(self, ("learning_rate", "max_grad_norm"))
        check_non_negative(self, ("huber_delta", "priority_exponent", "importance_sampling_exponent", "epsilon_alpha"))

    def actor_epsilon(self, actor_id: int, num_actors: int) -> float:
        """Exploration rate of one actor under the Ape-X spread."""
        return float(self.epsilon ** (1.0 + self.epsilon_alpha * actor_position(actor_id, num_actors)))
