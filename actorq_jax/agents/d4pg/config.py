"""D4PG configuration (no JAX import here: entry points parse flags into it cheaply)."""

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class D4PGConfig:
    """Hyper-parameters of D4PG; defaults follow Acme's D4PG where they apply."""

    # Networks.
    policy_layers: Tuple[int, ...] = (256, 256, 256)  # hidden sizes of the policy MLP
    critic_layers: Tuple[int, ...] = (512, 512, 256)  # hidden sizes of the critic LayerNorm-MLP
    policy_layer_norm: bool = True  # LayerNorm-MLP policy torso (False: plain ReLU MLP)
    num_atoms: int = 51  # atoms of the categorical value distribution
    v_min: float = -150.0  # lowest value atom
    v_max: float = 150.0  # highest value atom
    # Learning.
    n_step: int = 5  # n of the n-step return
    discount: float = 0.99  # per-step discount gamma
    batch_size: int = 256  # transitions per SGD step
    policy_learning_rate: float = 1e-4  # Adam step size of the policy
    critic_learning_rate: float = 1e-4  # Adam step size of the critic
    max_grad_norm: float = 40.0  # global-norm gradient clipping, per network
    target_update_period: int = 100  # hard target update every this many SGD steps
    # Replay (Reverb) and rate limiting.
    samples_per_insert: float = 32.0  # replay ratio enforced by Reverb's rate limiter
    min_replay_size: int = 1000  # transitions before learning starts
    max_replay_size: int = 1_000_000  # FIFO capacity
    # Exploration.
    sigma: float = 0.3  # std of the Gaussian exploration noise (in action units)
    sigma_spread: float = 0.0  # actor i of N gets sigma * (1 + spread * (i / (N - 1) - 0.5))

    def __post_init__(self) -> None:
        for name in ("n_step", "batch_size", "target_update_period", "num_atoms", "min_replay_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"D4PGConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"D4PGConfig.discount must be in (0, 1], got {self.discount}")
        if not self.v_min < self.v_max:
            raise ValueError(f"D4PGConfig needs v_min < v_max, got {self.v_min}, {self.v_max}")
        if self.sigma < 0 or self.samples_per_insert <= 0:
            raise ValueError("D4PGConfig.sigma must be >= 0 and samples_per_insert > 0")

    def actor_sigma(self, actor_id: int, num_actors: int) -> float:
        """Exploration noise of one actor under the configured per-actor spread."""
        if num_actors <= 1 or self.sigma_spread == 0.0:
            return self.sigma
        return self.sigma * (1.0 + self.sigma_spread * (actor_id / (num_actors - 1) - 0.5))
