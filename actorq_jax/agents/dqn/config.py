"""DQN configuration (no JAX import here: entry points parse flags into it cheaply)."""

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """Hyper-parameters of DQN (double Q-learning, n-step, prioritized replay); defaults in the spirit of Acme."""

    # Network.
    q_layers: Tuple[int, ...] = (256, 256)  # hidden sizes of the Q-network MLP (the paper went up to 2048,2048,2048)
    # Learning.
    n_step: int = 5  # n of the n-step return
    discount: float = 0.99  # per-step discount gamma
    batch_size: int = 256  # transitions per SGD step
    learning_rate: float = 1e-3  # Adam step size
    max_grad_norm: float = 10.0  # global-norm gradient clipping
    huber_delta: float = 1.0  # loss: Huber with this delta on the TD error; 0 gives the plain L2 loss 0.5 * td^2
    target_update_period: int = 100  # hard target update every this many SGD steps
    # Replay (Reverb), prioritized sampling and rate limiting.
    priority_exponent: float = 0.6  # alpha: items are sampled with probability priority^alpha / sum
    importance_sampling_exponent: float = 0.2  # beta: IS weights (N * P)^-beta correct the prioritized sampling
    samples_per_insert: float = 8.0  # replay ratio (sampled items per inserted item) enforced by Reverb
    min_replay_size: int = 1000  # transitions before learning starts
    max_replay_size: int = 100_000  # FIFO capacity
    # Exploration: actor i of N uses epsilon ** (1 + epsilon_alpha * i / (N - 1)) (Ape-X); one actor uses epsilon.
    epsilon: float = 0.4  # base exploration rate (every actor's rate when epsilon_alpha is 0)
    epsilon_alpha: float = 7.0  # spread of the per-actor rates; 0 gives every actor the same epsilon

    def __post_init__(self) -> None:
        if not self.q_layers or any(int(s) != s or s < 1 for s in self.q_layers):
            raise ValueError(f"DQNConfig.q_layers must be positive integers, got {self.q_layers!r}")
        for name in ("n_step", "batch_size", "target_update_period", "min_replay_size", "max_replay_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DQNConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_replay_size > self.max_replay_size:
            raise ValueError(
                f"DQNConfig.min_replay_size ({self.min_replay_size}) must be <= max_replay_size ({self.max_replay_size})"
            )
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"DQNConfig.discount must be in (0, 1], got {self.discount}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"DQNConfig.epsilon must be in [0, 1], got {self.epsilon}")
        for name in ("learning_rate", "max_grad_norm", "samples_per_insert"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DQNConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("huber_delta", "priority_exponent", "importance_sampling_exponent", "epsilon_alpha"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DQNConfig.{name} must be >= 0, got {getattr(self, name)}")

    def actor_epsilon(self, actor_id: int, num_actors: int) -> float:
        """Exploration rate of one actor under the Ape-X spread."""
        if num_actors < 1 or not 0 <= actor_id:
            raise ValueError(f"need num_actors >= 1 and actor_id >= 0, got actor_id={actor_id}, num_actors={num_actors}")
        if num_actors == 1:
            return self.epsilon
        # Remote actors may join with ids beyond the local ones: they get the lowest rate, not a smaller one still.
        position = min(actor_id, num_actors - 1) / (num_actors - 1)
        return float(self.epsilon ** (1.0 + self.epsilon_alpha * position))
