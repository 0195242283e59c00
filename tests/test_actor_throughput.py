"""benchmarks/actor_throughput.py: real actor processes at K = 1 and 8 environments (--quick), and its round arithmetic."""

import json
import subprocess
import sys

import pytest
from launch_support import BENCHMARKS, ROOT

sys.path.insert(0, str(BENCHMARKS))

import actor_throughput  # noqa: E402  (a script, not a package)


@pytest.mark.process
@pytest.mark.timeout(600)
def test_actor_throughput_quick(tmp_path):
    # Four real actor processes (K = 1 and 8; fp32 and int8) against a real Reverb server, one round measured each.
    out = tmp_path / "throughput.json"
    proc = subprocess.run([sys.executable, "benchmarks/actor_throughput.py", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["envs_per_actor"], r["backend"]): r for r in result["rows"]}
    assert set(rows) == {(k, b) for k in (1, 8) for b in ("fp32", "int8")}
    for row in rows.values():
        assert row["rounds_measured"] == 1 and row["median_steps_per_s"] > 0
        # Every refresh loads a new version, so every actor spent time pulling and loading.
        assert row["inference_ms_per_step"] > 0 and row["pull_ms_per_step"] > 0 and row["adder_ms_per_step"] > 0
    headline = result["headline"]
    assert set(headline) == {"steps_per_s_speedup_int8", "steps_per_s_speedup_int8_k8", "steps_per_s_k8_over_k1_int8",
                             "adder_us_per_transition_k8"}
    steps = {case: row["median_steps_per_s"] for case, row in rows.items()}
    assert headline["steps_per_s_speedup_int8_k8"] == pytest.approx(steps[8, "int8"] / steps[8, "fp32"], rel=1e-6)
    assert headline["steps_per_s_k8_over_k1_int8"] == pytest.approx(steps[8, "int8"] / steps[1, "int8"], rel=1e-6)
    assert headline["adder_us_per_transition_k8"] > 0


def test_an_amx_machine_also_runs_the_int8_actor_held_to_vnni():
    names = lambda quick, amx: [b[0] for b in actor_throughput._backends(quick, amx)]  # noqa: E731
    assert names(False, False) == ["fp32", "int8", "int4"]
    assert names(False, True) == ["fp32", "int8", "int8_vnni", "int4"]
    assert names(True, True) == names(True, False) == ["fp32", "int8"]
    vnni = actor_throughput._backends(False, True)[2]
    assert vnni == ("int8_vnni", "int8", 8, "avx512")  # the int8 backend, its kernel path forced to AVX-512


def test_rounds_are_episodes_ending_at_the_same_step():
    phases = {f"{p}_s": 0.0 for p in actor_throughput.PHASES}
    rows = [  # K = 2: both environments end every 1000 actor steps (2000 env steps)
        {"env_steps": 2000, "wall_seconds": 10.0, **phases, "adder_s": 1.0},
        {"env_steps": 2000, "wall_seconds": 10.001, **phases},
        {"env_steps": 4000, "wall_seconds": 14.0, **phases, "adder_s": 0.2},
        {"env_steps": 4000, "wall_seconds": 14.001, **phases},
        {"env_steps": 6000, "wall_seconds": 20.001, **phases, "adder_s": 0.4},
        {"env_steps": 6000, "wall_seconds": 20.001, **phases},
    ]
    rates, per_step = actor_throughput._rounds(rows)
    assert rates == pytest.approx([2000 / 4.0, 2000 / 6.0])  # from the last row of one round to the next
    assert per_step["adder"] == pytest.approx(1e3 * 0.3 / 2000)  # median of 0.1 and 0.2 ms per env step
