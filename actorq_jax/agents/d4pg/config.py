"""D4PG configuration (no JAX import here: entry points parse flags into it cheaply)."""

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
class D4PGConfig(AgentConfig):
    """Hyper-parameters of D4PG (beside AgentConfig's n-step and replay fields); Acme's defaults where they apply.

    Every field is a flag.
    """

    # Networks.
    policy_layers: Tuple[int, ...] = documented((256, 256, 256), "hidden sizes of the policy MLP (comma list)")
    critic_layers: Tuple[int, ...] = documented((512, 512, 256), "hidden sizes of the critic LayerNorm-MLP (comma list)")
    policy_layer_norm: bool = documented(True, "LayerNorm-MLP policy torso (false: plain ReLU MLP)")
    num_atoms: int = documented(51, "atoms of the categorical value distribution (>= 2)")
    v_min: float = documented(-150.0, "lowest value atom")
    v_max: float = documented(150.0, "highest value atom")
    # Learning.
    policy_learning_rate: float = documented(1e-4, "Adam step size of the policy")
    critic_learning_rate: float = documented(1e-4, "Adam step size of the critic")
    max_grad_norm: float = documented(40.0, "global-norm gradient clipping, per network")
    target_update_period: int = documented(100, "hard target update every this many SGD steps")
    # Exploration.
    sigma: float = documented(0.3, "std of the Gaussian exploration noise (in action units)")
    sigma_spread: float = documented(0.0, "actor i of N gets sigma * (1 + spread * (i / (N - 1) - 0.5)); 0: all alike")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layers(self, ("policy_layers", "critic_layers"))
        check_ints(self, ("target_update_period",))
        check_ints(self, ("num_atoms",), minimum=2)
        check(self.v_min < self.v_max, self, "v_min", f"must be < v_max ({self.v_max})")
        check_positive(self, ("policy_learning_rate", "critic_learning_rate", "max_grad_norm"))
        check_non_negative(self, ("sigma",))
        # A spread beyond 2 would give the first actor a negative sigma.
        check(0.0 <= self.sigma_spread <= 2.0, self, "sigma_spread", "must be in [0, 2]")

    def actor_sigma(self, actor_id: int, num_actors: int) -> float:
        """Exploration noise of one actor under the configured per-actor spread."""
        position = actor_position(actor_id, num_actors)  # validates the ids; remote ids act as the last actor
        if num_actors == 1:
            return self.sigma
        return self.sigma * (1.0 + self.sigma_spread * (position - 0.5))
