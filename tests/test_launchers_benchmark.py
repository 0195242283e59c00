"""benchmarks/launchers.py: the steady env-step rate from learner.csv, the headline, and a --quick run of real runs."""

import json
import math
import subprocess
import sys

import pytest
from launch_support import BENCHMARKS, ROOT

from actorq_jax.telemetry import CsvLogger

sys.path.insert(0, str(BENCHMARKS))

import launchers  # noqa: E402  (benchmarks/ is not a package)


def _learner_csv(run_dir, points):
    run_dir.mkdir()
    with CsvLogger(run_dir / "learner.csv", ["learner_steps", "wall_seconds", "env_steps"]) as log:
        for i, (wall, env_steps) in enumerate(points):
            log.write({"learner_steps": 100 * (i + 1), "wall_seconds": wall, "env_steps": env_steps})


def test_steady_rate_excludes_start_up(tmp_path):
    _learner_csv(tmp_path / "a", [(10.0, 1000), (12.0, 1400), (20.0, 3000)])
    assert launchers.steady_rate(tmp_path / "a") == pytest.approx(2000 / 10.0)
    _learner_csv(tmp_path / "b", [(10.0, 1000)])
    assert math.isnan(launchers.steady_rate(tmp_path / "b"))


def test_headline_is_ray_median_over_local_median():
    rows = [{"launcher": launcher, "steady_env_steps_per_s": rate, "whole_run_env_steps_per_s": rate / 2}
            for launcher, rate in [("local", 100.0), ("ray", 90.0), ("local", 120.0), ("ray", 60.0), ("local", 110.0),
                                   ("ray", float("nan"))]]
    head = launchers.headline(rows)
    assert head["ray_over_local_env_steps_ratio"] == pytest.approx(75.0 / 110.0)
    assert head["ray_over_local_whole_run_ratio"] == pytest.approx(75.0 / 110.0)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_quick_run_writes_the_headline(tmp_path):
    out = tmp_path / "launchers.json"
    # A plumbing check: 1,200 env steps a run (the --quick benchmark makes 2,500).
    proc = subprocess.run([sys.executable, "benchmarks/launchers.py", "--quick", "--env_steps", "1200", "--json", str(out),
                           "--results_dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "launchers" and payload["machine"]["cpu"]
    assert [r["launcher"] for r in payload["rows"]] == ["local", "ray"]
    assert all(r["env_steps"] > 0 for r in payload["rows"])
    assert "ray_over_local_env_steps_ratio" in payload["headline"]
