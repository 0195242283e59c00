"""The fault-injection soak's --quick form: every kind of fault once, and every check passes."""

import subprocess
import sys

import pytest
from launch_support import ENV, ROOT

pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_quick_chaos_soak_loses_nothing(tmp_path):
    # Two actors: one can be killed while the other goes on, and the soak starts two processes fewer than its default.
    proc = subprocess.run([sys.executable, "experiments/chaos.py", "--quick", "--num_actors", "2",
                           "--results_dir", str(tmp_path / "soak")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=840)
    out = proc.stdout
    for event in ("SIGKILL actor", "SIGKILL learner", "SIGKILL replay service", "stopped the run", "resuming",
                  "malformed payload", "SIGSTOP replay service", "two remote actors with --actor_id"):
        assert event in out, out[-3000:] + proc.stderr[-3000:]
    for check in ("actor CSV rows well-formed", "learner and env steps monotonic", "no process left",
                  "final return within the undisturbed run's range", "paused replay service held everyone",
                  "duplicate actor id refused", "no non-finite parameter published", "no live process killed as hung",
                  "malformed payload rejected"):
        assert f"PASS  {check}" in out, out[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0
