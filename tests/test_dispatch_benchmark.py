"""The dispatch benchmark's smoke run: every setting measured, every headline key present and finite."""

import json
import math
import subprocess
import sys

import pytest
from launch_support import BENCHMARKS, ENV, ROOT

sys.path.insert(0, str(BENCHMARKS))

import dispatch  # noqa: E402  (a script, not a package)


@pytest.mark.process
@pytest.mark.timeout(240)
def test_quick_dispatch_benchmark_reports_both_settings(tmp_path):
    out = tmp_path / "dispatch.json"
    proc = subprocess.run([sys.executable, "benchmarks/dispatch.py", "--quick", "--contend", "yes", "--json", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {(r["case"], r["setting"]) for r in report["rows"]} == {("256x3_q8_contended", setting)
                                                                    for setting in ("default", "sync", "nothunk")}
    for row in report["rows"]:
        assert all(row[k] > 0 for k in ("inference_wall_us", "inference_cpu_us", "env_wall_us", "env_cpu_us")), row
    assert set(report["headline"]) == {f"{what}_default_over_{setting}_256x3_q8_contended"
                                       for what in ("inference", "step") for setting in ("sync", "nothunk")}
    assert all(math.isfinite(v) and v > 0 for v in report["headline"].values()), report["headline"]


def test_bad_counts_exit_2_naming_the_flag():
    with pytest.raises(SystemExit) as info:
        dispatch.main(["--trials", "0"])
    assert info.value.code == 2
