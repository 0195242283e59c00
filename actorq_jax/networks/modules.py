"""Network modules for D4PG (policy, distributional critic) and DQN (Q-network)."""

from typing import Any, Optional, Sequence, Tuple

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
        layers = _int8_torso_layers(self.variables.get("params", {}), self) if self.fuse_int8 else None
        if layers is not None:
            # One FFI call per forward: per-layer calls cost XLA dispatch and fusions between them.
            return kernels.int8_mlp(x, layers)
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

    def _runs_int8_kernels(self) -> bool:
        """Whether the first layer's weights are packed for the int8 kernel (an int8 actor's params)."""
        first = self.variables.get("params", {}).get("Dense_0", {})
        return isinstance(first.get("kernel"), kernels.Int8DenseWeight)


def _is_int8_dense(params: Any) -> bool:
    return isinstance(params.get("kernel"), kernels.Int8DenseWeight) and params.get("bias") is not None


def _int8_torso_layers(params: Any, mlp: MLP) -> Optional[list]:
    """``mlp`` as int8_mlp layers read from its parameters, or None unless every Dense is packed int8 with a bias."""
    dense = [params.get(f"Dense_{i}", {}) for i in range(len(mlp.layer_sizes))]
    if not dense or not all(_is_int8_dense(p) for p in dense):
        return None  # no hidden layers (nothing to fuse), or float / quantized weights
    layers = []
    for i, p in enumerate(dense):
        if i == 0 and mlp.layer_norm:
            norm = params["LayerNorm_0"]
            layers += [kernels.MlpDense(p["kernel"], p["bias"]),
                       kernels.MlpLayerNorm(norm["scale"], norm["bias"], nn.LayerNorm.epsilon, "tanh")]
        else:
            layers.append(kernels.MlpDense(p["kernel"], p["bias"], mlp._layer_activation(i)))
    return layers


def _fused_int8_forward(
    module: nn.Module, torso: MLP, x: jnp.ndarray, head_activation: Optional[str]
) -> Optional[jnp.ndarray]:
    """Torso and head as one int8_mlp call when all their Dense kernels are packed int8, else None."""
    params = module.variables.get("params", {})
    layers = _int8_torso_layers(params.get("torso", {}), torso) if torso.fuse_int8 else None
    head = params.get("head", {})
    if layers is None or not _is_int8_dense(head):
        return None
    return kernels.int8_mlp(x, layers + [kernels.MlpDense(head["kernel"], head["bias"], head_activation)])


class PolicyNetwork(nn.Module):
    """Deterministic D4PG policy: MLP torso, a near-zero-initialised head, tanh squashed to the action bounds."""

    action_dim: int
    layer_sizes: Sequence[int] = (256, 256, 256)
    layer_norm: bool = False
    activation: str = "relu"
    action_minimum: Optional[Tuple[float, ...]] = None
    action_maximum: Optional[Tuple[float, ...]] = None
    fuse_int8: bool = True  # int8 params: torso and head as one kernel call

    @nn.compact
    def __call__(self, observation: jnp.ndarray) -> jnp.ndarray:
        torso = MLP(self.layer_sizes, self.activation, self.layer_norm, fuse_int8=self.fuse_int8, name="torso")
        x = _fused_int8_forward(self, torso, observation, "tanh")
        if x is None:
            x = torso(observation)
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
    fuse_int8: bool = True  # int8 params: torso and head as one kernel call

    @nn.compact
    def __call__(self, observation: jnp.ndarray) -> jnp.ndarray:
        torso = MLP(self.layer_sizes, self.activation, self.layer_norm, fuse_int8=self.fuse_int8, name="torso")
        x = _fused_int8_forward(self, torso, observation, None)
        if x is None:
            x = Dense(self.num_actions, name="head")(torso(observation))
        return x


def value_atoms(v_min: float, v_max: float, num_atoms: int) -> jnp.ndarray:
    """The support of the critic's categorical distribution."""
    if num_atoms < 2 or not v_min < v_max:
        raise ValueError(f"need num_atoms >= 2 and v_min < v_max, got {num_atoms}, [{v_min}, {v_max}]")
    return jnp.linspace(v_min, v_max, num_atoms, dtype=jnp.float32)


def categorical_mean(logits: jnp.ndarray, atoms: jnp.ndarray) -> jnp.ndarray:
    """Expected value of a categorical distribution over atoms given its logits."""
    return jnp.sum(jax.nn.softmax(logits, axis=-1) * atoms, axis=-1)
