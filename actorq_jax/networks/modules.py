"""Network modules for D4PG (policy, distributional critic) and DQN (Q-network)."""

from typing import Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from actorq_jax import kernels
from actorq_jax.networks.layers import Dense, activation_fn


class MLP(nn.Module):
    """Multi-layer perceptron; with layer_norm the first layer is Dense -> LayerNorm -> tanh (Acme's LayerNormMLP)."""

    layer_sizes: Sequence[int]
    activation: str = "relu"
    layer_norm: bool = False
    activate_final: bool = True
    fuse_int8: bool = True  # int8 params: the whole torso as one kernel call (same numbers as layer by layer)

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        activation_fn(self.activation)  # fails early, naming a bad activation
        if self.fuse_int8 and self._all_int8():
            # One FFI call per forward: per-layer calls cost XLA dispatch and fusions between them.
            return kernels.int8_mlp(x, self._int8_layers())
        for i, size in enumerate(self.layer_sizes):
            if i == 0 and self.layer_norm:
                # Normalising the first layer keeps the scale of raw observations out of the rest.
                x = Dense(size, name=f"Dense_{i}")(x)
                norm = nn.LayerNorm(name="LayerNorm_0")
                if self._runs_int8_kernels():
                    # Same math as one kernel call: XLA's fusions between int8 calls cost more than the layer.
                    p = self.variables["params"]["LayerNorm_0"]
                    x = kernels.layer_norm(x, p["scale"], p["bias"], epsilon=norm.epsilon, activation="tanh")
                else:
                    x = jnp.tanh(norm(x))
            else:
                # The activation goes into the layer, where the int8 kernel fuses it.
                x = Dense(size, activation=self._layer_activation(i), name=f"Dense_{i}")(x)
        return x

    def _layer_activation(self, i: int) -> Optional[str]:
        """The activation after Dense_i (None after a final layer that is not activated)."""
        return self.activation if i < len(self.layer_sizes) - 1 or self.activate_final else None

    def _all_int8(self) -> bool:
        """Whether every Dense kernel is packed for the int8 kernel and has a bias (what int8_mlp runs)."""
        params = self.variables.get("params", {})
        return all(isinstance(params.get(f"Dense_{i}", {}).get("kernel"), kernels.Int8DenseWeight)
                   and params[f"Dense_{i}"].get("bias") is not None for i in range(len(self.layer_sizes)))

    def _int8_layers(self) -> list:
        """The torso as int8_mlp layers, read from the same parameter tree the float path uses."""
        params = self.variables["params"]
        layers = []
        for i in range(len(self.layer_sizes)):
            p = params[f"Dense_{i}"]
            if i == 0 and self.layer_norm:
                norm = params["LayerNorm_0"]
                layers += [kernels.MlpDense(p["kernel"], p["bias"]),
                           kernels.MlpLayerNorm(norm["scale"], norm["bias"], nn.LayerNorm.epsilon, "tanh")]
            else:
                layers.append(kernels.MlpDense(p["kernel"], p["bias"], self._layer_activation(i)))
        return layers

    def _runs_int8_kernels(self) -> bool:
        """Whether the first layer's weights are packed for the int8 kernel (an int8 actor's params)."""
        first = self.variables.get("params", {}).get("Dense_0", {})
        return isinstance(first.get("kernel"), kernels.Int8DenseWeight)


class PolicyNetwork(nn.Module):
    """Deterministic D4PG policy: MLP torso, a near-zero-initialised head, tanh squashed to the action bounds."""

    action_dim: int
    layer_sizes: Sequence[int] = (256, 256, 256)
    layer_norm: bool = False
    activation: str = "relu"
    action_minimum: Optional[Tuple[float, ...]] = None
    action_maximum: Optional[Tuple[float, ...]] = None

    @nn.compact
    def __call__(self, observation: jnp.ndarray) -> jnp.ndarray:
        x = MLP(self.layer_sizes, self.activation, self.layer_norm, name="torso")(observation)
        # A tiny head keeps the initial policy near the centre of the action range (as in Acme).
        head_init = nn.initializers.variance_scaling(1e-4, "fan_in", "uniform")
        x = Dense(self.action_dim, kernel_init=head_init, activation="tanh", name="head")(x)
        if self.action_minimum is None or self.action_maximum is None:
            return x
        low = jnp.asarray(self.action_minimum, jnp.float32)
        high = jnp.asarray(self.action_maximum, jnp.float32)
        return low + (x + 1.0) * 0.5 * (high - low)


class CriticNetwork(nn.Module):
    """Distributional D4PG critic: LayerNorm-MLP over (observation, action) -> logits over value atoms."""

    layer_sizes: Sequence[int] = (512, 512, 256)
    num_atoms: int = 51
    layer_norm: bool = True
    activation: str = "elu"

    @nn.compact
    def __call__(self, observation: jnp.ndarray, action: jnp.ndarray) -> jnp.ndarray:
        x = jnp.concatenate([observation, action.astype(observation.dtype)], axis=-1)
        x = MLP(self.layer_sizes, self.activation, self.layer_norm, name="torso")(x)
        return Dense(self.num_atoms, name="head")(x)


class QNetwork(nn.Module):
    """DQN Q-network: MLP torso -> one value per discrete action."""

    num_actions: int
    layer_sizes: Sequence[int] = (256, 256)
    activation: str = "relu"
    layer_norm: bool = False

    @nn.compact
    def __call__(self, observation: jnp.ndarray) -> jnp.ndarray:
        x = MLP(self.layer_sizes, self.activation, self.layer_norm, name="torso")(observation)
        return Dense(self.num_actions, name="head")(x)


def value_atoms(v_min: float, v_max: float, num_atoms: int) -> jnp.ndarray:
    """The support of the critic's categorical distribution."""
    if num_atoms < 2 or not v_min < v_max:
        raise ValueError(f"need num_atoms >= 2 and v_min < v_max, got {num_atoms}, [{v_min}, {v_max}]")
    return jnp.linspace(v_min, v_max, num_atoms, dtype=jnp.float32)


def categorical_mean(logits: jnp.ndarray, atoms: jnp.ndarray) -> jnp.ndarray:
    """Expected value of a categorical distribution over atoms given its logits."""
    return jnp.sum(jax.nn.softmax(logits, axis=-1) * atoms, axis=-1)
