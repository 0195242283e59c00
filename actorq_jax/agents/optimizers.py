"""The optimizer every agent's networks use."""

import optax


def clipped_adam(learning_rate: float, max_grad_norm: float) -> optax.GradientTransformation:
    """Adam behind global-norm gradient clipping."""
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))
