"""Int8 dense kernels: every instruction-set path against the pure-jnp reference of the same math."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launch_support import ROOT

from actorq_jax import kernels
from actorq_jax.kernels import (
    Int8DenseWeight,
    _library,
    int8_dense,
    pack_dense,
    pack_params,
    reference_int8_dense,
)

# Without a compiler the package falls back to the jnp reference: tests of the
# compiled kernel skip (test_kernel_is_built says why, and fails where
# ACTORQ_REQUIRE_KERNEL=1, as scripts/test.sh sets), the reference tests run.
needs_kernel = pytest.mark.skipif(not kernels.kernel_available(), reason=kernels.describe_kernel())

SIMD_PATHS = [p for p in ("avx2", "avx512", "amx") if _library.path_supported(p)]
KERNEL_PATHS = ["scalar"] + SIMD_PATHS

# The AMX path runs only where the CPU has AMX-INT8 and the OS grants the tile state; with
# ACTORQ_REQUIRE_AMX=1 (set it on such a machine) its absence fails instead of skipping.
_AMX_MISSING = f"no AMX-INT8 path here ({kernels.describe_kernel()})"
needs_amx = pytest.mark.skipif(not _library.path_supported("amx") and os.environ.get("ACTORQ_REQUIRE_AMX") != "1",
                               reason=_AMX_MISSING)

# (batch, K, N): sizes on and off multiples of 4, 8, 16 and 32, batch 1..64.
SHAPES = [
    (1, 24, 256),
    (1, 1, 1),
    (2, 3, 5),
    (3, 37, 45),
    (5, 64, 16),
    (7, 100, 17),
    (8, 255, 33),
    (13, 130, 129),
    (31, 33, 64),
    (64, 96, 48),
    (64, 250, 7),
    # Multi-panel tiles: several full 16-column panels plus a narrow one, batches 8-64.
    (8, 130, 100),
    (16, 64, 200),
    (32, 257, 70),
    (48, 40, 130),
    (64, 200, 96),
]


def _case(rng, batch, K, N, mode, low=-127):
    values = rng.integers(low, 128, size=(K, N)).astype(np.int8)
    scale = rng.uniform(1e-3, 2e-2, size=N).astype(np.float32)
    bias = rng.normal(size=N).astype(np.float32)
    x = rng.normal(size=(batch, K)).astype(np.float32)
    return x, pack_dense(values, scale, mode), bias, values, scale


def _max_rel_err(y, ref):
    y, ref = np.asarray(y), np.asarray(ref)
    return float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


# The reference's jnp math compiled once per shape, instead of each of its operations compiled eagerly per shape.
_reference = jax.jit(reference_int8_dense, static_argnames="activation")


def test_pack_roundtrip_and_exact_size():
    rng = np.random.default_rng(0)
    for K, N in [(1, 1), (3, 17), (4, 16), (5, 33), (37, 45)]:
        values = rng.integers(-128, 128, size=(K, N)).astype(np.int8)
        for mode in ("w8a32", "w8a8"):
            w = pack_dense(values, np.float32(0.5), mode)
            assert w.packed.shape == (K, N) and w.packed.dtype == jnp.int8
            np.testing.assert_array_equal(np.asarray(w.unpack()), values)
            np.testing.assert_array_equal(np.asarray(w.scale), np.full(N, 0.5, np.float32))
            assert int(np.asarray(w.colsum)[:N].sum()) == int(values.astype(np.int64).sum())
            if N % 16:
                # The layout really is panel-major, not the plain row-major input.
                assert K == 1 or N < 16 or not np.array_equal(np.asarray(w.packed), values)


@needs_kernel
def test_c_packing_equals_numpy_packing():
    from actorq_jax.kernels import dense

    rng = np.random.default_rng(13)
    for K, N in [(1, 1), (3, 17), (4, 16), (5, 33), (37, 45), (64, 250), (130, 129)]:
        values = rng.integers(-128, 128, size=(K, N)).astype(np.int8)
        for mode in ("w8a32", "w8a8", "w4a8"):
            v = np.clip(values, -8, 7) if mode == "w4a8" else values
            packed, colsum = dense._pack_panels(v, mode)  # the library's one-pass repack
            numpy_packed = dense._to_nibbles(v) if mode == "w4a8" else dense._to_panels(v, mode)
            np.testing.assert_array_equal(packed, numpy_packed.reshape(-1), err_msg=f"{mode} {(K, N)}")
            np.testing.assert_array_equal(colsum, dense._column_sums(v))


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_w8a32_matches_reference(path):
    rng = np.random.default_rng(1)
    fn = jax.jit(lambda x, w, b: int8_dense(x, w, b, path=path))
    for batch, K, N in SHAPES:
        x, w, bias, values, scale = _case(rng, batch, K, N, "w8a32", low=-128)
        y = fn(x, w, bias)
        assert y.shape == (batch, N) and y.dtype == jnp.float32
        # The reference itself is the math: x @ (Wq * scale) + b.
        exact = x.astype(np.float64) @ (values.astype(np.float64) * scale) + bias
        assert _max_rel_err(_reference(x, w, bias), exact) < 1e-5
        assert _max_rel_err(y, _reference(x, w, bias)) < 1e-5, (path, batch, K, N)


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_w8a8_matches_reference(path):
    rng = np.random.default_rng(2)
    fn = jax.jit(lambda x, w, b: int8_dense(x, w, b, path=path))
    for batch, K, N in SHAPES:
        # -128 weights included: the AVX2 sign trick must still be exact.
        x, w, bias, values, scale = _case(rng, batch, K, N, "w8a8", low=-128)
        x[0, :] = 0.0  # an all-zero row (row scale 0) must give the bias
        ref = np.asarray(_reference(x, w, bias))
        y = np.asarray(fn(x, w, bias))
        np.testing.assert_array_equal(y[0], bias)
        assert _max_rel_err(y, ref) < 1e-5, (path, batch, K, N)
        # W8A8 = W8A32 math up to activation rounding (half a step of 1/127 per row).
        w32 = pack_dense(values, scale, "w8a32")
        assert _max_rel_err(y, _reference(x, w32, bias)) < 0.05


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_w4a8_matches_reference_and_equals_w8a8(path):
    rng = np.random.default_rng(14)
    fn = jax.jit(lambda x, w, b: int8_dense(x, w, b, path=path))
    for batch, K, N in SHAPES + [(1, 2048, 6)]:
        values = rng.integers(-8, 8, size=(K, N)).astype(np.int8)
        scale = rng.uniform(1e-3, 2e-2, size=N).astype(np.float32)
        bias = rng.normal(size=N).astype(np.float32)
        x = rng.normal(size=(batch, K)).astype(np.float32)
        x[0, :] = 0.0  # an all-zero row must give the bias
        w4 = pack_dense(values, scale, "w4a8")
        assert w4.packed.dtype == jnp.int8 and w4.packed.shape == (-(-K // 8) * 4, -(-N // 16) * 16)
        np.testing.assert_array_equal(np.asarray(w4.unpack()), values)
        y = np.asarray(fn(x, w4, bias))
        np.testing.assert_array_equal(y[0], bias)
        assert _max_rel_err(y, _reference(x, w4, bias)) < 1e-5, (path, batch, K, N)
        # The same integers as W8A8 on the same weights: identical outputs on the same path.
        np.testing.assert_array_equal(y, np.asarray(fn(x, pack_dense(values, scale, "w8a8"), bias)))


def test_w4a8_refuses_values_beyond_four_bits():
    values = np.full((8, 16), 7, np.int8)
    values[3, 5] = 9
    with pytest.raises(ValueError, match=r"\[-8, 7\], got \[7, 9\]"):
        pack_dense(values, np.ones(16, np.float32), "w4a8")


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("mode", ["w8a32", "w8a8", "w4a8"])
def test_fused_activations_match_reference(path, mode):
    rng = np.random.default_rng(10)
    for activation in ("relu", "elu", "tanh"):
        fn = jax.jit(functools.partial(int8_dense, path=path, activation=activation))
        for batch, K, N in SHAPES[::2] + [(1, 2048, 6), (3, 64, 70)]:
            x, w, bias, values, scale = _case(rng, batch, K, N, "w8a8" if mode == "w4a8" else mode)
            if mode == "w4a8":
                w = pack_dense(np.clip(values, -8, 7), scale, "w4a8")
            # Pre-activations from about -50 to 50, and many near 0 (where elu and tanh bend).
            bias = (bias * np.where(np.arange(N) % 2 == 0, 20.0, 0.01)).astype(np.float32)
            ref = np.asarray(_reference(x, w, bias, activation))
            y = np.asarray(fn(x, w, bias))
            assert y.shape == ref.shape
            # All three are 1-Lipschitz: the matmul's tolerance carries over, plus the
            # kernel's exp approximation (about 1e-7).
            pre_scale = float(np.abs(_reference(x, w, bias)).max())
            np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * pre_scale + 1e-6,
                                       err_msg=f"{path} {mode} {activation} {(batch, K, N)}")
            if mode != "w8a32" and path != "scalar":
                # Integer accumulation: the pre-activations equal the scalar path's up to the final
                # fma, so this isolates the SIMD exp approximation against libm's expm1 / tanh.
                libm = np.asarray(int8_dense(x, w, bias, path="scalar", activation=activation))
                # (up to the final fma: one rounding of a product as large as the pre-activations, hence pre_scale).
                np.testing.assert_allclose(y, libm, rtol=1e-6, atol=5e-7 + 2.5e-7 * pre_scale,
                                           err_msg=f"{path} {activation}")
            if activation == "relu":  # fused relu is exactly relu of the unfused kernel
                np.testing.assert_array_equal(y, np.maximum(np.asarray(int8_dense(x, w, bias, path=path)), 0.0))
            if activation == "tanh":
                assert np.abs(y).max() <= 1.0


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_layer_norm_matches_flax(path):
    import flax.linen as nn

    rng = np.random.default_rng(12)
    for M, N in [(1, 1), (1, 7), (3, 16), (5, 33), (64, 100), (1, 2048)]:
        x = (rng.normal(size=(M, N)) * 5 + 2).astype(np.float32)
        scale, bias = rng.normal(size=N).astype(np.float32), rng.normal(size=N).astype(np.float32)
        norm = nn.LayerNorm(epsilon=1e-5)
        flax_y = np.asarray(norm.apply({"params": {"scale": scale, "bias": bias}}, x))
        np.testing.assert_allclose(np.asarray(kernels.reference_layer_norm(x, scale, bias, 1e-5)), flax_y, atol=1e-6)
        for activation in (None, "tanh", "elu"):
            fn = jax.jit(functools.partial(kernels.layer_norm, scale=scale, bias=bias, epsilon=1e-5,
                                           activation=activation, path=path))
            y = np.asarray(fn(x))
            ref = np.asarray(kernels.reference_layer_norm(x, scale, bias, 1e-5, activation))
            np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * max(1.0, float(np.abs(ref).max())),
                                       err_msg=f"{path} {activation} {(M, N)}")
        assert kernels.layer_norm(x[0], scale, bias).shape == (N,)


def test_layer_norm_bad_inputs_raise_value_error():
    x, ones = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="float32"):
        kernels.layer_norm(x.astype(np.float64), ones, ones)
    with pytest.raises(ValueError, match=r"scale must be float32 of shape \(8,\)"):
        kernels.layer_norm(x, ones[:7], ones)
    with pytest.raises(ValueError, match="epsilon"):
        kernels.layer_norm(x, ones, ones, epsilon=-1.0)
    with pytest.raises(ValueError, match="'swish'"):
        kernels.layer_norm(x, ones, ones, activation="swish")


def test_actor_loader_packs_by_bits():
    from actorq_jax.launch.precision import ActorPrecision, make_param_loader
    from actorq_jax.networks import PolicyNetwork
    from actorq_jax.quantization import QuantConfig, quantize

    net = PolicyNetwork(action_dim=6, layer_sizes=(64, 64), activation="elu", layer_norm=True)
    obs = np.random.default_rng(15).normal(size=(4, 24)).astype(np.float32)
    params = net.init(jax.random.PRNGKey(0), obs)
    expected = {(8, "w8a8"): "w8a8", (4, "w8a8"): "w4a8", (3, "w8a8"): "w4a8", (4, "w8a32"): "w8a32"}
    for (bits, int8_mode), mode in expected.items():
        precision = ActorPrecision(actor_bits=bits, comm_bits=bits, backend="int8", int8_mode=int8_mode)
        wire = quantize(params, QuantConfig(bits=bits))
        loaded = make_param_loader(precision)(wire)
        kernel = loaded["params"]["torso"]["Dense_1"]["kernel"]
        assert isinstance(kernel, Int8DenseWeight) and kernel.mode == mode, (bits, int8_mode)
        fake = net.apply(wire, obs)  # the same b-bit weights through jnp
        assert _max_rel_err(jax.jit(net.apply)(loaded, obs), fake) < (1e-5 if mode == "w8a32" else 0.05)


def test_unknown_activation_is_refused():
    rng = np.random.default_rng(11)
    x, w, bias, _, _ = _case(rng, 2, 8, 16, "w8a8")
    for fn in (int8_dense, reference_int8_dense):
        with pytest.raises(ValueError, match="'gelu'"):
            fn(x, w, bias, activation="gelu")


def test_w8a8_reference_is_integer_math():
    rng = np.random.default_rng(3)
    x, w, bias, values, scale = _case(rng, 4, 70, 20, "w8a8")
    q, sx = kernels.quantize_rows(jnp.asarray(x))
    q, sx = np.asarray(q).astype(np.int64), np.asarray(sx)
    assert np.abs(q).max() == 127
    np.testing.assert_allclose(q * sx, x, atol=float(sx.max()) * 0.5 + 1e-7)
    expect = (q @ values.astype(np.int64)).astype(np.float64) * (sx * scale) + bias
    assert _max_rel_err(reference_int8_dense(x, w, bias), expect) < 1e-6


@needs_kernel
@pytest.mark.parametrize("mode", ["w8a32", "w8a8"])
def test_paths_agree(mode):
    rng = np.random.default_rng(4)
    for batch, K, N in [(1, 300, 70), (9, 129, 31), (64, 64, 160)]:
        x, w, bias, _, _ = _case(rng, batch, K, N, mode)
        outs = {p: np.asarray(int8_dense(x, w, bias, path=p)) for p in KERNEL_PATHS}
        for p in KERNEL_PATHS[1:]:
            assert _max_rel_err(outs[p], outs["scalar"]) < 1e-5, (mode, p)
        if mode == "w8a8":  # integer accumulation: identical up to the final fma
            for p in KERNEL_PATHS[1:]:
                np.testing.assert_allclose(outs[p], outs["scalar"], rtol=1e-6, atol=1e-6)


def test_leading_dims_bias_none_and_empty_batch():
    rng = np.random.default_rng(5)
    x, w, _, values, scale = _case(rng, 6, 19, 21, "w8a32")
    x3 = x.reshape(2, 3, 19)
    y = int8_dense(x3, w)
    assert y.shape == (2, 3, 21)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 21), x @ (values.astype(np.float32) * scale), rtol=1e-5, atol=1e-5)
    y1 = int8_dense(x[0], w)
    assert y1.shape == (21,)
    assert int8_dense(np.zeros((0, 19), np.float32), w).shape == (0, 21)


def test_bad_inputs_raise_value_error():
    rng = np.random.default_rng(6)
    x, w, bias, values, _ = _case(rng, 2, 10, 12, "w8a32")
    with pytest.raises(ValueError, match="float32"):
        int8_dense(x.astype(np.float64), w, bias)
    with pytest.raises(ValueError, match="float32"):
        int8_dense(x.astype(np.int32), w, bias)
    with pytest.raises(ValueError, match=r"\[\.\.\., 10\]"):
        int8_dense(x[:, :9], w, bias)
    with pytest.raises(ValueError, match="bias"):
        int8_dense(x, w, bias[:11])
    with pytest.raises(ValueError, match="bias"):
        int8_dense(x, w, bias.astype(np.float16))
    with pytest.raises(ValueError, match="Int8DenseWeight"):
        int8_dense(x, values, bias)
    with pytest.raises(ValueError, match="path"):
        int8_dense(x, w, bias, path="neon")
    with pytest.raises(ValueError, match="int8"):
        pack_dense(values.astype(np.int16), np.ones(12, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        pack_dense(values[0], np.ones(12, np.float32))
    with pytest.raises(ValueError, match="scale"):
        pack_dense(values, np.ones(11, np.float32))
    with pytest.raises(ValueError, match="mode"):
        pack_dense(values, np.ones(12, np.float32), mode="w4a4")
    with pytest.raises(ValueError, match="packed"):
        int8_dense(x, w.replace(packed=w.packed.astype(jnp.int16)), bias)
    with pytest.raises(ValueError, match="threads"):
        kernels.set_num_threads(0)
    # Inside jit the same checks fire at trace time, before XLA sees the call.
    with pytest.raises(ValueError, match="float32"):
        jax.jit(lambda a: int8_dense(a, w, bias))(x.astype(jnp.bfloat16))


@needs_kernel
def test_unsupported_path_is_refused_by_the_kernel():
    # The FFI handler itself rejects unknown path codes (the Python side never sends one).
    from jax.extend import ffi as jffi

    rng = np.random.default_rng(7)
    x, w, bias, _, _ = _case(rng, 2, 8, 16, "w8a32")
    with pytest.raises(Exception, match="path 9"):
        jffi.ffi_call(_library.TARGET_W8A32, jax.ShapeDtypeStruct((2, 16), jnp.float32),
                      jnp.asarray(x), w.packed, w.scale, jnp.asarray(bias), w.colsum, out_features=16, path=9,
                      activation=0).block_until_ready()
    with pytest.raises(Exception, match="activation 7"):
        jffi.ffi_call(_library.TARGET_W8A32, jax.ShapeDtypeStruct((2, 16), jnp.float32),
                      jnp.asarray(x), w.packed, w.scale, jnp.asarray(bias), w.colsum, out_features=16, path=0,
                      activation=7).block_until_ready()


@needs_kernel
def test_jit_repeated_calls_with_two_threads():
    rng = np.random.default_rng(8)
    # M * K * N above the kernel's parallel threshold (2^21 multiply-adds), so the pool really runs.
    x, w, bias, _, _ = _case(rng, 5, 650, 700, "w8a32")
    x8, w8, b8, _, _ = _case(rng, 4, 701, 770, "w8a8")
    ref, ref8 = np.asarray(reference_int8_dense(x, w, bias)), np.asarray(reference_int8_dense(x8, w8, b8))
    fn = jax.jit(int8_dense)
    kernels.set_num_threads(2)
    try:
        assert kernels.get_num_threads() == 2
        for i in range(200):
            y = np.asarray(fn(x, w, bias))
            y8 = np.asarray(fn(x8, w8, b8))
            assert _max_rel_err(y, ref) < 1e-5 and _max_rel_err(y8, ref8) < 1e-5, i
        kernels.set_num_threads(1)  # resizing the pool between calls must be safe too
        assert _max_rel_err(fn(x, w, bias), ref) < 1e-5
    finally:
        kernels.set_num_threads(1)


@needs_kernel
@pytest.mark.process
@pytest.mark.timeout(150)
def test_idle_pool_workers_sleep():
    # Pool workers spin briefly after a job and then must sleep: a worker that kept
    # spinning would steal a core from the actor's environment for the whole run.
    script = textwrap.dedent("""
        import time
        import numpy as np, jax
        from actorq_jax import kernels
        from actorq_jax.kernels import pack_dense, int8_dense
        rng = np.random.default_rng(0)
        w = pack_dense(rng.integers(-127, 128, size=(2048, 2048)).astype(np.int8),
                       np.full(2048, 0.01, np.float32), "w8a8")
        x = rng.normal(size=(1, 2048)).astype(np.float32)
        kernels.set_num_threads(2)
        fn = jax.jit(int8_dense)
        for _ in range(50):
            fn(x, w, np.zeros(2048, np.float32)).block_until_ready()
        time.sleep(0.2)
        cpu0 = time.process_time()
        time.sleep(1.0)
        print("IDLE_CPU", time.process_time() - cpu0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    idle_cpu = float(proc.stdout.split("IDLE_CPU")[1])
    assert idle_cpu < 0.25, f"process used {idle_cpu:.2f} s of CPU in 1 s of idle sleep"


@needs_kernel
def test_reference_path_gives_same_answer():
    rng = np.random.default_rng(9)
    for mode in ("w8a32", "w8a8"):
        x, w, bias, _, _ = _case(rng, 5, 77, 40, mode)
        y = int8_dense(x, w, bias)
        y_ref = jax.jit(functools.partial(int8_dense, path="reference"))(x, w, bias)
        assert _max_rel_err(y, y_ref) < 1e-5


@pytest.mark.process
@pytest.mark.timeout(150)
def test_missing_library_warns_once_and_falls_back():
    script = textwrap.dedent(
        """
        import warnings, numpy as np
        from actorq_jax import kernels
        rng = np.random.default_rng(0)
        w = kernels.pack_dense(rng.integers(-127, 128, (9, 5)).astype(np.int8), np.float32(0.1))
        x = rng.normal(size=(3, 9)).astype(np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y1 = kernels.int8_dense(x, w)
            y2 = kernels.int8_dense(x, w)
        msgs = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
        assert len(msgs) == 1 and "does-not-exist.so" in msgs[0], msgs
        assert not kernels.kernel_available() and kernels.kernel_path() == "reference"
        exact = x @ (w.unpack().astype(np.float32) * 0.1)
        assert np.abs(np.asarray(y1) - exact).max() < 1e-5 and np.array_equal(y1, y2)
        # The fused MLP falls back to the same reference, layer by layer.
        y3 = kernels.int8_mlp(x, [kernels.MlpDense(w, None, "tanh")])
        assert np.array_equal(np.asarray(y3), np.asarray(kernels.reference_int8_dense(x, w, None, "tanh")))
        # A named path asks for the compiled kernel: no silent reference behind it.
        for call in (lambda: kernels.int8_dense(x, w, path="avx2"),
                     lambda: kernels.int8_mlp(x, [kernels.MlpDense(w, None, "tanh")], path="scalar")):
            try:
                call()
            except ValueError as exc:
                assert "does-not-exist.so" in str(exc) and "unavailable" in str(exc), exc
            else:
                raise AssertionError("a named path ran without the library")
        print("FALLBACK-OK")
        """
    )
    env = dict(os.environ, ACTORQ_KERNEL_LIBRARY="/nonexistent/does-not-exist.so", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "FALLBACK-OK" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("activation,layer_norm", [("tanh", False), ("relu", False), ("elu", True)])
def test_pack_params_and_int8_policy(activation, layer_norm):
    from actorq_jax.networks import PolicyNetwork
    from actorq_jax.quantization import QuantConfig, QuantizedTensor, quantize

    net = PolicyNetwork(action_dim=6, layer_sizes=(64, 40, 33), activation=activation, layer_norm=layer_norm)
    obs = np.random.default_rng(10).normal(size=(4, 24)).astype(np.float32)
    params = net.init(jax.random.PRNGKey(0), obs)
    qparams = quantize(params, QuantConfig(bits=8))
    fake = net.apply(qparams, obs)  # the same quantized weights, applied through jnp
    for mode in ("w8a32", "w8a8"):
        packed = pack_params(qparams, mode=mode)
        leaves = jax.tree_util.tree_leaves(packed, is_leaf=lambda leaf: isinstance(leaf, Int8DenseWeight))
        n_int8 = sum(isinstance(leaf, Int8DenseWeight) for leaf in leaves)
        n_quant = sum(isinstance(leaf, QuantizedTensor) for leaf in jax.tree_util.tree_leaves(
            qparams, is_leaf=lambda leaf: isinstance(leaf, QuantizedTensor)))
        assert n_int8 == n_quant >= 3 and all(getattr(leaf, "mode", mode) == mode for leaf in leaves)
        actions = jax.jit(net.apply)(packed, obs)
        tol = 1e-5 if mode == "w8a32" else 0.05
        assert _max_rel_err(actions, fake) < tol, mode
        if kernels.kernel_available():
            # The torso (Dense, LayerNorm, activations) is one kernel call, with the head (and its tanh)
            # when that is packed too (a float head, too small to quantize, runs in XLA after it).
            hlo = jax.jit(net.apply).lower(packed, obs).as_text()
            assert hlo.count(f"@{_library.TARGET_MLP}(") == 1 and hlo.count("stablehlo.custom_call") == 1, hlo
            head_int8 = isinstance(packed["params"]["head"]["kernel"], Int8DenseWeight)
            assert ("stablehlo.tanh" in hlo) == (not head_int8), hlo

    # Asymmetric tensors are dequantized to float32; other leaves pass through.
    asym = quantize(params, QuantConfig(bits=8, symmetric=False))
    packed = pack_params(asym)
    is_weight = lambda leaf: isinstance(leaf, Int8DenseWeight)  # noqa: E731
    kinds = {type(leaf).__name__ for leaf in jax.tree_util.tree_leaves(packed, is_leaf=is_weight)}
    assert "Int8DenseWeight" not in kinds and "QuantizedTensor" not in kinds
    kernel = packed["params"]["torso"]["Dense_0"]["kernel"]
    assert kernel.dtype == jnp.float32 and kernel.shape == (24, 64)


def test_kernel_is_built():
    # CI (scripts/test.sh) sets ACTORQ_REQUIRE_KERNEL=1: there a missing kernel fails instead of falling back.
    if not kernels.kernel_available():
        if os.environ.get("ACTORQ_REQUIRE_KERNEL") == "1":
            pytest.fail(f"ACTORQ_REQUIRE_KERNEL=1 but {kernels.describe_kernel()}")
        pytest.skip(f"{kernels.describe_kernel()} (set ACTORQ_REQUIRE_KERNEL=1 to make this a failure)")
    assert kernels.kernel_path() in ("scalar", "avx2", "avx512", "amx")
    assert _library.state().lib.actorq_abi_version() == _library.ABI_VERSION


@needs_kernel
def test_kernel_path_and_description_follow_the_environment(monkeypatch):
    monkeypatch.setenv(_library.ENV_PATH, "scalar")
    assert kernels.kernel_path() == "scalar"
    assert kernels.describe_kernel().startswith("int8 kernel: scalar path (held by $ACTORQ_KERNEL_PATH)")
    monkeypatch.setenv(_library.ENV_PATH, "reference")
    assert kernels.kernel_path() == "reference"
    monkeypatch.setenv(_library.ENV_PATH, "avx9")
    with pytest.raises(ValueError, match="avx9"):
        kernels.kernel_path()
    monkeypatch.delenv(_library.ENV_PATH)
    assert kernels.kernel_path() == _library.best_path() and "held by" not in kernels.describe_kernel()


@needs_kernel
def test_actor_backend_names_the_kernel_path_it_runs_on(monkeypatch):
    from actorq_jax.launch.precision import ActorPrecision, describe_backend

    monkeypatch.delenv(_library.ENV_PATH, raising=False)
    assert describe_backend(ActorPrecision(actor_bits=8, comm_bits=8)) == f"int8/w8a8/{_library.best_path()}"
    assert describe_backend(ActorPrecision(actor_bits=4, comm_bits=8)) == f"int8/w4a8/{_library.best_path()}"
    monkeypatch.setenv(_library.ENV_PATH, "scalar")
    assert describe_backend(ActorPrecision(actor_bits=8, comm_bits=8, int8_mode="w8a32")) == "int8/w8a32/scalar"
    assert describe_backend(ActorPrecision(actor_bits=32, comm_bits=32)) == "fp32"
    assert describe_backend(ActorPrecision(actor_bits=8, comm_bits=8, backend="fakequant")) == "fakequant"


def _bits_case(rng, batch, K, N, mode):
    """x, packed weights of the full range of ``mode`` (-8..7 for w4a8, -128..127 else) and a bias."""
    low, high = (-8, 8) if mode == "w4a8" else (-128, 128)
    w = pack_dense(rng.integers(low, high, size=(K, N)).astype(np.int8),
                   rng.uniform(1e-3, 2e-2, size=N).astype(np.float32), mode)
    return rng.normal(size=(batch, K)).astype(np.float32), w, rng.normal(size=N).astype(np.float32)


def _require_amx():
    if not _library.path_supported("amx"):
        pytest.fail(f"ACTORQ_REQUIRE_AMX=1 but {_AMX_MISSING}")


@needs_amx
def test_amx_is_chosen_where_the_cpu_has_it(monkeypatch):
    _require_amx()
    monkeypatch.delenv(_library.ENV_PATH, raising=False)
    assert kernels.kernel_path() == "amx" and "amx path" in kernels.describe_kernel()


@needs_amx
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
def test_amx_equals_vnni_bit_for_bit(mode):
    # Row counts on both sides of where tiles take over (12 for W8A8, 24 for W4A8) and of 16-row
    # tiles; K off multiples of 4, 8 and 64 (tail chunks); N with narrow panels and odd pairs.
    _require_amx()
    rng = np.random.default_rng(40)
    for batch, K, N in [(11, 24, 256), (12, 24, 256), (13, 1, 1), (16, 64, 16), (17, 65, 17), (23, 130, 33),
                        (24, 3, 70), (25, 257, 48), (32, 64, 7), (32, 63, 7), (33, 128, 130), (48, 200, 96), (64, 2048, 6),
                        (70, 100, 45)]:
        x, w, bias = _bits_case(rng, batch, K, N, mode)
        for activation in (None, "relu", "elu", "tanh"):
            amx = np.asarray(int8_dense(x, w, bias, path="amx", activation=activation))
            vnni = np.asarray(int8_dense(x, w, bias, path="avx512", activation=activation))
            np.testing.assert_array_equal(amx, vnni, err_msg=f"{mode} {activation} {(batch, K, N)}")


@needs_amx
def test_amx_on_two_threads_and_in_the_fused_mlp_equals_vnni():
    _require_amx()
    rng = np.random.default_rng(41)
    layers = _mlp_case(rng, 24, (256, 256, 130, 6), "w8a8", layer_norm=True)
    x = rng.normal(size=(64, 24)).astype(np.float32)
    before = kernels.get_num_threads()
    try:
        for threads in (1, 2):  # 64 x 256 x 256 is over the size that splits panels between threads
            kernels.set_num_threads(threads)
            np.testing.assert_array_equal(np.asarray(kernels.int8_mlp(x, layers, path="amx")),
                                          np.asarray(kernels.int8_mlp(x, layers, path="avx512")), err_msg=f"{threads}")
            big = _bits_case(rng, 32, 256, 256, "w4a8")
            np.testing.assert_array_equal(np.asarray(int8_dense(big[0], big[1], big[2], path="amx")),
                                          np.asarray(int8_dense(big[0], big[1], big[2], path="avx512")))
    finally:
        kernels.set_num_threads(before)


def _mlp_case(rng, K, widths, mode, layer_norm):
    """int8_mlp layers K -> widths (Dense_0, optional LayerNorm + tanh, then elu layers, tanh last)."""
    layers, k = [], K
    for i, n in enumerate(widths):
        low, high = (-8, 8) if mode == "w4a8" else (-128, 128)
        w = pack_dense(rng.integers(low, high, size=(k, n)).astype(np.int8),
                       rng.uniform(1e-3, 2e-2, size=n).astype(np.float32), mode)
        b = rng.normal(size=n).astype(np.float32)
        if i == 0 and layer_norm:
            layers += [kernels.MlpDense(w, b), kernels.MlpLayerNorm(rng.normal(size=n).astype(np.float32),
                                                                   rng.normal(size=n).astype(np.float32), 1e-5, "tanh")]
        else:
            layers.append(kernels.MlpDense(w, b, "tanh" if i == len(widths) - 1 else "elu"))
        k = n
    return layers


def _mlp_float64(x, layers):
    """The w8a32 network's math in float64: the ground truth both float32 paths round away from."""
    x = np.asarray(x, np.float64)
    for layer in layers:
        if isinstance(layer, kernels.MlpDense):
            w = np.asarray(layer.weight.unpack(), np.float64) * np.asarray(layer.weight.scale, np.float64)
            x = x @ w + np.asarray(layer.bias, np.float64)
        else:
            mean = x.mean(-1, keepdims=True)
            var = np.square(x - mean).mean(-1, keepdims=True)
            x = (x - mean) / np.sqrt(var + layer.epsilon) * np.asarray(layer.scale, np.float64) + layer.bias
        if layer.activation == "tanh":
            x = np.tanh(x)
        elif layer.activation == "elu":
            x = np.where(x > 0, x, np.expm1(x))
    return x


def _per_layer(x, layers, path):
    for layer in layers:
        if isinstance(layer, kernels.MlpDense):
            x = int8_dense(x, layer.weight, layer.bias, path=path, activation=layer.activation)
        else:
            x = kernels.layer_norm(x, layer.scale, layer.bias, epsilon=layer.epsilon, activation=layer.activation,
                                   path=path)
    return x


@needs_kernel
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("mode", ["w8a32", "w8a8", "w4a8"])
def test_fused_mlp_equals_per_layer_bit_for_bit(path, mode):
    rng = np.random.default_rng(20)
    fused = jax.jit(functools.partial(kernels.int8_mlp, path=path))
    per_layer = jax.jit(functools.partial(_per_layer, path=path))
    for layer_norm in (False, True):
        layers = _mlp_case(rng, 17, (70, 33, 6), mode, layer_norm)
        for batch in (1, 3, 8, 13, 32, 64):
            x = rng.normal(size=(batch, 17)).astype(np.float32)
            y = np.asarray(fused(x, layers))
            assert y.shape == (batch, 6)
            np.testing.assert_array_equal(y, np.asarray(per_layer(x, layers)), err_msg=f"{layer_norm} {batch}")
            ref = np.asarray(kernels.int8_mlp(x, layers, path="reference"))
            if mode == "w8a32":
                # Sums of ~70 terms that cancel to O(1) leave float32 errors near 1e-4 in both the kernel and
                # XLA's dot, in opposite directions on some CPUs; so each is held to the float64 truth, and the
                # kernel to no worse than twice XLA's own error there.
                exact = _mlp_float64(x, layers)
                xla_err = np.abs(ref - exact).max()
                assert xla_err < 2e-4, (layer_norm, batch, xla_err)
                assert np.abs(y - exact).max() <= 2 * xla_err + 2e-5, (layer_norm, batch, np.abs(y - exact).max())
            else:
                np.testing.assert_allclose(y, ref, rtol=0, atol=0.05)
    assert kernels.int8_mlp(x.reshape(4, 16, 17), layers, path=path).shape == (4, 16, 6)
    assert kernels.int8_mlp(np.zeros((0, 17), np.float32), layers, path=path).shape == (0, 6)


@needs_kernel
@pytest.mark.parametrize("mode", ["w8a32", "w8a8", "w4a8"])
@pytest.mark.parametrize("network", ["mlp", "layer_norm_mlp", "policy", "q"])
def test_fused_network_equals_per_layer_bit_for_bit(mode, network):
    from actorq_jax.networks import PolicyNetwork, QNetwork
    from actorq_jax.networks.modules import MLP
    from actorq_jax.quantization import QuantConfig, quantize

    rng = np.random.default_rng(21)
    make = {
        "mlp": functools.partial(MLP, layer_sizes=(300, 64, 40), activation="elu"),
        "layer_norm_mlp": functools.partial(MLP, layer_sizes=(300, 64, 40), activation="elu", layer_norm=True),
        "policy": functools.partial(PolicyNetwork, action_dim=6, layer_sizes=(300, 64), layer_norm=True,
                                    activation="elu", action_minimum=(-2.0,) * 6, action_maximum=(1.0,) * 6),
        "q": functools.partial(QNetwork, num_actions=3, layer_sizes=(300, 64)),
    }[network]
    obs = rng.normal(size=(64, 24)).astype(np.float32)
    params = make().init(jax.random.PRNGKey(1), obs)
    packed = pack_params(quantize(params, QuantConfig(bits=4 if mode == "w4a8" else 8)), mode=mode)
    fused, unfused = jax.jit(make().apply), jax.jit(make(fuse_int8=False).apply)
    hlo = fused.lower(packed, obs).as_text()
    # One kernel call for the whole network: the torso, and the head where there is one.
    assert hlo.count(f"@{_library.TARGET_MLP}(") == 1 and hlo.count("stablehlo.custom_call") == 1, hlo
    assert "actorq_mlp" not in unfused.lower(packed, obs).as_text()
    for threads in (1, 2):
        kernels.set_num_threads(threads)
        try:
            for batch in (1, 8, 32, 64):
                np.testing.assert_array_equal(np.asarray(fused(packed, obs[:batch])),
                                              np.asarray(unfused(packed, obs[:batch])), err_msg=f"{threads} {batch}")
        finally:
            kernels.set_num_threads(1)


def test_int8_mlp_bad_inputs_raise_value_error():
    rng = np.random.default_rng(22)
    layers = _mlp_case(rng, 10, (20, 5), "w8a8", True)
    x = rng.normal(size=(3, 10)).astype(np.float32)
    with pytest.raises(ValueError, match="at least one layer"):
        kernels.int8_mlp(x, [])
    with pytest.raises(ValueError, match=r"\[\.\.\., 10\]"):
        kernels.int8_mlp(x[:, :9], layers)
    with pytest.raises(ValueError, match="layer 2 takes 10 inputs"):
        kernels.int8_mlp(x, layers[:2] + layers[:1])
    with pytest.raises(ValueError, match="MlpDense or MlpLayerNorm"):
        kernels.int8_mlp(x, [layers[0], "relu"])
    with pytest.raises(ValueError, match="'gelu'"):
        kernels.int8_mlp(x, [kernels.MlpDense(layers[0].weight, layers[0].bias, "gelu")])
    with pytest.raises(ValueError, match="epsilon"):
        kernels.int8_mlp(x, [layers[0], kernels.MlpLayerNorm(layers[1].scale, layers[1].bias, -1.0)])


@needs_kernel
def test_fused_mlp_handler_refuses_a_bad_program():
    # The handler checks the program against its operands itself (the Python side never sends a bad one).
    from jax.extend import ffi as jffi

    rng = np.random.default_rng(23)
    (layer,) = _mlp_case(rng, 8, (16,), "w8a8", False)
    operands = [layer.weight.packed, layer.weight.scale, jnp.asarray(layer.bias), layer.weight.colsum]
    x = jnp.asarray(rng.normal(size=(2, 8)).astype(np.float32))
    for program, match in (([1, 16, 0, 1, 16, 0], "too few operands"), ([7, 16, 0], "op 7"),
                           ([1, 17, 0], "packed weights"), ([1, 16, 9], "activation 9")):
        with pytest.raises(Exception, match=match):
            jffi.ffi_call(_library.TARGET_MLP, jax.ShapeDtypeStruct((2, 16), jnp.float32), x, *operands,
                          program=np.asarray(program, np.int64), epsilons=np.zeros(1, np.float32),
                          path=0).block_until_ready()


@needs_kernel
@pytest.mark.process
@pytest.mark.timeout(300)
def test_portable_scalar_build(tmp_path):
    # The library as a CPU without x86 SIMD gets it: scalar code only, same answers as the reference.
    from actorq_jax.kernels import build

    lib = build.build(tmp_path / build.library_filename(), portable=True)
    script = textwrap.dedent("""
        import numpy as np
        from actorq_jax import kernels
        from actorq_jax.kernels import pack_dense
        assert kernels.kernel_path() == "scalar", kernels.describe_kernel()
        rng = np.random.default_rng(0)
        for mode in ("w8a32", "w8a8", "w4a8"):
            for M, K, N in ((1, 24, 40), (8, 37, 70), (33, 64, 16)):
                low, high = (-8, 8) if mode == "w4a8" else (-128, 128)
                w = pack_dense(rng.integers(low, high, (K, N)).astype(np.int8),
                               rng.uniform(1e-3, 2e-2, N).astype(np.float32), mode)
                b = rng.normal(size=N).astype(np.float32)
                x = rng.normal(size=(M, K)).astype(np.float32)
                y = np.asarray(kernels.int8_dense(x, w, b, activation="elu"))
                ref = np.asarray(kernels.reference_int8_dense(x, w, b, "elu"))
                assert np.abs(y - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), (mode, M, K, N)
                layers = [kernels.MlpDense(w, b, "elu")]
                assert np.array_equal(np.asarray(kernels.int8_mlp(x, layers)), y)
        print("PORTABLE-OK")
    """)
    env = dict(os.environ, ACTORQ_KERNEL_LIBRARY=str(lib), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert "PORTABLE-OK" in proc.stdout, proc.stderr[-3000:]
