"""Under --launcher ray checkpoints travel by explicit, chunked calls: a new host is seeded with the results
directory's checkpoints, and the driver exports a host's finished step back atomically.

A private Ray instance on 127.0.0.1; WorkerHost's file calls are also checked without Ray.
"""

import json
import os
from types import SimpleNamespace

import pytest
from launch_support import RAY_SETTINGS

from actorq_jax.launch.ray_host import CHUNK_BYTES, WorkerHost

# One Ray instance at a time on this machine: under pytest-xdist these tests share one worker.
pytestmark = pytest.mark.xdist_group("ray")

RUN = {"results_dir": "", "advertise_host": "127.0.0.1"}


def _checkpoints(results):
    """A learner checkpoint larger than one chunk, and its finished replay checkpoint (an empty DONE)."""
    step = results / "checkpoints" / "100"
    (step / "counters").mkdir(parents=True)
    (step / "counters" / "metadata").write_text(json.dumps({"replay_checkpoint": "step_100"}))
    (step / "state.bin").write_bytes(os.urandom(2 * CHUNK_BYTES + 123))
    replay = results / "replay_checkpoints" / "step_100"
    replay.mkdir(parents=True)
    (replay / "DONE").write_bytes(b"")
    (replay / "tables.tfrecord").write_bytes(os.urandom(1000))
    return {p.relative_to(results).as_posix(): p.read_bytes()
            for tree in ("checkpoints", "replay_checkpoints") for p in (results / tree).rglob("*") if p.is_file()}


def _results(tmp_path):
    """A results directory holding only the run's config."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "config.json").write_text(json.dumps({"run": RUN, "agent": {}}))
    return results


def _open_placement(results, monkeypatch):
    """A RayPlacement for `results` on a private Ray instance (on 127.0.0.1); the caller closes it."""
    from actorq_jax.launch.ray_placement import RayPlacement

    for name, value in RAY_SETTINGS.items():
        monkeypatch.setenv(name, value)
    run = SimpleNamespace(ray_address="", advertise_host="", learner_resources="", replay_resources="",
                          actor_resources="")
    placement = RayPlacement(run, results)
    placement.open()
    return placement


def test_a_host_takes_chunks_in_any_order_and_serves_them_back(tmp_path):
    host = WorkerHost("learner", json.dumps({"run": RUN, "agent": {}}))
    try:
        assert json.loads((host.dir / "config.json").read_text())["run"]["results_dir"] == str(host.dir)
        host.put("checkpoints/7/state.bin", 4, b"5678")
        host.put("checkpoints/7/state.bin", 0, b"1234")
        host.put("checkpoints/7/DONE", 0, b"")
        assert host.files("checkpoints") == {"checkpoints/7/state.bin": 8, "checkpoints/7/DONE": 0}
        assert host.read("checkpoints/7/state.bin", 2) == b"345678"
        assert host.read("checkpoints/7/missing", 0) == b""
        with pytest.raises(ValueError, match="not inside"):
            host.read("../../etc/passwd", 0)
    finally:
        host.close()
    assert not host.dir.exists()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_checkpoints_seed_a_new_host_and_come_back_whole(tmp_path, monkeypatch):
    import ray

    results = _results(tmp_path)
    files = _checkpoints(results)
    placement = _open_placement(results, monkeypatch)
    try:
        host = placement._new_host("learner", "learner")  # seeded before its worker could start
        service = placement._new_host("replay", "replay")
        assert ray.get(host.actor.files.remote("checkpoints")) == {
            rel: len(data) for rel, data in files.items() if rel.startswith("checkpoints/")}
        # Exported back into a results directory that lost them: the same bytes, no temporary left.
        for tree in ("checkpoints", "replay_checkpoints"):
            for path in sorted((results / tree).rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
        ray.get(service.actor.put.remote("replay_checkpoints/step_200/tables.tfrecord", 0, b"unfinished"))
        assert placement._export(service, "replay_checkpoints/step_100")
        assert not placement._export(service, "replay_checkpoints/step_200")  # no DONE: not finished, not copied
        assert placement._export(host, "checkpoints/100")
        assert {p.relative_to(results).as_posix(): p.read_bytes() for tree in ("checkpoints", "replay_checkpoints")
                for p in (results / tree).rglob("*") if p.is_file()} == files
    finally:
        placement.close()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_node_gone_before_its_energy_tracker_was_placed_reads_as_unmeasured(tmp_path, monkeypatch):
    # A node that leaves right after a worker landed on it: its tracker, bound to that node, can never be
    # placed (ActorUnschedulableError). The run's energy total says the node went unmeasured; it must not
    # take the launcher's closing summary with it.
    import math

    import ray

    from actorq_jax.launch.ray_energy import RayEnergyMeter

    results = _results(tmp_path)
    placement = _open_placement(results, monkeypatch)
    try:
        live = ray.get_runtime_context().get_node_id()
        gone = ("0" if live[0] != "0" else "1") + live[1:]  # a well-formed id of no node in this cluster
        meter = RayEnergyMeter(results, "USA")
        meter.start()
        meter.node(gone, "127.0.0.1")
        totals = meter.stop()
        meter.release()
    finally:
        placement.close()
    assert totals["energy_nodes"] == 1 and totals["energy_nodes_measured"] == 0
    assert math.isnan(totals["energy_kwh"]) and math.isnan(totals["emissions_kg"])
