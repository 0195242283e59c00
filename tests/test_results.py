"""Results tooling: analysis helpers (exact, on synthetic frames), sweep.py, plot.py, ptq_sweep.py and the notebook."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from launch_support import ENV, ROOT, TINY, load_script, usage_error

from actorq_jax import analysis

# The sweep tests share one module-scoped sweep: under pytest-xdist they stay on one worker.
pytestmark = pytest.mark.xdist_group("sweep")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The tiny D4PG run with a short budget and fewer evaluations: one run takes about a minute on a busy 2-core machine.
TINY_RUN_FLAGS = [*TINY, "--num_actors", "1", "--eval_period", "100", "--max_env_steps", "1100"]


def _run(args, timeout):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


# -- synthetic results directories ------------------------------------------------------------------------------


def _write_run(root: Path, bits: int, seed: int, evals, energy_kwh=0.01, wall_seconds=200.0,
               actor_rows=(), task="cartpole_balance", summary=True) -> Path:
    """A run directory shaped like the launcher's, with the given eval rows (wall, env_steps, learner_steps, return)."""
    run_dir = root / f"d4pg_{task}_q{bits}_s{seed}"
    (run_dir / "actors").mkdir(parents=True)
    config = {"run": {"agent": "d4pg", "task": task, "seed": seed, "actor_bits": bits, "comm_bits": None,
                      "num_actors": 1, "granularity": "per_channel", "actor_backend": "auto"},
              "agent": {"policy_layers": [8]}}
    (run_dir / "config.json").write_text(json.dumps(config))
    rows = []
    for wall, steps, lsteps, ret in evals:
        for policy, pbits in (("fp32", 32), ("actor", bits)):
            rows.append({"wall_seconds": wall, "env_steps": steps, "learner_steps": lsteps, "policy": policy,
                         "bits": pbits, "episode": 0, "return": ret, "final": 0})
    pd.DataFrame(rows).to_csv(run_dir / "eval.csv", index=False)
    if actor_rows:
        pd.DataFrame(actor_rows).to_csv(run_dir / "actors" / "actor_0.csv", index=False)
    if summary:
        final = evals[-1][3] if evals else None
        (run_dir / "summary.json").write_text(json.dumps({
            "env_steps": evals[-1][1] if evals else 0, "learner_steps": 0, "wall_seconds": wall_seconds,
            "env_steps_per_second": 10.0, "energy_kwh": energy_kwh, "emissions_kg": 0.001, "exit_code": 0,
            "final_eval_return": final, "best_eval_return": final, "final_eval_return_actor_policy": final,
            "best_eval_return_actor_policy": final, "actor_episodes": len(actor_rows),
            "actor_time_s": {"env_step": 1.0, "inference": 0.5, "adder": 2.0, "pull": 0.1, "deserialize": 0.1,
                             "load": 0.1},
        }))
    return run_dir


def _actor_row(episode, length, env_step_s, inference_s, adder_s=0.0, pull_s=0.0, deserialize_s=0.0, load_s=0.0):
    return {"actor_id": 0, "episode": episode, "env_steps": episode * length, "episode_return": 1.0,
            "episode_length": length, "wall_seconds": float(episode), "params_version": 0, "env_step_s": env_step_s,
            "inference_s": inference_s, "adder_s": adder_s, "pull_s": pull_s, "deserialize_s": deserialize_s,
            "load_s": load_s}


@pytest.fixture
def synthetic_sweep(tmp_path):
    """Two bit-widths x two seeds with known crossing times; one q8 seed never reaches 900."""
    root = tmp_path / "synthetic"
    # (wall_seconds, env_steps, learner_steps, return). The untrained policy scores 995 at learner step 0,
    # which must count neither for the target nor for reaching it.
    _write_run(root, 32, 0, [(10, 0, 0, 995.0), (50, 500, 100, 300.0), (100, 1000, 200, 950.0), (150, 1500, 300, 1000.0)],
               energy_kwh=0.010, wall_seconds=200.0, actor_rows=[_actor_row(1, 1000, 1.0, 2.0, adder_s=4.0)])
    _write_run(root, 32, 1, [(10, 0, 0, 0.0), (70, 700, 100, 800.0), (140, 1400, 200, 901.0), (180, 1800, 300, 500.0)],
               energy_kwh=0.010, wall_seconds=200.0, actor_rows=[_actor_row(1, 500, 1.0, 1.0)])
    _write_run(root, 8, 0, [(10, 0, 0, 0.0), (60, 800, 100, 905.0), (120, 1600, 200, 990.0)],
               energy_kwh=0.008, wall_seconds=200.0,
               actor_rows=[_actor_row(1, 1000, 1.0, 0.5), _actor_row(2, 1000, 1.0, 0.5, pull_s=2.0)])
    _write_run(root, 8, 1, [(10, 0, 0, 0.0), (60, 800, 100, 100.0), (120, 1600, 200, 899.0)],
               energy_kwh=0.008, wall_seconds=200.0)
    return root


# -- unit tests of the aggregation helpers ----------------------------------------------------------------------


def test_target_returns_positive_negative_and_explicit():
    points = pd.DataFrame({"task": ["a", "a", "b", "b"], "return": [500.0, 1000.0, -300.0, -100.0]})
    targets = analysis.target_returns(points, 0.9)
    assert targets["a"] == pytest.approx(900.0)
    assert targets["b"] == pytest.approx(-110.0)  # below the best, so reachable
    assert analysis.target_returns(points, 0.9, target=42.0).to_dict() == {"a": 42.0, "b": 42.0}
    with pytest.raises(ValueError, match="1.5"):
        analysis.target_returns(points, 1.5)


def test_eval_points_average_episodes_per_evaluation():
    evals = pd.DataFrame({
        "run": "r", "task": "t", "bits": 8, "seed": 0, "policy": ["fp32", "fp32", "actor", "fp32"],
        "learner_steps": [10, 10, 10, 20], "final": 0, "wall_seconds": [1.0, 2.0, 3.0, 4.0],
        "env_steps": [100, 100, 100, 200], "return": [1.0, 3.0, 50.0, 7.0], "episode": [0, 1, 0, 0],
    })
    points = analysis.eval_points(evals, "fp32")
    assert points["return"].tolist() == [2.0, 7.0]
    assert points["wall_seconds"].tolist() == [2.0, 4.0]  # an evaluation is known when its last episode ends
    assert points["episodes"].tolist() == [2, 1]
    assert analysis.eval_points(evals, "actor")["return"].tolist() == [50.0]
    with pytest.raises(ValueError, match="'greedy'"):
        analysis.eval_points(evals, "greedy")


def test_results_table_time_to_target_speedup_and_energy(synthetic_sweep):
    sweep = analysis.load_sweep(synthetic_sweep)
    table = analysis.results_table(sweep.runs, sweep.evals, target_fraction=0.9).set_index("bits")
    # Best trained return is 1000 (the untrained 995 is ignored), so the target is 900.
    assert table.loc[32, "target"] == pytest.approx(900.0)
    assert table.loc[32, "reached"] == 2 and table.loc[8, "reached"] == 1
    assert table.loc[32, "time_to_target_s"] == pytest.approx((100 + 140) / 2)
    assert table.loc[8, "time_to_target_s"] == pytest.approx(60.0)
    assert table.loc[32, "speedup"] == pytest.approx(1.0)
    assert table.loc[8, "speedup"] == pytest.approx(120.0 / 60.0)
    assert table.loc[8, "env_steps_to_target"] == pytest.approx(800.0)
    # Energy to target: run energy x share of wall time before the target.
    e32 = (10.0 * 100 / 200 + 10.0 * 140 / 200) / 2  # Wh
    e8 = 8.0 * 60 / 200
    assert table.loc[32, "energy_to_target_wh"] == pytest.approx(e32)
    assert table.loc[8, "energy_to_target_wh"] == pytest.approx(e8)
    assert table.loc[8, "energy_ratio"] == pytest.approx(e32 / e8)
    assert table.loc[8, "final_return"] == pytest.approx((990.0 + 899.0) / 2)
    assert table.loc[8, "final_return_std"] == pytest.approx(np.std([990.0, 899.0], ddof=1))
    # Without a q32 baseline there is nothing to compare with.
    only8 = sweep.select(bits=8)
    assert math.isnan(analysis.results_table(only8.runs, only8.evals)["speedup"].iloc[0])


def test_results_table_explicit_target_nobody_reaches(synthetic_sweep):
    sweep = analysis.load_sweep(synthetic_sweep)
    table = analysis.results_table(sweep.runs, sweep.evals, target=5000.0)
    assert table["reached"].tolist() == [0, 0]
    assert table["time_to_target_s"].isna().all() and table["speedup"].isna().all()


def test_curve_band_mean_range_and_seed_count():
    points = pd.DataFrame({
        "run": ["a", "a", "b", "b"], "task": "t", "bits": 8, "seed": [0, 0, 1, 1],
        "wall_seconds": [0.0, 10.0, 0.0, 5.0], "env_steps": [0, 100, 0, 50], "return": [0.0, 100.0, 20.0, 70.0],
    })
    band = analysis.curve_band(points, "wall_seconds", num=11)  # grid 0, 1, ..., 10
    at = band.set_index("wall_seconds")
    assert at.loc[0.0, "mean"] == pytest.approx(10.0) and at.loc[0.0, "n"] == 2
    assert at.loc[5.0, ["min", "max"]].tolist() == pytest.approx([50.0, 70.0])
    assert at.loc[5.0, "std"] == pytest.approx(np.std([50.0, 70.0], ddof=1))
    # Run b ended at 5 s: later grid points average run a alone, with no spread.
    assert at.loc[8.0, "mean"] == pytest.approx(80.0) and at.loc[8.0, "n"] == 1 and at.loc[8.0, "std"] == 0.0
    with pytest.raises(ValueError, match="'time'"):
        analysis.curve_band(points, "time")


def test_actor_time_breakdown_ms_per_step(synthetic_sweep):
    sweep = analysis.load_sweep(synthetic_sweep)
    breakdown = analysis.actor_time_breakdown(sweep.actors).set_index("bits")
    # q8 has one run with actor rows: 2000 steps, env_step 2 s, inference 1 s, pull 2 s.
    assert breakdown.loc[8, "env_step_ms"] == pytest.approx(1.0)
    assert breakdown.loc[8, "inference_ms"] == pytest.approx(0.5)
    assert breakdown.loc[8, "pull_ms"] == pytest.approx(1.0)
    assert breakdown.loc[8, "runs"] == 1 and breakdown.loc[8, "actor_steps"] == 2000
    # q32 averages its two runs per step: inference 2/1000 and 1/500 s per step -> 2 ms; adder (4 + 0) / 2 ms.
    assert breakdown.loc[32, "inference_ms"] == pytest.approx(2.0)
    assert breakdown.loc[32, "adder_ms"] == pytest.approx(2.0)
    assert breakdown.loc[32, "total_ms"] == pytest.approx(1.5 + 2.0 + 2.0)


def test_load_sweep_reads_runs_and_slices(synthetic_sweep, tmp_path):
    _write_run(synthetic_sweep, 16, 0, [(10, 0, 0, 1.0)], summary=False)  # a run still going: no summary.json
    summary_path = synthetic_sweep / "d4pg_cartpole_balance_q8_s1" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["machine"] = {"cpu": "AMD EPYC", "cpu_id": "AuthenticAMD family 26 model 2", "cores": 2}
    summary_path.write_text(json.dumps(summary))
    sweep = analysis.load_sweep(synthetic_sweep)
    assert sweep.runs["bits"].tolist() == [32, 32, 16, 8, 8]
    # Which machine ran it, where the summary says (two "AMD EPYC"s apart by family and model); older runs: missing.
    machines = sweep.runs["machine"]
    assert machines.isna().tolist() == [True, True, True, True, False]
    assert machines.iloc[-1] == "AMD EPYC (AuthenticAMD family 26 model 2)"
    assert sweep.runs.loc[sweep.runs["bits"] == 16, "complete"].tolist() == [False]
    assert math.isnan(sweep.runs.loc[sweep.runs["bits"] == 16, "energy_kwh"].iloc[0])
    assert set(sweep.evals["policy_bits"]) == {32, 16, 8}
    view = sweep.select(bits=[32, 8], seed=0)
    assert sorted(view.runs["bits"]) == [8, 32] and set(view.evals["seed"]) == {0} and set(view.actors["bits"]) <= {8, 32}
    with pytest.raises(FileNotFoundError, match="no runs"):
        analysis.load_sweep(tmp_path / "synthetic" / "d4pg_cartpole_balance_q8_s0" / "actors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        analysis.load_sweep(tmp_path / "missing")


def test_markdown_table_and_report_on_synthetic_sweep(synthetic_sweep, tmp_path):
    sweep = analysis.load_sweep(synthetic_sweep)
    table = analysis.results_table(sweep.runs, sweep.evals)
    text = analysis.to_markdown(analysis.display_table(table))
    lines = text.splitlines()
    assert len(lines) == 2 + 2 and lines[0].startswith("| task")
    assert "| q=8 " in lines[3] and "2.00x" in lines[3] and "1/2" in lines[3]
    written = analysis.write_report(sweep, tmp_path / "report")
    for name in ("return_vs_wall_time", "return_vs_env_steps", "actor_time_breakdown"):
        assert written[name].read_bytes()[:8] == PNG_MAGIC
    assert "## cartpole_balance" in written["results_md"].read_text()


@pytest.mark.process
@pytest.mark.timeout(150)
def test_analysis_imports_without_jax():
    code = "import sys, actorq_jax.analysis; assert 'jax' not in sys.modules, 'analysis imported jax'"
    assert _run(["-c", code], timeout=120).returncode == 0


# -- command-line checks that start no run ----------------------------------------------------------------------


@pytest.mark.parametrize("flags, named", [
    (["--bits", "32,12"], "--bits"),
    (["--bits", "32,x"], "--bits"),
    (["--seeds", "0,-1"], "--seeds"),
    (["--seeds", "0,0"], "--seeds"),
    (["--seed", "3"], "--seed"),
    (["--num_actors", "0"], "--num_actors"),
])
def test_sweep_bad_flags_exit_2_naming_the_flag(tmp_path, flags, named, capsys):
    # A stand-in run script: a flag accepted by mistake would run it, not a real run.
    script = _stand_in_run_script(tmp_path / "never_run.py", "")
    err = usage_error(capsys, lambda: load_script("sweep").run_sweep(
        ["--agent", "d4pg", "--results_dir", str(tmp_path / "s"), "--run_script", str(script), *flags]))
    assert named in err
    assert not (tmp_path / "s").exists()  # nothing started


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_sweep_script_exits_2_naming_a_bad_flag(tmp_path):
    result = _run(["experiments/sweep.py", "--agent", "d4pg", "--results_dir", str(tmp_path / "s"), "--bits", "32,12"], 100)
    assert result.returncode == 2 and "--bits" in result.stderr, result.stderr
    assert not (tmp_path / "s").exists()


def _stand_in_run_script(path: Path, body: str) -> Path:
    """A script standing in for run_<agent>.py: makes its --results_dir (as `d`, flags as `args`), then runs `body`."""
    path.write_text(
        "import json, signal, sys, time, pathlib\n"
        "args = sys.argv[1:]\n"
        "d = pathlib.Path(args[args.index('--results_dir') + 1]); d.mkdir(parents=True)\n" + body
    )
    return path


@pytest.mark.process
@pytest.mark.timeout(120)
def test_sweep_records_a_failed_run_and_goes_on(tmp_path):
    # Fails for q=16, succeeds otherwise, and records the flags it got.
    script = _stand_in_run_script(
        tmp_path / "fake_run.py",
        "(d / 'args.json').write_text(json.dumps(args))\n"
        "sys.exit(3 if args[args.index('--actor_bits') + 1] == '16' else 0)\n"
    )
    sweep_dir = tmp_path / "s"
    result = _run(["experiments/sweep.py", "--agent", "d4pg", "--bits", "32,16,8", "--seeds", "0,1",
                   "--results_dir", str(sweep_dir), "--run_script", str(script), "--max_seconds", "7",
                   "--task", "cartpole_balance"], 90)
    assert result.returncode == 1, result.stderr
    index = json.loads((sweep_dir / "sweep.json").read_text())
    runs = index["runs"]
    assert [(r["seed"], r["bits"]) for r in runs] == [(0, 32), (0, 16), (0, 8), (1, 32), (1, 16), (1, 8)]
    assert [r["exit_code"] for r in runs] == [0, 3, 0, 0, 3, 0]
    assert [r["status"] for r in runs] == ["ok", "failed", "ok", "ok", "failed", "ok"]
    assert index["passthrough"] == ["--max_seconds", "7", "--task", "cartpole_balance"]
    args = json.loads((sweep_dir / "d4pg_cartpole_balance_q8_s1" / "args.json").read_text())
    assert args[:4] == ["--max_seconds", "7", "--task", "cartpole_balance"]  # passed through unchanged
    assert args[args.index("--actor_bits") + 1] == "8" and args[args.index("--seed") + 1] == "1"
    assert "4/6 runs ok" in result.stdout


@pytest.mark.process
@pytest.mark.timeout(150)
def test_sweep_sigterm_stops_the_current_run_and_the_sweep(tmp_path):
    # A run that waits until it is told to stop, and records that it was.
    script = _stand_in_run_script(
        tmp_path / "slow_run.py",
        "def stop(*_):\n"
        "    (d / 'stopped').write_text('1'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "(d / 'started').write_text('1')\n"
        "time.sleep(120)\n"
        "sys.exit(5)\n"
    )
    sweep_dir = tmp_path / "s"
    sweep = subprocess.Popen([sys.executable, "experiments/sweep.py", "--agent", "d4pg", "--bits", "32,8",
                              "--results_dir", str(sweep_dir), "--run_script", str(script)],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        first = sweep_dir / "d4pg_cartpole_balance_q32_s0"
        deadline = time.monotonic() + 90
        while not (first / "started").exists():
            assert sweep.poll() is None and time.monotonic() < deadline, "the first run never started"
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=30) == 1
        sweep_output = sweep.stdout.read().decode()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert (first / "stopped").exists()  # the run got SIGTERM and shut down
    index = json.loads((sweep_dir / "sweep.json").read_text())
    assert index["stopped"] is True and index["finished"]
    # The stopped run exited 0 (a clean shutdown) but did not finish its budget, and the second never ran.
    assert [(r["status"], r["exit_code"]) for r in index["runs"]] == [("stopped", 0), ("not run (sweep stopped)", None)]
    assert "0/2 runs ok" in sweep_output
    assert not (sweep_dir / "d4pg_cartpole_balance_q8_s0").exists()


# -- end to end on a tiny real sweep ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """A real two-run sweep (q=32 and q=8, seed 0, tiny budgets), run once for the tests below."""
    sweep_dir = tmp_path_factory.mktemp("results") / "sweep"
    result = _run(["experiments/sweep.py", "--agent", "d4pg", "--bits", "32,8", "--seeds", "0",
                   "--results_dir", str(sweep_dir), *TINY_RUN_FLAGS], timeout=840)
    return sweep_dir, result


SWEEP_TIMEOUT = 900


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_sweep_produces_runs_and_index(tiny_sweep):
    sweep_dir, result = tiny_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    index = json.loads((sweep_dir / "sweep.json").read_text())
    assert index["agent"] == "d4pg" and index["task"] == "cartpole_balance"
    assert index["bits"] == [32, 8] and index["seeds"] == [0]
    assert "experiments/sweep.py" in index["command"] and index["finished"]
    assert [(r["bits"], r["seed"], r["exit_code"], r["status"]) for r in index["runs"]] == [(32, 0, 0, "ok"), (8, 0, 0, "ok")]
    for entry in index["runs"]:
        run_dir = sweep_dir / entry["dir"]
        assert entry["dir"] == f"d4pg_cartpole_balance_q{entry['bits']}_s0"
        for name in ("config.json", "summary.json", "eval.csv", "learner.csv", "actors/actor_0.csv"):
            assert (run_dir / name).is_file(), f"{run_dir}/{name} missing"
        assert any((run_dir / "checkpoints").iterdir())
        config = json.loads((run_dir / "config.json").read_text())
        assert config["run"]["actor_bits"] == entry["bits"] and config["run"]["seed"] == 0
        assert config["run"]["results_dir"] == str(run_dir)
        # Pass-through flags reached the run unchanged.
        assert config["agent"]["policy_layers"] == [16, 16] and config["agent"]["min_replay_size"] == 100
        assert config["run"]["max_env_steps"] == 1100 and config["run"]["num_actors"] == 1
        assert (sweep_dir / entry["log"]).is_file()


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_plot_writes_pngs_and_table(tiny_sweep, tmp_path):
    sweep_dir, _ = tiny_sweep
    out = tmp_path / "plots"
    result = _run(["experiments/plot.py", str(sweep_dir), "--out", str(out)], timeout=240)
    assert result.returncode == 0, result.stderr
    for name in ("return_vs_wall_time.png", "return_vs_env_steps.png", "actor_time_breakdown.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    table = pd.read_csv(out / "results.csv")
    assert table["bits"].tolist() == [32, 8] and table["task"].unique().tolist() == ["cartpole_balance"]
    assert table["reached"].sum() >= 1  # the target is a fraction of the best return some run reached
    assert np.isfinite(table["final_return"]).all()
    markdown = (out / "results.md").read_text()
    assert "## cartpole_balance" in markdown and "| q=32" in markdown and "| q=8" in markdown
    assert "| q=8" in result.stdout and "time to target (s)" in result.stdout  # the printed table


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_notebook_executes_on_the_sweep(tiny_sweep, monkeypatch):
    import nbclient
    import nbformat

    sweep_dir, _ = tiny_sweep
    monkeypatch.setenv("ACTORQ_SWEEP_DIR", str(sweep_dir))  # the kernel inherits the environment
    notebook = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=240,
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError on any failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"2 runs in {sweep_dir}" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3  # wall time, env steps, actor time
    assert any("time to target" in o.get("data", {}).get("text/markdown", "") for o in outputs)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TIMEOUT)
def test_ptq_sweep_writes_one_row_per_bits(tiny_sweep, tmp_path):
    sweep_dir, _ = tiny_sweep
    out = tmp_path / "ptq.csv"
    result = _run(["experiments/ptq_sweep.py", "--checkpoint", str(sweep_dir / "d4pg_cartpole_balance_q32_s0"),
                   "--bits", "32,8,4", "--episodes", "1", "--min_size", "1", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    ptq = pd.read_csv(out)
    # (--min_size 1: the tiny run's kernels are all smaller than the default 1024 elements, which stay float.)
    assert ptq["bits"].tolist() == [4, 8, 32] and ptq["granularity"].unique().tolist() == ["per_channel"]
    assert np.isfinite(ptq[["mean_return", "std_return", "min_return", "max_return"]].to_numpy()).all()
    assert (ptq["episodes"] == 1).all() and (ptq["min_return"] <= ptq["max_return"]).all()
    err = ptq.set_index("bits")["weight_rel_error"]
    assert err[32] == 0.0 and 0.0 < err[8] < err[4]  # fewer bits, coarser weights
    assert ptq.set_index("bits").loc[32, "quantized_fraction"] == 0.0
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.process
@pytest.mark.timeout(300)
def test_ptq_sweep_int8_runs_the_packing_int8_actors_run(tmp_path):
    # A run directory holding an untrained D4PG learner's checkpoint: enough for the sweep to restore and play.
    import jax

    from actorq_jax.agents.d4pg.config import D4PGConfig
    from actorq_jax.environments import environment_spec, make_environment
    from actorq_jax.launch import runtime
    from actorq_jax.launch.checkpoint import Checkpointer
    from actorq_jax.launch.config import RunConfig, save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = RunConfig(agent="d4pg", task="cartpole_balance", results_dir=str(run_dir))
    agent_config = D4PGConfig(policy_layers=(32, 32), critic_layers=(32, 32))
    save_config(run_dir / "config.json", run, agent_config)
    spec = environment_spec(make_environment(run.task, seed=0))
    builder = runtime.make_builder(run.agent, agent_config, spec)
    checkpointer = Checkpointer(run_dir / "checkpoints")
    checkpointer.save(0, builder.init_state(jax.random.PRNGKey(0)), {})
    checkpointer.close()
    out = tmp_path / "ptq.csv"
    result = _run(["experiments/ptq_sweep.py", "--checkpoint", str(run_dir), "--bits", "4,8,16,32", "--episodes", "1",
                   "--backend", "int8", "--out", str(out)], timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    ptq = pd.read_csv(out, keep_default_na=False).set_index("bits")
    # As the actors' loader packs them (int8_mode w8a8): two 4-bit weights per byte, 8-bit activations throughout.
    assert ptq["backend"].to_dict() == {4: "int8", 8: "int8", 16: "fakequant", 32: "fp32"}
    assert ptq["kernel_mode"].to_dict() == {4: "w4a8", 8: "w8a8", 16: "", 32: ""}


@pytest.mark.parametrize("bits, named", [("32", "--checkpoint"), ("9", "--bits")])
def test_ptq_sweep_bad_flags_exit_2(tmp_path, capsys, bits, named):
    err = usage_error(capsys, lambda: load_script("ptq_sweep").main(["--checkpoint", str(tmp_path), "--bits", bits]))
    assert named in err


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_ptq_sweep_script_exits_2_naming_a_bad_flag(tmp_path):
    result = _run(["experiments/ptq_sweep.py", "--checkpoint", str(tmp_path), "--bits", "9"], 100)
    assert result.returncode == 2 and "--bits" in result.stderr, result.stderr


def test_final_and_best_returns_of_one_run_as_the_launcher_summarises_them():
    from actorq_jax.analysis.aggregate import final_and_best_returns

    evals = pd.DataFrame({
        "wall_seconds": [1, 2, 3, 4, 5, 6], "env_steps": [0, 10, 10, 20, 30, 30],
        "learner_steps": [0, 100, 100, 200, 200, 200], "policy": ["fp32", "fp32", "fp32", "fp32", "fp32", "actor"],
        "bits": [32, 32, 32, 32, 32, 8], "episode": [0, 0, 1, 0, 0, 0], "return": [1.0, 5.0, 9.0, 3.0, 4.0, 8.0],
        "final": [0, 0, 0, 0, 1, 1],
    })
    # Evaluation at step 100 averages its two episodes (7.0, the best); the final one (4.0) is final.
    assert final_and_best_returns(evals, "fp32") == (4.0, 7.0)
    assert final_and_best_returns(evals, "actor") == (8.0, 8.0)
    periodic_only = evals[evals["final"] == 0]
    assert final_and_best_returns(periodic_only, "fp32") == (3.0, 7.0)  # the last periodic evaluation
    final, best = final_and_best_returns(pd.DataFrame(), "fp32")
    assert final != final and best != best  # NaN: never evaluated


def test_skip_existing_keeps_finished_runs_and_refuses_one_cut_short(tmp_path, capsys):
    sweep = load_script("sweep")
    sweep_dir = tmp_path / "s"
    done, stopped = sweep_dir / "d4pg_cartpole_balance_q32_s0", sweep_dir / "d4pg_cartpole_balance_q8_s0"
    for run_dir, events in ((done, ["wall-clock budget reached (7 s)"]), (stopped, ["stop requested; shutting down"])):
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"exit_code": 0, "events": events, "wall_seconds": 7.0}))
    assert sweep.unfinished(done) is None
    assert sweep.unfinished(stopped) == "it was stopped before its budget"
    code = sweep.run_sweep(["--agent", "d4pg", "--bits", "32,8", "--results_dir", str(sweep_dir), "--skip_existing",
                            "--task", "cartpole_balance", "--max_seconds", "7"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{stopped} did not finish (it was stopped before its budget)" in err and str(done) not in err
