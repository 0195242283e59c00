"""The int8 kernels against the fastest CPU inference engine: ONNX Runtime, fp32 and dynamic int8.

The same policy, MLP 24 -> H x3 -> 6 with tanh between layers and on the output,
runs as: XLA fp32 (jax.jit of the flax module), our W8A32 / W8A8 / W4A8 kernels
inside that jit (as actors call them), ONNX Runtime fp32, and ONNX Runtime's
dynamic int8 (``quantize_dynamic`` with QInt8 weights: int8 weights, activations
quantized per call, the scheme of PyTorch's dynamic int8). Each thread setting
runs in its own subprocess (XLA reads its thread flags once); inside it, every
case's six forwards are timed in interleaved trials and the medians compared.
Headline: ORT time / ours (> 1 means ours is faster).

    python benchmarks/peers.py [--quick] [--json PATH]

Needs the ``bench`` extra (``pip install -r requirements-bench.txt``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Tuple

from actor_inference import (
    ACTION_DIM,
    OBS_DIM,
    interleaved_medians,
    parse_args,
    policy_variants,
    print_rows,
    report,
    run_worker,
)

from actorq_jax.telemetry.machine import cpu_has, machine_info

HIDDEN = (256, 1024, 2048, 4096)
BATCHES = (1, 8, 32, 64)
THREADS = (1, 2)
# --quick: the cases the headline names, at both thread settings.
QUICK_HIDDEN, QUICK_BATCHES, QUICK_THREADS = (256, 2048, 4096), (1, 8, 32, 64), (1, 2)
VARIANTS = ("xla_fp32", "w8a32", "w8a8", "w4a8", "ort_fp32", "ort_int8")
# (ours, ORT baseline, hidden, batch) of every headline ratio, at one thread.
HEADLINE_CASES = tuple(
    (ours, peer, hidden, batch)
    for peer in ("ort_int8", "ort_fp32")
    for ours, hidden, batch in (("w8a8", 256, 1), ("w8a8", 2048, 1), ("w8a8", 2048, 8), ("w8a8", 2048, 32),
                                ("w8a8", 2048, 64), ("w8a8", 4096, 8), ("w8a8", 4096, 64), ("w4a8", 2048, 1))
)


def headline_key(ours: str, peer: str, hidden: int, batch: int) -> str:
    """The headline name of ``peer`` time / ``ours`` time, e.g. w8a8_vs_ort_int8_2048_b8."""
    return f"{ours}_vs_{peer}_{hidden}_b{batch}"


def _onnx_mlp(params: Any, path: str) -> None:
    """Writes the flax policy's float weights as an ONNX graph (MatMul, Add, Tanh per layer) to ``path``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    p = params["params"]
    layers = [p["torso"][f"Dense_{i}"] for i in range(len(p["torso"]))] + [p["head"]]
    nodes, inits, x = [], [], "obs"
    for i, layer in enumerate(layers):
        w, b = f"w{i}", f"b{i}"
        inits += [numpy_helper.from_array(np.asarray(layer["kernel"], np.float32), w),
                  numpy_helper.from_array(np.asarray(layer["bias"], np.float32), b)]
        nodes += [helper.make_node("MatMul", [x, w], [f"mm{i}"]),
                  helper.make_node("Add", [f"mm{i}", b], [f"pre{i}"]),
                  helper.make_node("Tanh", [f"pre{i}"], [f"h{i}"])]
        x = f"h{i}"
    graph = helper.make_graph(
        nodes, "policy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", OBS_DIM])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", ACTION_DIM])],
        inits,
    )
    # Opset 17 and IR 8: what onnx 1.17 writes and every recent onnxruntime reads.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def _ort_sessions(params: Any, threads: int, workdir: str) -> Dict[str, Any]:
    """ONNX Runtime sessions of the float model and of its dynamic-int8 quantization (QInt8 weights)."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32_path, int8_path = os.path.join(workdir, "fp32.onnx"), os.path.join(workdir, "int8.onnx")
    _onnx_mlp(params, fp32_path)
    quantize_dynamic(fp32_path, int8_path, weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return {name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for name, path in (("ort_fp32", fp32_path), ("ort_int8", int8_path))}


def _jax_call(apply: Callable, params: Any, obs: Any) -> Callable[[], Any]:
    return lambda: apply(params, obs).block_until_ready()


def _ort_call(session: Any, obs: Any) -> Callable[[], Any]:
    feed = {"obs": obs}
    return lambda: session.run(None, feed)


def _our_paths(batch: int) -> Dict[str, str]:
    """The code each of our kernels runs at ``batch`` on this machine's default path."""
    from actorq_jax import kernels

    path = kernels.kernel_path()
    if path != "amx":
        return {v: path for v in ("w8a32", "w8a8", "w4a8")}
    # The AMX path multiplies W8A8 and W4A8 on tiles from a batch on; W8A32 and smaller batches run AVX-512.
    return {"w8a32": "avx512", **{m: "amx tiles" if batch >= kernels.amx_min_rows(m) else "avx512 vnni"
                                  for m in ("w8a8", "w4a8")}}


def _traced_on_path(apply: Callable, path: str) -> Callable:
    """A fresh jit of ``apply``'s function whose kernel calls take ``path`` (read once, when it is traced)."""
    import jax

    from actorq_jax.kernels import _library

    # A new function object: a jit of the same one would reuse the trace (and the path) of the first.
    inner = apply.__wrapped__
    fresh = jax.jit(lambda params, obs: inner(params, obs))
    traced = set()

    def call(params: Any, obs: Any) -> Any:
        if obs.shape in traced:  # compiled already: no environment to set on the timed calls
            return fresh(params, obs)
        before = os.environ.get(_library.ENV_PATH)
        os.environ[_library.ENV_PATH] = path
        try:
            out = fresh(params, obs)
        finally:
            if before is None:
                os.environ.pop(_library.ENV_PATH, None)
            else:
                os.environ[_library.ENV_PATH] = before
        traced.add(obs.shape)
        return out

    return call


def worker(threads: int, quick: bool) -> List[dict]:
    """Measures every case at one thread setting (jax must not be initialised before this runs)."""
    import jax
    import numpy as np

    from actorq_jax import kernels

    # On an AMX machine our W8A8 also runs forced onto AVX-512 VNNI, beside it: the tiles' gain in one run.
    amx = kernels.kernel_path() == "amx"

    kernels.set_num_threads(threads)
    # Full: about 5 minutes on 2 cores; many short trials, as the machines are shared and noisy.
    trials = 2 if quick else 15
    min_seconds = 0.003 if quick else 0.04
    hidden_sizes, batches = (QUICK_HIDDEN, QUICK_BATCHES) if quick else (HIDDEN, BATCHES)
    rows = []
    for hidden in hidden_sizes:
        apply, ours = policy_variants(hidden)
        ours["xla_fp32"] = params = ours.pop("fp32")
        vnni_apply = _traced_on_path(apply, "avx512") if amx else None
        with tempfile.TemporaryDirectory() as workdir:
            sessions = _ort_sessions(params, threads, workdir)
        rng = np.random.default_rng(hidden)
        for batch in batches:
            obs = rng.normal(size=(batch, OBS_DIM)).astype(np.float32)
            obs_jax = jax.numpy.asarray(obs)
            calls = {v: _jax_call(apply, ours[v], obs_jax) for v in VARIANTS if v in ours}
            calls.update({v: _ort_call(sessions[v], obs) for v in ("ort_fp32", "ort_int8")})
            if amx:
                calls["w8a8_vnni"] = _jax_call(vnni_apply, ours["w8a8"], obs_jax)
                np.testing.assert_array_equal(np.asarray(vnni_apply(ours["w8a8"], obs_jax)),
                                              np.asarray(apply(ours["w8a8"], obs_jax)))
            # The engines must agree on the answer before their times are compared.
            reference = np.asarray(apply(params, obs_jax))
            errors = {v: float(np.max(np.abs(np.asarray(sessions[v].run(None, {"obs": obs})[0]) - reference)))
                      for v in ("ort_fp32", "ort_int8")}
            errors["w8a8"] = float(np.max(np.abs(np.asarray(apply(ours["w8a8"], obs_jax)) - reference)))
            med = interleaved_medians(calls, trials, min_seconds)
            row = {"hidden": hidden, "batch": batch, "threads": threads}
            row.update({f"{v}_us": round(med[v], 1) for v in VARIANTS})
            if amx:
                row["w8a8_vnni_us"] = round(med["w8a8_vnni"], 1)
            row.update({f"{v}_max_abs_err": round(e, 6) for v, e in errors.items()})
            row["kernel"] = kernels.describe_kernel()
            row["paths"] = _our_paths(batch)
            rows.append(row)
    return rows


def _find(rows: List[dict], hidden: int, batch: int, threads: int) -> dict:
    for r in rows:
        if (r["hidden"], r["batch"], r["threads"]) == (hidden, batch, threads):
            return r
    return {}


def headline(rows: List[dict]) -> Dict[str, Any]:
    """Every HEADLINE_CASES ratio (peer time / ours) at one thread; None where the case did not run.

    On an AMX machine also ``w8a8_amx_vs_vnni_<H>_b<batch>``: our W8A8 forced onto AVX-512 VNNI / on tiles.
    """
    out = {}
    for ours, peer, hidden, batch in HEADLINE_CASES:
        r = _find(rows, hidden, batch, 1)
        out[headline_key(ours, peer, hidden, batch)] = round(r[f"{peer}_us"] / r[f"{ours}_us"], 2) if r else None
    for hidden, batch in ((2048, 32), (2048, 64), (4096, 64)):
        r = _find(rows, hidden, batch, 1)
        if r and "w8a8_vnni_us" in r:
            out[f"w8a8_amx_vs_vnni_{hidden}_b{batch}"] = round(r["w8a8_vnni_us"] / r["w8a8_us"], 2)
    return out


def _table(rows: List[dict]) -> Tuple[str, ...]:
    vnni = any("w8a8_vnni_us" in r for r in rows)  # an AMX machine: W8A8 on VNNI beside the tiles
    lines = ["| H | batch | threads | XLA fp32 | ours W8A32 | ours W8A8 | ours W4A8 | ORT fp32 | ORT int8 "
             "| ORT int8 / W8A8 | ORT int8 / W4A8 | ORT fp32 / W8A8 |" + (" W8A8 VNNI | VNNI / W8A8 |" if vnni else ""),
             "|" + " --- |" * (14 if vnni else 12)]
    for r in rows:
        lines.append(
            f"| {r['hidden']} | {r['batch']} | {r['threads']} | "
            + " | ".join(f"{r[f'{v}_us']:.0f}" for v in VARIANTS)
            + f" | {r['ort_int8_us'] / r['w8a8_us']:.2f}x | {r['ort_int8_us'] / r['w4a8_us']:.2f}x"
            + f" | {r['ort_fp32_us'] / r['w8a8_us']:.2f}x |"
            + (f" {r['w8a8_vnni_us']:.0f} | {r['w8a8_vnni_us'] / r['w8a8_us']:.2f}x |" if vnni else "")
        )
    return tuple(lines)


def main(argv: list | None = None) -> int:
    """Runs every thread setting in a subprocess, prints the table, writes --json."""
    args = parse_args(argv, __doc__.splitlines()[0], "the headline cases only, fewer trials (under a minute)")
    if args.worker is not None:
        return print_rows(worker(args.worker, args.quick))

    machine = machine_info()
    load_before = machine["loadavg_1_5_15"]
    rows = []
    for threads in QUICK_THREADS if args.quick else THREADS:
        rows.extend(run_worker(__file__, threads, args.quick))
    machine = dict(machine_info(), loadavg_before_1_5_15=load_before)
    try:
        import onnxruntime

        machine["onnxruntime"] = onnxruntime.__version__
        machine["onnxruntime_int8"] = ("quantize_dynamic(weight_type=QInt8): int8 weights, one scale per tensor; "
                                       "activations quantized per call; MLAS picks its int8 GEMM by CPUID "
                                       "(AMX tiles where the CPU has AMX-INT8, AVX-512 VNNI for small products)")
        machine["amx_int8"] = cpu_has("amx_int8")
    except ImportError:
        machine["onnxruntime"] = "not installed"
    kernel = rows[0]["kernel"] if rows else "unknown"
    print(f"peers: MLP {OBS_DIM}->Hx3->{ACTION_DIM} (tanh), median us per forward; {kernel}; "
          f"onnxruntime {machine['onnxruntime']}")
    print(f"{machine['cpu']}, {machine['cores']} cores, load average before {load_before} after "
          f"{machine['loadavg_1_5_15']}")
    print("\n".join(_table(rows)))
    tiles = sorted({(r["batch"], r["paths"]["w8a8"]) for r in rows})
    print("our W8A8 per batch: " + ", ".join(f"b{b} {p}" for b, p in tiles))
    head = headline(rows)
    return report(args.json, "peers", machine, rows, head, "ORT time / ours")


if __name__ == "__main__":
    sys.exit(main())
