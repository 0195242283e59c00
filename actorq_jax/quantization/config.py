"""QuantConfig: how a parameter tree is turned into a quantized one."""

from __future__ import annotations

import dataclasses

INT_BITS = tuple(range(2, 9))  # integer quantization, values stored in int8
HALF_BITS = 16  # half precision (fp16 or bf16)
FLOAT_BITS = 32  # no quantization
VALID_BITS = INT_BITS + (HALF_BITS, FLOAT_BITS)
GRANULARITIES = ("per_channel", "per_tensor")
HALVES = ("bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Static, hashable description of a quantization (safe as a jit static arg).

    Fields:
      bits: 2..8 -> integer quantization, values stored in int8 (bit-packed on the
        wire below 8 bits); 16 -> half precision (see ``half``); 32 -> no
        quantization (every floating leaf is float32).
      granularity: "per_channel" -> one scale per output channel, i.e. per index
        of the LAST axis of a kernel (Dense ``[K, N]`` -> ``N`` scales; Conv
        ``[H, W, C_in, C_out]`` -> ``C_out`` scales); "per_tensor" -> one scale.
      symmetric: True -> q = clip(round(w / s), -(2^(b-1)-1), 2^(b-1)-1) with
        s = max|w| * float32(1 / (2^(b-1)-1)) and no zero point (0.0 is exact);
        False -> affine over the full range [-2^(b-1), 2^(b-1)-1]:
        lo = min(min(w), 0), hi = max(max(w), 0) (so 0.0 stays exact),
        s = (hi - lo) * float32(1 / (2^b - 1)),
        zero_point = clip(-2^(b-1) - round(lo / s), -2^(b-1), 2^(b-1)-1),
        q = clip(round(w / s) + zero_point, -2^(b-1), 2^(b-1)-1).
        Both: w ~= (q - zero_point) * s, |error| <= s / 2 elementwise; round is
        half-to-even; a scale below the smallest normal float32 (all-zero or
        denormal channel) is replaced by 1.0, so nothing divides by zero.
      half: "bf16" or "fp16", the half type used when bits == 16.
      min_size: kernels with fewer elements stay float32.

    Which leaves are quantized (the rule): a leaf is quantized iff it has a
    floating dtype, ``ndim >= 2`` (Dense/Conv kernels) and ``size >= min_size``
    (and is not empty).
    Everything else -- biases, LayerNorm scale/bias, small kernels, non-floating
    leaves -- stays float32 (non-floating leaves are passed through untouched).
    """

    bits: int = 8
    granularity: str = "per_channel"
    symmetric: bool = True
    half: str = "bf16"
    min_size: int = 1024

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in VALID_BITS:
            raise ValueError(
                f"QuantConfig.bits must be an int in 2..8 (integer), 16 (half) or 32 (float), "
                f"got bits={self.bits!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"QuantConfig.granularity must be one of {GRANULARITIES}, "
                f"got granularity={self.granularity!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantConfig.symmetric must be a bool, got symmetric={self.symmetric!r}")
        if self.half not in HALVES:
            raise ValueError(f"QuantConfig.half must be one of {HALVES}, got half={self.half!r}")
        if (isinstance(self.min_size, bool) or not isinstance(self.min_size, int)
                or self.min_size < 0):
            raise ValueError(
                f"QuantConfig.min_size must be a non-negative int, got min_size={self.min_size!r}")

    @property
    def is_half(self) -> bool:
        return self.bits == HALF_BITS

    @property
    def is_float(self) -> bool:
        return self.bits == FLOAT_BITS
