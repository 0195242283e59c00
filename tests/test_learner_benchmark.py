"""benchmarks/learner.py runs end to end (--quick) and reports its headline; the learner's XLA flags are version-bound."""

import json
import math
import subprocess
import sys

import pytest
from launch_support import BENCHMARKS, ENV, ROOT, usage_error

from actorq_jax.agents.learner_xla import NO_THUNK_RUNTIME, SKIP_PASSES, learner_xla_flags

HEADLINE = ("learner_sgd_per_s_256x3", "learner_flops_fraction_256x3", "learner_sampling_overhead_256x3",
            "tensorboard_cpu_s_per_learner_row", "tensorboard_cpu_fraction_256x3")


@pytest.mark.process
@pytest.mark.timeout(900)
def test_learner_benchmark_quick_reports_finite_headline(tmp_path):
    # Two worker processes compile both agents' steps on one core: minutes on a loaded machine.
    path = tmp_path / "learner.json"
    proc = subprocess.run([sys.executable, "benchmarks/learner.py", "--quick", "--json", str(path)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["benchmark"] == "learner"
    machine = result["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["threads"] == 1
    assert len(machine["loadavg_before_1_5_15"]) == len(machine["loadavg_1_5_15"]) == 3
    for key in HEADLINE:
        assert isinstance(result["headline"][key], float) and math.isfinite(result["headline"][key]), key
        assert result["headline"][key] > 0, key
    cases = {(r["agent"], r["hidden"], r["xla"], r["variant"]) for r in result["rows"]}
    assert cases == {(agent, 256, xla, variant) for agent in ("d4pg", "dqn") for xla in ("default", "learner")
                     for variant in ("step", "donate", "scan8", "live", "matmul")}
    for row in result["rows"]:
        if row["variant"] != "matmul":
            # Both runtimes count the same FLOPs, and the fraction is FLOPs x rate over the matmul limit.
            assert row["gflop_per_step"] > 0 and row["sgd_per_s"] > 0 and row["sgd_per_cpu_s"] > 0, row
    d4pg = [r for r in result["rows"] if r["agent"] == "d4pg" and r["variant"] != "matmul"]
    assert len({r["gflop_per_step"] for r in d4pg}) == 1
    assert "| d4pg | 256 | default | step |" in proc.stdout


@pytest.mark.parametrize("version, existing, expected", [
    ("0.4.34", "", f"{NO_THUNK_RUNTIME} {SKIP_PASSES}"),
    ("0.4.34", "--xla_cpu_multi_thread_eigen=false", f"--xla_cpu_multi_thread_eigen=false {NO_THUNK_RUNTIME} {SKIP_PASSES}"),
    ("0.6.2", "", f"{NO_THUNK_RUNTIME} {SKIP_PASSES}"),
    # Before 0.4.32 the old runtime is the default; from 0.7 it is gone and the flag would break every jit.
    ("0.4.31", "", ""),
    ("0.7.0", "--xla_cpu_multi_thread_eigen=false", "--xla_cpu_multi_thread_eigen=false"),
    ("0.10.1rc1", "", ""),
    # A runtime or a list of skipped passes chosen by the user stays (XLA would take the last one given).
    ("0.4.34", "--xla_cpu_use_thunk_runtime=true", f"--xla_cpu_use_thunk_runtime=true {SKIP_PASSES}"),
    ("0.4.34", "--xla_disable_hlo_passes=algsimp", f"--xla_disable_hlo_passes=algsimp {NO_THUNK_RUNTIME}"),
])
def test_learner_xla_flags_only_where_the_runtime_exists(version, existing, expected):
    assert learner_xla_flags(existing, jaxlib_version=version) == expected


@pytest.mark.parametrize("flags, says", [
    (["--agents", "d4pg,nope"], "--agents: 'd4pg,nope'; choose a comma list from d4pg, dqn"),
    (["--sizes", "0x3"], "--sizes: '0x3'; choose a comma list from 256, 1024, 2048"),
    (["--sizes", ","], "--sizes: ','; choose"),
])
def test_bad_lists_are_usage_errors_naming_the_flag_and_value(flags, says, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    import learner as learner_benchmark

    assert says in usage_error(capsys, lambda: learner_benchmark.main(flags))


@pytest.mark.process
@pytest.mark.timeout(300)
def test_learner_gpu_benchmark_runs_its_comparison_on_cpu(tmp_path):
    # With the CPU as the "accelerator" both sides run the same program on the same platform: equal parameters.
    path = tmp_path / "learner_gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/learner_gpu.py", "--accelerator", "cpu", "--agents", "dqn",
                           "--sizes", "32", "--trials", "1", "--seconds", "0.05", "--json", str(path)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["agent"], row["hidden"]) == ("dqn", 32)
    assert row["gflop_per_step"] > 0 and row["max_rel_param_difference"] == 0.0
    for key in ("cpu:step/default", "cpu:scan8/default"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "| dqn | 32 |" in proc.stdout


@pytest.mark.process
@pytest.mark.timeout(120)
def test_learner_gpu_benchmark_names_a_platform_it_cannot_start():
    proc = subprocess.run([sys.executable, "benchmarks/learner_gpu.py", "--accelerator", "nosuchplatform",
                           "--agents", "dqn", "--sizes", "32"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert "no JAX platform 'nosuchplatform'" in proc.stderr and "Traceback" not in proc.stderr
