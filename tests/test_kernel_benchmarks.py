"""The int8 benchmarks run end to end (--quick) and report every case and the headline keys RESULTS.md quotes.

(actor_throughput.py: tests/test_actor_throughput.py.)
"""

import json
import math
import subprocess
import sys

import pytest
from launch_support import ROOT

pytestmark = pytest.mark.process


def _run(script: str, json_path, timeout_s: int) -> dict:
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick", "--json", str(json_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(json_path.read_text())


@pytest.mark.timeout(420)
def test_actor_inference_quick(tmp_path):
    result = _run("actor_inference.py", tmp_path / "inference.json", 400)
    assert result["benchmark"] == "actor_inference" and result["machine"]["cores"] >= 1
    cases = {(r["hidden"], r["batch"], r["threads"]) for r in result["rows"]}
    assert cases == {(h, b, t) for h in (256, 2048, 4096) for b in (1, 8, 64) for t in (1, 2)}
    for row in result["rows"]:
        assert min(row["fp32_us"], row["w8a32_us"], row["w8a8_us"], row["w4a8_us"]) > 0
        assert row["speedup_w8a8"] == pytest.approx(row["fp32_us"] / row["w8a8_us"], rel=0.02)
    assert set(result["headline"]) == {"speedup_256x3_b1_t1", "speedup_2048x3_b1_t1", "speedup_4096x3_b1_t1",
                                       "speedup_2048x3_b1_t2"}
    assert all(v > 0 for v in result["headline"].values())


@pytest.mark.timeout(300)
def test_peers_quick(tmp_path):
    # ONNX Runtime comes with the bench extra, which scripts/test.sh installs: CI runs this.
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install -r requirements-bench.txt)")
    pytest.importorskip("onnx", reason="onnx not installed (pip install -r requirements-bench.txt)")
    result = _run("peers.py", tmp_path / "peers.json", 280)
    assert result["benchmark"] == "peers" and result["machine"]["onnxruntime"] != "not installed"
    variants = ("xla_fp32", "w8a32", "w8a8", "w4a8", "ort_fp32", "ort_int8")
    for row in result["rows"]:
        assert all(math.isfinite(row[f"{v}_us"]) and row[f"{v}_us"] > 0 for v in variants), row
        # The engines computed the same policy: fp32 agrees closely, int8 within quantization error.
        assert row["ort_fp32_max_abs_err"] < 1e-4 and row["ort_int8_max_abs_err"] < 0.05, row
    expected = {f"{ours}_vs_{peer}_{h}_b{b}" for peer in ("ort_int8", "ort_fp32")
                for ours, h, b in (("w8a8", 256, 1), ("w8a8", 2048, 1), ("w8a8", 2048, 8), ("w8a8", 2048, 32),
                                   ("w8a8", 2048, 64), ("w8a8", 4096, 8), ("w8a8", 4096, 64), ("w4a8", 2048, 1))}
    from actorq_jax import kernels

    amx = kernels.kernel_path() == "amx"
    if amx:  # our W8A8 also ran forced onto AVX-512 VNNI, beside the tiles
        expected |= {f"w8a8_amx_vs_vnni_{h}_b{b}" for h, b in ((2048, 32), (2048, 64), (4096, 64))}
    assert set(result["headline"]) == expected
    for row in result["rows"]:  # which code each of our kernels ran is recorded with every row
        tiles = amx and row["batch"] >= kernels.amx_min_rows("w8a8")
        assert row["paths"]["w8a8"] == ("amx tiles" if tiles else "avx512 vnni" if amx else kernels.kernel_path())
        assert ("w8a8_vnni_us" in row) == amx
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in result["headline"].values())
