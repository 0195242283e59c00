"""One definition of time to target, record sets, and experiments/report.py over a hand-made record set."""

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from launch_support import ROOT, load_script

from actorq_jax import analysis

RECORDS = ROOT / "tests" / "data" / "records"
COLUMNS = ["wall_seconds", "env_steps", "learner_steps", "policy", "bits", "episode", "return", "final"]


def _evals(rounds):
    """eval.csv rows of one run from (wall, env_steps, learner_steps, final, [fp32 episode returns])."""
    rows = [(wall, steps, lsteps, "fp32", 32, episode, value, final)
            for wall, steps, lsteps, final, returns in rounds for episode, value in enumerate(returns)]
    return pd.DataFrame(rows, columns=COLUMNS)


# -- time to target ---------------------------------------------------------------------------------------------


def test_a_hit_is_the_first_evaluation_whose_mean_over_episodes_reaches_the_target():
    evals = _evals([(10, 100, 50, 0, [850, 1000]), (20, 200, 100, 0, [900, 920]), (30, 300, 150, 0, [990, 990]),
                    (40, 400, 200, 1, [995, 995])])
    reach = analysis.time_to_target(evals, 900.0)
    # 925 at 10 s is a mean over episodes (850, 1000): the first evaluation reaches 900, not the single 1000 row.
    assert reach == analysis.TargetReach(True, 10.0, 100.0, 50.0, 925.0)
    assert analysis.time_to_target(evals, 950.0).wall_seconds == 30.0  # reaching counts (>=), first not best


def test_best_return_leaves_out_the_untrained_policy_like_time_to_target():
    # The step-0 evaluation (no SGD step yet) scored 680, above every trained one: it is not the run's best.
    evals = _evals([(0, 0, 0, 0, [660, 700]), (10, 100, 50, 0, [300, 340]), (20, 200, 100, 1, [420, 400])])
    assert analysis.final_and_best_returns(evals) == (410.0, 410.0)  # final 410; best of 320 and 410
    assert not analysis.time_to_target(evals, 650.0).reached
    final, best = analysis.final_and_best_returns(_evals([(0, 0, 0, 1, [500])]))  # never trained: no best
    assert final == 500.0 and math.isnan(best)


def test_a_miss_is_nan_and_not_reached_never_the_budget():
    reach = analysis.time_to_target(_evals([(10, 100, 50, 0, [100, 200]), (20, 200, 100, 1, [899, 900])]), 900.0)
    assert not reach.reached
    assert all(math.isnan(v) for v in (reach.wall_seconds, reach.env_steps, reach.learner_steps, reach.eval_return))
    assert not analysis.time_to_target(pd.DataFrame(columns=COLUMNS), 900.0).reached


def test_the_final_evaluation_counts_when_it_is_the_only_hit():
    reach = analysis.time_to_target(_evals([(10, 100, 50, 0, [100]), (20, 200, 100, 0, [500]),
                                            (25, 210, 100, 1, [950])]), 900.0)
    assert reach.reached and reach.wall_seconds == 25.0 and reach.env_steps == 210.0


def test_a_nan_episode_makes_its_evaluation_reach_nothing():
    evals = _evals([(10, 100, 50, 0, [float("nan"), 1000]), (20, 200, 100, 0, [950, 950])])
    assert analysis.time_to_target(evals, 900.0).wall_seconds == 20.0
    assert not analysis.time_to_target(_evals([(10, 100, 50, 1, [float("nan")])]), 0.0).reached
    assert not analysis.time_to_target(evals, float("nan")).reached


def test_the_untrained_policy_and_the_actors_policy_do_not_count():
    evals = _evals([(5, 0, 0, 0, [990]), (10, 100, 50, 0, [100])])
    actor = pd.DataFrame([(7, 50, 25, "actor", 8, 0, 1000.0, 0)], columns=COLUMNS)
    assert not analysis.time_to_target(pd.concat([evals, actor]), 900.0).reached
    assert analysis.time_to_target(evals, 900.0, min_learner_steps=0).wall_seconds == 5.0


def test_time_to_target_takes_one_run_and_run_time_to_target_many():
    one = _evals([(10, 100, 50, 0, [950])]).assign(run="a", task="t", bits=8, seed=0)
    two = _evals([(10, 100, 50, 0, [850])]).assign(run="b", task="t", bits=8, seed=1)
    with pytest.raises(ValueError, match="one run"):
        analysis.time_to_target(pd.concat([one, two]), 900.0)
    table = analysis.run_time_to_target(pd.concat([one, two]), pd.Series({"t": 900.0})).set_index("run")
    assert table.loc["a", "reached"] and table.loc["a", "time_to_target_s"] == 10.0
    assert not table.loc["b", "reached"] and math.isnan(table.loc["b", "time_to_target_s"])


# -- the RQ2 table over the committed test records ----------------------------------------------------------------


def _cell(markdown: str, first_cells, column: str) -> str:
    """The cell under `column` in the markdown table row that starts with `first_cells`."""
    tables = [block for block in markdown.split("\n\n") if block.startswith("|")]
    for table in tables:
        lines = table.splitlines()
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        if column not in header:
            continue
        for line in lines[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[:len(first_cells)] == list(first_cells):
                return cells[header.index(column)]
    raise AssertionError(f"no row {first_cells} with column {column!r}")


def test_report_regenerates_the_rq2_block_from_records(tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Results\n\nbefore\n<!-- report:rq2 -->\nstale\n<!-- /report:rq2 -->\nafter\n")
    report = load_script("report")
    argv = ["--records", str(RECORDS), "--results_md", str(results_md), "--figures", str(tmp_path / "figures")]
    assert report.main(argv) == 0
    text = results_md.read_text()
    assert "stale" not in text and text.startswith("# Results\n\nbefore\n") and text.endswith("after\n")
    # q=32: final returns 990 and 970 (means over each final evaluation's two episodes): 980 +- 14.1 (sample std).
    assert _cell(text, ["d4pg", "cartpole_balance", "q=32"], "final return (fp32 policy)") == "980.0 ± 14.1"
    # Best: 1000 (s0) and 970 (s1, whose periodic evaluations stayed below its final one).
    assert _cell(text, ["d4pg", "cartpole_balance", "q=32"], "best return (fp32 policy)") == "985.0 ± 21.2"
    assert _cell(text, ["d4pg", "cartpole_balance", "q=4"], "final return (actors' precision)") == "800.0"
    # q=4's 940 is within 5% of 980 (>= 931).
    assert _cell(text, ["d4pg", "cartpole_balance"], "fewest bits with final return within 5% of q=32's") == "q=4"
    assert "command `python experiments/sweep.py --agent d4pg" in text and "Test CPU (2 cores)" in text
    assert (tmp_path / "figures" / "rq2_return_vs_bits.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # --check: the file now matches; a hand edit inside the block does not.
    assert report.main([*argv, "--check"]) == 0
    results_md.write_text(text.replace("980.0 ± 14.1", "981.0 ± 14.1"))
    assert report.main([*argv, "--check"]) == 1


def test_report_refuses_a_results_file_without_the_study_markers(tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Results\n")
    report = load_script("report")
    assert report.main(["--records", str(RECORDS), "--results_md", str(results_md), "--check"]) == 1
    assert "<!-- report:rq2 -->" in capsys.readouterr().err


def test_report_refuses_a_records_folder_that_is_not_there_and_writes_nothing(tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Results\n")
    report = load_script("report")
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--records", str(tmp_path / "no_records"), "--results_md", str(results_md)])
    assert exit_info.value.code == 2
    assert f"--records: {tmp_path / 'no_records'} is not a directory of record sets" in capsys.readouterr().err
    assert results_md.read_text() == "# Results\n"


def test_collect_refuses_a_study_without_a_table_naming_it_and_records_nothing(tmp_path, capsys):
    report = load_script("report")
    records = tmp_path / "records"
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--records", str(records), "--collect", str(RECORDS / "rq2"), "--study", "rq22"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--study: 'rq22' has no table of record" in err and "rq1, rq2, rq3, rq4" in err
    assert not records.exists()


def test_collect_refuses_a_source_without_a_finished_run_and_records_nothing(tmp_path, capsys):
    report = load_script("report")
    records, empty = tmp_path / "records", tmp_path / "empty_sweep"
    (empty / "d4pg_cartpole_balance_q8_s0").mkdir(parents=True)
    (empty / "d4pg_cartpole_balance_q8_s0" / "config.json").write_text("{}")  # still going: no summary yet
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--records", str(records), "--collect", str(RECORDS / "rq2"), str(empty), "--study", "rq2"])
    assert exit_info.value.code == 2
    assert f"--collect: no finished run (a run folder whose summary.json says it ran its budget) under {empty}" in (
        capsys.readouterr().err)
    assert not records.exists()  # the good source is not recorded either
    with pytest.raises(ValueError, match="holds no finished run"):
        analysis.collect(empty, records, "rq2")
    assert not records.exists()


def test_fewest_bits_is_none_when_no_lower_bit_width_is_within_tolerance():
    table = pd.DataFrame({"agent": "d4pg", "task": "t", "bits": [32, 8, 4], "final": [1000.0, 940.0, 980.0]})
    assert analysis.fewest_bits_within(table, 0.05) == {("d4pg", "t"): 4}
    assert analysis.fewest_bits_within(table, 0.01) == {("d4pg", "t"): None}
    assert analysis.fewest_bits_within(table[table["bits"] < 32], 0.05) == {("d4pg", "t"): None}
    negative = pd.DataFrame({"agent": "dqn", "task": "Acrobot-v1", "bits": [32, 8], "final": [-100.0, -104.0]})
    assert analysis.fewest_bits_within(negative, 0.05) == {("dqn", "Acrobot-v1"): 8}


# -- collecting records -----------------------------------------------------------------------------------------------


def _copy_run(src: Path, dst: Path) -> None:
    for path in src.rglob("*"):
        if path.is_file():
            (dst / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / path.relative_to(src)).write_bytes(path.read_bytes())


def test_collect_records_finished_runs_without_checkpoints_or_logs(tmp_path):
    sweep = tmp_path / "sweep"
    finished = sweep / "d4pg_cartpole_balance_q4_s0"
    _copy_run(RECORDS / "rq2" / finished.name, finished)
    (finished / "learner.csv").write_text("learner_steps,wall_seconds\n1,1.0\n")
    (finished / "actors").mkdir()
    (finished / "actors" / "actor_0.csv").write_text("episode\n0\n")
    (finished / "checkpoints" / "300").mkdir(parents=True)
    (finished / "checkpoints" / "300" / "state").write_bytes(b"\0" * 64)
    (finished / "logs").mkdir()
    (finished / "logs" / "learner.log").write_text("log\n")
    running = sweep / "d4pg_cartpole_balance_q8_s0"
    _copy_run(RECORDS / "rq2" / "d4pg_cartpole_balance_q32_s0", running)
    (running / "summary.json").unlink()  # still going
    stopped = sweep / "d4pg_cartpole_balance_q6_s0"
    _copy_run(RECORDS / "rq2" / "d4pg_cartpole_balance_q32_s0", stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    summary["events"] = [*summary.get("events", []), "stop requested; shutting down"]  # a signal, not its budget
    (stopped / "summary.json").write_text(json.dumps(summary))
    (sweep / "sweep.json").write_text('{"command": "python experiments/sweep.py", "started": "2026-01-01T00:00:00+00:00"}')
    written = analysis.collect(sweep, tmp_path / "records", "rq2")
    assert [p.name for p in written] == [finished.name]
    record = tmp_path / "records" / "rq2" / finished.name
    assert sorted(str(p.relative_to(record)) for p in record.rglob("*") if p.is_file()) == [
        "actors/actor_0.csv", "config.json", "eval.csv", "learner.csv", "summary.json"]
    study = analysis.read_study(tmp_path / "records" / "rq2")
    assert study["sources"]["sweep"]["runs_collected"] == [finished.name]
    assert study["sources"]["sweep"]["command"] == "python experiments/sweep.py"
    assert (tmp_path / "records" / "rq2" / "sweeps" / "sweep.json").is_file()
    # Collecting again replaces the record (a re-collect at the end of a sweep adds what finished since).
    (finished / "eval.csv").write_text((finished / "eval.csv").read_text() + "40,4000,400,fp32,32,0,1000,0\n")
    analysis.collect(sweep, tmp_path / "records", "rq2")
    assert (record / "eval.csv").read_text().endswith("40,4000,400,fp32,32,0,1000,0\n")
    with pytest.raises(ValueError, match="plain folder name"):
        analysis.collect(sweep, tmp_path / "records", "../elsewhere")
    # One run of a sweep collected on its own is recorded under its sweep, with the sweep's command.
    assert [p.name for p in analysis.collect(finished, tmp_path / "records", "rq4")] == [finished.name]
    source = analysis.read_study(tmp_path / "records" / "rq4")["sources"]
    assert list(source) == ["sweep"] and source["sweep"]["command"] == "python experiments/sweep.py"
    assert source["sweep"]["runs_collected"] == [finished.name]
    # Another source with a run of the same name: both are kept, the newcomer's under its source's name.
    other = tmp_path / "other_grid" / finished.name
    _copy_run(finished, other)
    assert [p.name for p in analysis.collect(other.parent, tmp_path / "records", "rq4")] == [f"other_grid_{finished.name}"]
    sources = analysis.read_study(tmp_path / "records" / "rq4")["sources"]
    assert sources["sweep"]["runs_collected"] == [finished.name]
    assert sources["other_grid"]["runs_collected"] == [f"other_grid_{finished.name}"]
    assert (tmp_path / "records" / "rq4" / finished.name / "summary.json").is_file()


def _e2e_run(root: Path, bits: int, wall_to_900: float, env_steps: int, task: str = "cartpole_balance",
             seed: int = 0) -> str:
    """A finished pinned end-to-end run of `bits` whose second evaluation reaches 900 at wall_to_900 s (never, at
    NaN: it returns 800 there)."""
    from actorq_jax.launch.config import save_config
    from actorq_jax.launch.flags import parse_run
    from actorq_jax.telemetry import write_json

    name = f"d4pg_pinned_q{bits}_s{seed}"
    run, agent = parse_run("d4pg", ["--actor_bits", str(bits), "--task", task, "--seed", str(seed),
                                    "--results_dir", str(root / "x")])
    (root / name).mkdir(parents=True)
    save_config(root / name / "config.json", dataclasses.replace(run, layout="pinned"), agent)
    write_json(root / name / "summary.json", {
        "env_steps": env_steps, "learner_steps": env_steps // 32, "wall_seconds": 300.0, "energy_kwh": 0.003,
        "final_eval_return": 990.0 if wall_to_900 == wall_to_900 else 850.0, "exit_code": 0,
        "cpu_clock": "process", "worker_cpu_s": {"replay": env_steps * 4e-4},
        "actor_time_s": {"env_step": 30.0, "inference": 60.0 if bits == 32 else 15.0, "adder": 70.0},
        "actor_cpu_time_s": {"env_step": 28.0, "inference": 17.0 if bits == 32 else 10.0, "adder": 18.0}})
    reached = wall_to_900 == wall_to_900
    _evals([(20.0, 0, 0, 0, [100.0]), (wall_to_900 if reached else 200.0, 1000, 500, 0, [950.0 if reached else 800.0]),
            (300.0, 2000, 900, 1, [990.0 if reached else 850.0])]).to_csv(root / name / "eval.csv", index=False)
    return name


def _render(tmp_path: Path, study: str) -> str:
    """RESULTS.md's block of `study` as report.py draws it from tmp_path/records (figures to tmp_path/figures)."""
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text(f"<!-- report:{study} -->\n<!-- /report:{study} -->\n")
    report = load_script("report")
    assert report.main(["--records", str(tmp_path / "records"), "--results_md", str(results_md),
                        "--figures", str(tmp_path / "figures")]) == 0
    return results_md.read_text()


def test_report_draws_the_end_to_end_table_from_a_recorded_grid(tmp_path):
    records = tmp_path / "records" / "rq3"
    runs = [_e2e_run(records, 32, 200.0, 300_000), _e2e_run(records, 8, 150.0, 360_000)]
    (records / "sweeps").mkdir()
    (records / "sweeps" / "grid.json").write_text('{"threshold": 900.0, "command": "python benchmarks/end_to_end.py"}')
    (records / "study.json").write_text('{"study": "rq3", "sources": {"grid": {"runs_collected": %s}}}'
                                        % str(runs).replace("'", '"'))
    text = _render(tmp_path, "rq3")
    assert _cell(text, ["8", "0"], "time to 900 (s)") == "150" and _cell(text, ["32", "0"], "time to 900 (s)") == "200"
    # 200 / 150 s to target; 1200 / 1000 env steps per second; the service's 0.40 ms of CPU per env step.
    assert "`time_to_target_speedup_q8` 1.33" in text and "`env_steps_per_s_ratio_q8` 1.2" in text
    assert "The replay service's CPU: 0.40-0.40 ms per env step." in text
    assert _cell(text, ["8", "0"], "actor ms per env step, wall / CPU: env step, inference, replay write") == \
        "0.08 / 0.08, 0.04 / 0.03, 0.19 / 0.05"
    assert (tmp_path / "figures" / "rq3_grid.png").read_bytes().startswith(b"\x89PNG")


def test_report_draws_the_multi_task_table_one_recorded_grid_per_task(tmp_path):
    records = tmp_path / "records" / "rq1"
    (records / "sweeps").mkdir(parents=True)
    sources = {}
    for grid, task, runs in (("cartpole", "cartpole_balance", [(32, 200.0, 300_000), (8, 150.0, 360_000)]),
                             ("walker", "walker_stand", [(32, 240.0, 150_000), (8, math.nan, 180_000)])):
        home = records / grid
        names = [_e2e_run(home, bits, wall, steps, task) for bits, wall, steps in runs]
        for name in names:  # as report.py --collect lays them out: runs beside sweeps/, one index per grid
            (home / name).rename(records / f"{grid}_{name}")
        home.rmdir()
        (records / "sweeps" / f"{grid}.json").write_text('{"threshold": 900.0}')
        sources[grid] = {"runs_collected": [f"{grid}_{name}" for name in names], "collected_on": {"cores": 2}}
    (records / "study.json").write_text(json.dumps({"study": "rq1", "sources": sources}))
    text = _render(tmp_path, "rq1")
    assert _cell(text, ["cartpole_balance", "900", "8"], "time to target (s)") == "150"
    assert _cell(text, ["cartpole_balance", "900", "8"], "time speedup q=8") == "1.33x"  # 200 / 150 s
    assert _cell(text, ["cartpole_balance", "900", "8"], "env steps/s") == "1200"  # 360,000 env steps in 300 s
    assert _cell(text, ["walker_stand", "900", "32"], "reached") == "1"
    assert _cell(text, ["walker_stand", "900", "8"], "reached") == "0"
    assert _cell(text, ["walker_stand", "900", "8"], "time to target (s)") == "-"  # a miss is not its budget
    assert _cell(text, ["walker_stand", "900", "8"], "time speedup q=8") == "-"
    assert _cell(text, ["walker_stand", "900", "8"], "final return") == "850"
    assert (tmp_path / "figures" / "rq1_multitask.png").read_bytes().startswith(b"\x89PNG")


def test_every_figure_the_readme_quotes_in_its_results_is_in_results_md():
    # The README repeats RESULTS.md's answers in short; a figure there that RESULTS.md does not hold was
    # retyped (or left behind when a table of record changed).
    import re

    section = (ROOT / "README.md").read_text().split("\n## Results", 1)[1].split("\n## ", 1)[0]
    results = (ROOT / "RESULTS.md").read_text()
    figures = set(re.findall(r"\d+(?:\.\d+)?(?:x\d+)?(?:-\d+(?:\.\d+)?)?x?", section))
    assert len(figures) > 10, section[:500]
    assert sorted(f for f in figures if f not in results) == []
