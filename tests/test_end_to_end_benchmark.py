"""benchmarks/end_to_end.py: per-run figures from a results directory, and a --quick smoke run of real runs."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from launch_support import BENCHMARKS, ENV, ROOT, usage_error

from actorq_jax.analysis.run_figures import bottleneck, core_load, measure_run
from actorq_jax.telemetry import EVAL_FIELDS, CsvLogger, write_json

HEADLINE = ("time_to_target_speedup_q8", "time_to_target_speedup_q8_at_least", "energy_to_target_ratio_q8",
            "env_steps_per_s_ratio_q8", "learner_steps_per_s_ratio_q8", "final_return_q32", "final_return_q8",
            "runs_reached_target_q32", "runs_reached_target_q8")
TO_TARGET = ("time_to_target_speedup_q8", "time_to_target_speedup_q8_at_least", "energy_to_target_ratio_q8")


def _fake_run(tmp_path: Path, returns, wall_seconds: float = 100.0) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_json(run_dir / "summary.json", {
        "wall_seconds": wall_seconds, "env_steps": 5000, "learner_steps": 400, "energy_kwh": 0.002,
        "final_eval_return": returns[-1],
        "actor_time_s": {"env_step": 10.0, "inference": 30.0, "adder": 5.0, "pull": 1.0, "deserialize": 0.5, "load": 0.5},
    })
    with CsvLogger(run_dir / "eval.csv", EVAL_FIELDS) as log:
        for i, value in enumerate(returns):
            final = int(i == len(returns) - 1)
            log.write({"wall_seconds": 20.0 * (i + 1), "env_steps": 1000 * (i + 1), "learner_steps": 100 * i,
                       "policy": "fp32", "bits": 32, "episode": 0, "return": value, "final": final})
            log.write({"wall_seconds": 20.0 * (i + 1), "env_steps": 1000 * (i + 1), "learner_steps": 100 * i,
                       "policy": "actor", "bits": 8, "episode": 0, "return": 1000.0, "final": final})
    return run_dir


def test_time_env_steps_and_energy_to_target(tmp_path):
    figures = measure_run(_fake_run(tmp_path, [100.0, 950.0, 990.0, 980.0]), threshold=900.0)
    assert figures["reached"] and figures["time_to_target_s"] == 40.0 and figures["env_steps_to_target"] == 2000
    assert figures["energy_to_target_kwh"] == pytest.approx(0.002 * 40.0 / 100.0)
    assert figures["env_steps_per_s"] == 50.0 and figures["learner_steps_per_s"] == 4.0
    assert figures["final_return"] == 980.0
    assert figures["bound_by"].startswith("actor inference")


def test_the_bottleneck_line_says_when_the_launcher_found_the_replay_table_at_its_floor(tmp_path):
    run_dir = _fake_run(tmp_path, [100.0, 200.0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "replay held" not in measure_run(run_dir, threshold=900.0)["bound_by"]
    # The launcher's own event, as ReplayWindowWatch words it.
    from actorq_jax.agents.d4pg.config import D4PGConfig
    from actorq_jax.launch.launcher import ReplayWindowWatch

    watch = ReplayWindowWatch(D4PGConfig(rate_limiter="min_size", max_times_sampled=8), hold_s=1.0)
    event = [watch.update(t, 10 + t, 1000) for t in (0.0, 2.0)][-1]
    write_json(run_dir / "summary.json", {**summary, "events": ["replay service up", event]})
    bound = measure_run(run_dir, threshold=900.0)["bound_by"]
    assert bound.startswith("actor inference") and bound.endswith("learner at the data bound, replay held at "
                                                                   "--min_replay_size"), bound


def test_a_run_that_misses_the_target_is_not_reached_and_never_counts_its_budget(tmp_path):
    # The actors' policy reaches 1000 but only fp32 evaluations count.
    figures = measure_run(_fake_run(tmp_path, [100.0, 200.0, 850.0]), threshold=900.0)
    assert not figures["reached"]
    assert math.isnan(figures["time_to_target_s"]) and math.isnan(figures["env_steps_to_target"])
    assert math.isnan(figures["energy_to_target_kwh"])
    assert figures["last_eval_s"] == 60.0  # watched that long without reaching it: a floor on its time to target


def test_the_final_evaluation_counts_for_reaching_the_target(tmp_path):
    figures = measure_run(_fake_run(tmp_path, [100.0, 200.0, 950.0]), threshold=900.0)
    assert figures["reached"] and figures["time_to_target_s"] == 60.0 and figures["env_steps_to_target"] == 3000


def test_a_run_stopped_before_any_evaluation_has_nan_figures_not_an_error(tmp_path):
    run_dir = _fake_run(tmp_path, [100.0])
    (run_dir / "eval.csv").write_text("")
    summary = json.loads((run_dir / "summary.json").read_text())
    write_json(run_dir / "summary.json", {**summary, "final_eval_return": None})
    figures = measure_run(run_dir, threshold=900.0)
    assert not figures["reached"] and math.isnan(figures["final_return"]) and math.isnan(figures["time_to_target_s"])
    assert math.isnan(figures["last_eval_s"])


def test_bottleneck_names_the_limiter_when_actors_mostly_wait():
    assert bottleneck({"env_step": 1.0, "inference": 1.0, "rate_limit_wait": 8.0}).startswith("learner")
    assert bottleneck({"env_step": 5.0, "inference": 1.0, "adder": 1.0}).startswith("env")
    assert bottleneck({}).startswith("unknown")


def test_bottleneck_names_the_actors_core_when_their_phases_mostly_wait_for_cpu():
    wall = {"env_step": 2.0, "inference": 1.0, "adder": 6.0, "rate_limit_wait": 1.0}
    assert bottleneck(wall).startswith("replay writes (60%")
    waiting = bottleneck(wall, {"env_step": 1.8, "inference": 0.9, "adder": 1.5, "rate_limit_wait": 0.0})
    assert waiting.startswith("CPU on the actors' cores (actors computing 47% of their working time")
    assert waiting.endswith("largest phase replay writes (60% of actor time))")
    computing = bottleneck(wall, {"env_step": 1.9, "inference": 1.0, "adder": 5.0})
    assert computing.startswith("replay writes (60%")  # the writes themselves took the time


CPU_S = {"learner": 60.0, "replay": 40.0, "actor_0": 30.0, "actor_1": 20.0, "evaluator": 5.0}


def test_core_load_counts_every_process_on_the_actors_cores_and_only_those():
    pinned = {"learner": [0], "replay": [1], "actor_0": [1], "actor_1": [1], "evaluator": [1]}
    load = core_load({"wall_seconds": 100.0, "worker_cpu_s": CPU_S, "worker_cores": pinned}, {})
    assert load == pytest.approx({"busy": 0.95, "actors": 0.5, "replay service": 0.4, "evaluator": 0.05})
    # Without recorded cores, the layout and the machine's core count give the same placement.
    inferred = core_load({"wall_seconds": 100.0, "worker_cpu_s": CPU_S}, {"layout": "pinned"}, cores=2)
    assert inferred == pytest.approx(load)
    assert core_load({"wall_seconds": 100.0, "worker_cpu_s": CPU_S}, {"layout": "pinned"}) is None  # cores unknown
    # Shared: everyone, the learner included, on both cores.
    shared = core_load({"wall_seconds": 100.0, "worker_cpu_s": CPU_S}, {"layout": "shared"}, cores=2)
    assert shared["busy"] == pytest.approx(155.0 / 200.0) and shared["learner"] == pytest.approx(0.3)
    # Explicit flags win over the layout: the replay service on the learner's core does not share the actors'.
    flags = {"layout": "pinned", "replay_cpus": "0", "actor_cpus": "1"}
    apart = core_load({"wall_seconds": 100.0, "worker_cpu_s": CPU_S}, flags, cores=2)
    assert "replay service" not in apart and apart["busy"] == pytest.approx(0.55)
    assert core_load({"wall_seconds": 100.0}, {"layout": "pinned"}, cores=2) is None  # CPU not measured


def test_bottleneck_names_who_filled_the_actors_cores_when_they_were_full():
    wall = {"env_step": 2.0, "inference": 1.0, "adder": 6.0, "rate_limit_wait": 0.0}
    cpu = {"env_step": 1.9, "inference": 1.0, "adder": 5.0}
    full = bottleneck(wall, cpu, {"busy": 0.97, "actors": 0.55, "replay service": 0.38, "evaluator": 0.04})
    assert full == ("CPU on the actors' cores (97% busy: actors 55%, replay service 38%, evaluator 4%; "
                    "largest actor phase replay writes (67% of actor time))")
    assert bottleneck(wall, cpu, {"busy": 0.6, "actors": 0.6}).startswith("replay writes (67%")  # room left


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_benchmark_runs_real_runs_and_reports_every_headline_key(tmp_path):
    out = tmp_path / "e2e.json"
    # Keys and plumbing are checked here, not values: each run stops at 100 learner steps. The budget is far
    # above what that takes, so that a slow or busy machine still ends every run by its steps, evaluated (a run
    # stopped by its budget before its evaluator started has NaN figures). One layout: the shared one differs
    # only in the runs' --layout flag and its keys' suffix (tested without runs below).
    proc = subprocess.run([sys.executable, "benchmarks/end_to_end.py", "--quick", "--layouts", "pinned",
                           "--max_seconds", "300", "--json", str(out), "--results_dir", str(tmp_path / "runs"),
                           "--", "--max_learner_steps", "100"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in HEADLINE:
        assert key in report["headline"], key
        value = report["headline"][key]
        # Time and energy ratios are null when a side reached no target (a miss is never its budget).
        assert (value is None and key in TO_TARGET) or math.isfinite(value), (key, value)
    assert {(r["layout"], r["bits"]) for r in report["rows"]} == {("pinned", 32), ("pinned", 8)}
    assert all(json.loads((Path(r["run_dir"]) / "config.json").read_text())["run"]["layout"] == "pinned"
               for r in report["rows"])
    assert report["machine"]["cpu"] and "bound by" in proc.stdout
    # What the q=8 actors ran is said before the runs and kept with the figures (this checkout's kernel).
    from actorq_jax import kernels

    said = kernels.describe_kernel().split(",")[0]  # "int8 kernel: avx512 path" (the thread count may differ)
    assert said in report["config"]["int8_kernel"] and f"[end_to_end] {said}" in proc.stdout
    # The index that report.py --collect records with the runs: the command and every finished run.
    index = json.loads((tmp_path / "runs" / "sweep.json").read_text())
    assert "benchmarks/end_to_end.py --quick --layouts pinned" in index["command"] and index["finished"]
    assert sorted(r["name"] for r in index["runs"]) == ["d4pg_pinned_q32_s0", "d4pg_pinned_q8_s0"]
    # Return against wall time, one figure per layout.
    assert [Path(f).name for f in report["figures"]] == ["return_vs_wall_pinned.png"]
    assert all(Path(f).stat().st_size > 10_000 for f in report["figures"])


@pytest.mark.parametrize("flags, says", [
    (["--seeds", "0"], "--seeds: must be >= 1, got 0"),
    (["--max_times_sampled", "-2"], "--max_times_sampled: must be >= 1, got -2"),
])
def test_bad_counts_are_usage_errors_naming_the_flag_and_value(flags, says, tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    from end_to_end import main

    assert says in usage_error(capsys, lambda: main([*flags, "--results_dir", str(tmp_path / "e2e")]))
    assert not (tmp_path / "e2e").exists()  # nothing ran


def test_each_layout_has_its_headline_keys_computed_from_its_own_runs():
    sys.path.insert(0, str(BENCHMARKS))
    from end_to_end import headline

    def row(layout, bits, seconds, env_rate):
        return {"layout": layout, "bits": bits, "time_to_target_s": seconds, "energy_to_target_kwh": seconds / 1000,
                "env_steps_per_s": env_rate, "learner_steps_per_s": env_rate / 10, "final_return": 950.0,
                "reached": seconds == seconds}

    rows = [row("pinned", 32, 200.0, 1000.0), row("pinned", 8, 100.0, 1500.0),
            row("shared", 32, 300.0, 900.0), row("shared", 8, math.nan, 1800.0)]
    pinned, shared = headline(rows, "pinned"), headline(rows, "shared")
    assert set(pinned) == set(HEADLINE) and set(shared) == {f"{k}_shared" for k in HEADLINE}
    assert pinned["time_to_target_speedup_q8"] == 2.0 and pinned["env_steps_per_s_ratio_q8"] == 1.5
    assert shared["env_steps_per_s_ratio_q8_shared"] == 2.0 and shared["runs_reached_target_q8_shared"] == 0.0
    assert math.isnan(shared["time_to_target_speedup_q8_shared"])  # q=8 reached nothing: no ratio, never its budget
    assert pinned["time_to_target_speedup_q8_at_least"] == 2.0  # no miss: the bound is the speedup
    assert math.isnan(shared["time_to_target_speedup_q8_at_least_shared"])


def test_a_q32_miss_bounds_the_speedup_from_below_by_how_long_it_was_watched():
    from actorq_jax.analysis.run_figures import speedup_at_least

    def row(bits, seconds, last_eval):
        return {"layout": "pinned", "bits": bits, "reached": seconds == seconds, "time_to_target_s": seconds,
                "last_eval_s": last_eval}

    q32 = [row(32, 1200.0, 1200.0), row(32, math.nan, 1790.0), row(32, math.nan, 1795.0)]
    q8 = [row(8, 600.0, 600.0), row(8, 700.0, 700.0), row(8, 800.0, 800.0)]
    # Misses count as their last evaluation's time: (1200 + 1790 + 1795) / 3 over (600 + 700 + 800) / 3.
    assert speedup_at_least(q32, q8) == pytest.approx(4785 / 2100)
    # One q=8 miss: its mean would be over the faster runs only, so no bound.
    assert math.isnan(speedup_at_least(q32, [*q8[:2], row(8, math.nan, 1800.0)]))


def test_a_finished_run_with_the_same_flags_is_kept_and_any_other_is_run_again(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from end_to_end import _finished_with

    from actorq_jax.launch.config import save_config
    from actorq_jax.launch.flags import parse_run

    run_dir = tmp_path / "d4pg_shared_q8_s2"
    flags = ["--task", "cartpole_balance", "--actor_bits", "8", "--seed", "2", "--num_actors", "2",
             "--max_seconds", "300", "--results_dir", str(run_dir), "--policy_layers", "256,256,256"]
    assert not _finished_with(run_dir, "d4pg", flags)  # nothing there yet
    run_dir.mkdir()
    run, agent_config = parse_run("d4pg", flags)
    save_config(run_dir / "config.json", dataclasses.replace(run, port=43210), agent_config)
    assert not _finished_with(run_dir, "d4pg", flags)  # no summary: it did not finish
    write_json(run_dir / "summary.json", {"exit_code": 1})
    assert not _finished_with(run_dir, "d4pg", flags)  # it failed
    write_json(run_dir / "summary.json", {"exit_code": 0})
    assert _finished_with(run_dir, "d4pg", flags)
    # Any other run flag or agent flag means another run.
    assert not _finished_with(run_dir, "d4pg", [*flags[:9], "400", *flags[10:]])
    assert not _finished_with(run_dir, "d4pg", [*flags[:-1], "256,256"])
