"""benchmarks/variables.py and benchmarks/replay.py: --quick runs end to end and reports the headline keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launch_support import BENCHMARKS, ROOT

pytestmark = pytest.mark.process


@pytest.mark.timeout(240)
def test_variables_benchmark_quick_runs(tmp_path):
    out = tmp_path / "variables.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "variables.py"), "--quick",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refresh ms" in result.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "variables"
    assert [row["bits"] for row in report["rows"]] == [32, 16, 8, 4]
    by_bits = {row["bits"]: row for row in report["rows"]}
    # Payload sizes are exact properties of the wire format, not timings.
    assert by_bits[8]["bytes_vs_32"] < 0.26 and by_bits[4]["bytes_vs_32"] < 0.13
    assert set(report["headline"]) == {"refresh_speedup_8bit", "refresh_speedup_4bit",
                                       "adder_transitions_per_s", "learner_batches_per_s"}
    assert all(value > 0 for value in report["headline"].values())


@pytest.mark.timeout(240)
def test_replay_benchmark_quick_runs(tmp_path):
    out = tmp_path / "replay.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "replay.py"), "--quick", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint s" in result.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "replay"
    assert [row["chunk_length"] for row in report["rows"]] == [1, 16]
    # Every trial stores what it wrote: the table holds all 5,000 items at either chunk length.
    assert [row["items"] for row in report["rows"]] == [5000, 5000]
    assert set(report["headline"]) == {"replay_memory_ratio_chunk16", "replay_checkpoint_speedup_chunk16",
                                       "replay_service_sample_cpu_ratio_chunk16",
                                       "replay_service_insert_cpu_ratio_chunk16"}
    assert all(value > 0 for value in report["headline"].values())


@pytest.mark.timeout(60)
def test_replay_benchmark_rejects_bad_chunk_lengths():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "replay.py"), "--chunk_lengths", "1,0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--chunk_lengths: '1,0'" in result.stderr
