"""The run's control plane: status reports through files (local runs) and through the run's Reverb server (Ray)."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from actorq_jax.launch.channel import (
    ROLES,
    SEQ_KEY,
    WRITER_KEY,
    FileChannel,
    RecordedChannel,
    ServiceChannel,
    make_channel,
    make_status_tables,
    status_table,
)
from actorq_jax.launch.runtime import free_port
from actorq_jax.replay.messages import send_message


def test_file_channel_reads_what_was_reported(tmp_path):
    channel = FileChannel(tmp_path)
    assert channel.read("learner") == {}
    channel.report("learner", {"phase": "running", "learner_steps": np.int64(3)})
    assert channel.read("learner") == {"phase": "running", "learner_steps": 3}
    # The very files a local run always wrote.
    assert json.loads((tmp_path / "status" / "learner.json").read_text())["phase"] == "running"
    channel.report("learner", {"phase": "done"})
    assert channel.read("learner") == {"phase": "done"}
    assert not [p for p in (tmp_path / "status").iterdir() if p.name != "learner.json"]  # no temporary left


def test_a_torn_or_missing_report_reads_as_none_yet(tmp_path):
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "replay.json").write_text('{"phase": ')
    assert FileChannel(tmp_path).read("replay") == {}


def test_make_channel_picks_files_locally_and_the_service_under_ray(tmp_path):
    assert isinstance(make_channel(SimpleNamespace(launcher="local"), tmp_path), FileChannel)
    assert isinstance(make_channel(SimpleNamespace(launcher="ray"), tmp_path, "127.0.0.1:1"), ServiceChannel)
    recorded = make_channel(SimpleNamespace(launcher="ray"), tmp_path, "127.0.0.1:1", record=True)
    assert isinstance(recorded, RecordedChannel)
    with pytest.raises(ValueError, match="address"):
        make_channel(SimpleNamespace(launcher="ray"), tmp_path)


def test_status_tables_are_named_per_role():
    assert [status_table(r) for r in ROLES] == ["status_launcher", "status_replay", "status_learner",
                                                     "status_evaluator"]
    with pytest.raises(ValueError, match="actor"):
        status_table("actor")


@pytest.mark.process
@pytest.mark.timeout(60)
def test_service_channel_on_a_real_server(tmp_path):
    from actorq_jax.replay import ReplayServer

    port = free_port()
    server = ReplayServer(make_status_tables(), port=port)
    try:
        writer, reader = ServiceChannel(f"127.0.0.1:{port}"), ServiceChannel(f"127.0.0.1:{port}")
        assert reader.read("replay") == {}
        writer.report("replay", {"phase": "running", "env_steps": np.int64(10), "loss": float("nan")})
        assert reader.read("replay") == {"phase": "running", "env_steps": 10, "loss": None}
        writer.report("replay", {"phase": "done", "env_steps": 12})
        assert reader.read("replay") == {"phase": "done", "env_steps": 12}  # replaced, never queued
        assert reader.read("learner") == {}
        # The driver's channel also leaves the reports it saw as files.
        recorded = RecordedChannel(reader, FileChannel(tmp_path))
        assert recorded.read("replay")["env_steps"] == 12
        assert json.loads((tmp_path / "status" / "replay.json").read_text())["phase"] == "done"
        recorded.report("launcher", {"start_time": 1.5})
        assert writer.read("launcher") == {"start_time": 1.5}
        assert FileChannel(tmp_path).read("launcher") == {"start_time": 1.5}
        # A report that timed out can land after a newer one: readers keep the newer one.
        import reverb

        client = reverb.Client(f"127.0.0.1:{port}")
        learner = ServiceChannel(f"127.0.0.1:{port}")
        learner.report("learner", {"env_steps": 2000})
        assert reader.read("learner") == {"env_steps": 2000}
        send_message(client, status_table("learner"), {"env_steps": 1694, WRITER_KEY: learner._writer, SEQ_KEY: 0}, 5)
        assert reader.read("learner") == {"env_steps": 2000}
        # A restarted learner's channel is a new writer: its reports count, and the old one's are stale from then on.
        restarted = ServiceChannel(f"127.0.0.1:{port}")
        restarted.report("learner", {"env_steps": 1500})
        assert reader.read("learner") == {"env_steps": 1500}
        send_message(client, status_table("learner"), {"env_steps": 2100, WRITER_KEY: learner._writer, SEQ_KEY: 9}, 5)
        assert reader.read("learner") == {"env_steps": 1500}
        restarted.report("learner", {"env_steps": 1600})
        assert reader.read("learner") == {"env_steps": 1600}
    finally:
        server.stop()
    # No call goes to this address after the stop: a Reverb client that writes to a server stopped in its own
    # process has corrupted the heap under CPU contention (a native abort); the next test kills a server in
    # another process, as a run's replay service dies.


# A status server in a process of its own: it says "ready" once it serves, then runs until it is killed. Its
# checkpoint directory is the test's: a server without one makes its own in the temp folder, which a kill leaves.
_STATUS_SERVER = """
import sys
from actorq_jax.launch.channel import make_status_tables
from actorq_jax.replay import ReplayServer
server = ReplayServer(make_status_tables(), port=int(sys.argv[1]), checkpoint_dir=sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.process
@pytest.mark.timeout(90)
def test_a_killed_server_reads_as_no_report_and_a_report_to_it_is_dropped(tmp_path):
    import subprocess
    import sys

    from launch_support import ENV, ROOT, stop_all

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _STATUS_SERVER, str(port), str(tmp_path / "checkpoints")],
                              cwd=ROOT, env=ENV, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        assert server.stdout.readline().strip() == "ready"
        channel = ServiceChannel(f"127.0.0.1:{port}")
        channel.report("replay", {"phase": "running", "env_steps": 5})
        assert channel.read("replay") == {"phase": "running", "env_steps": 5}  # it served
        server.kill()
        server.wait(timeout=30)
        # The channel that wrote before the kill: its report is dropped (its own timeout ends it, not the test's).
        began = time.monotonic()
        channel.report("replay", {"phase": "done"})
        assert time.monotonic() - began < 30
        # It and one made after the kill read no report.
        assert channel.read("replay") == {}
        assert ServiceChannel(f"127.0.0.1:{port}").read("replay") == {}
    finally:
        stop_all(server)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reports", [
    {"learner": {"phase": "final"}},
    {"learner": {"phase": "done"}},
    {"learner": {"phase": "diverged", "message": "critic_loss is nan"}},
    # A learner that ended without a last publication (gave up, failed): the launcher says so.
    {"learner": {"phase": "running"}, "launcher": {"start_time": 0.0, "learner_ended": True}},
])
def test_the_evaluators_final_wait_ends_once_no_publication_can_come(tmp_path, reports):
    from actorq_jax.launch.evaluator import wait_for_final_publication

    channel = FileChannel(tmp_path)
    for role, status in reports.items():
        channel.report(role, status)
    # A timeout longer than the test's own: only the reports can end the wait.
    wait_for_final_publication(channel, launcher_alive=lambda: True, timeout_s=3600)


@pytest.mark.timeout(60)
def test_the_evaluators_final_wait_goes_on_while_the_learner_runs(tmp_path):
    from actorq_jax.launch.evaluator import wait_for_final_publication

    channel = FileChannel(tmp_path)
    channel.report("learner", {"phase": "running"})
    channel.report("launcher", {"start_time": 0.0})
    began = time.monotonic()
    wait_for_final_publication(channel, launcher_alive=lambda: True, timeout_s=1.0)
    assert time.monotonic() - began >= 1.0
    calls = iter([True, False])  # the launcher is gone after one look
    wait_for_final_publication(channel, launcher_alive=lambda: next(calls), timeout_s=3600)
