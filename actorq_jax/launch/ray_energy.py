"""Energy of a run under `--launcher ray`: one codecarbon tracker per node that hosts a worker.

`RayEnergyMeter` starts a `NodeEnergy` Ray actor on each node as workers land
there; each measures its node in machine mode. At the end emissions.csv gets a
row per node and the summary their sum (NaN for a node that left with its
measurement).
"""

import math
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from actorq_jax.run_dir import RunDir

CALL_TIMEOUT_S = 60.0


def scratch_dir(prefix: str) -> Path:
    """A new node-local directory, inside this Ray session's directory (Ray's place for a session's files)."""
    try:
        import ray._private.worker

        root = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "actorq"
        root.mkdir(exist_ok=True)
    except (AttributeError, OSError):  # a Ray without that (private) attribute: the system's temp dir
        root = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


class NodeEnergy:
    """Ray actor measuring its node's energy (codecarbon, machine mode) for the run."""

    def __init__(self, country: str, label: str):
        from actorq_jax.telemetry import EnergyTracker

        self.dir = scratch_dir("energy-")
        self.tracker = EnergyTracker(self.dir, country_iso_code=country, tracking_mode="machine", project_name=label)
        self.tracker.start()

    def stop(self) -> Tuple[Dict[str, float], str]:
        """Stops measuring: the node's figures and its emissions.csv text ('' when codecarbon wrote none)."""
        report = self.tracker.stop()
        path = self.dir / RunDir.EMISSIONS
        text = path.read_text() if path.exists() else ""
        shutil.rmtree(self.dir, ignore_errors=True)
        return report, text


class RayEnergyMeter:
    """Energy of every node that hosts a worker of the run: one codecarbon tracker per node, summed."""

    def __init__(self, results_dir: Path, country: str):
        self.results_dir = Path(results_dir)
        self.country = country
        self.agents: Dict[str, Any] = {}
        self.lock = threading.Lock()
        self.started: Optional[float] = None

    def start(self) -> None:
        """Starts the clock; nodes join as workers land on them."""
        self.started = time.monotonic()

    def node(self, node_id: str, ip: str) -> None:
        """Starts measuring `node_id` (once)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self.lock:
            if node_id in self.agents or self.started is None:
                return
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self.agents[node_id] = ray.remote(NodeEnergy).options(num_cpus=0, max_restarts=0,
                                                                   scheduling_strategy=strategy).remote(
                self.country, f"actorq node {ip} {node_id[:12]}")

    def stop(self) -> Dict[str, float]:
        """Stops every node's tracker; writes emissions.csv (a row per node) and returns the sums."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        duration = time.monotonic() - (self.started or time.monotonic())
        with self.lock:
            agents, self.started = dict(self.agents), None
        energy, emissions, header, rows = [], [], None, []
        for agent in agents.values():
            try:
                report, text = ray.get(agent.stop.remote(), timeout=CALL_TIMEOUT_S)
            # A node that left took its measurement with it: its tracker died with it (RayActorError) or,
            # bound to the node, could no longer be placed there (ActorUnschedulableError).
            except (RayError, GetTimeoutError):
                energy.append(math.nan)
                emissions.append(math.nan)
                continue
            energy.append(report.get("energy_kwh", math.nan))
            emissions.append(report.get("emissions_kg", math.nan))
            lines = text.splitlines()
            if lines:
                header = header or lines[0]
                rows.extend(lines[1:])
        if header is not None:
            RunDir(self.results_dir).emissions.write_text("\n".join([header, *rows]) + "\n")
        measured = [e for e in energy if not math.isnan(e)]
        measured_co2 = [e for e in emissions if not math.isnan(e)]
        return {"energy_kwh": sum(measured) if measured else math.nan,
                "emissions_kg": sum(measured_co2) if measured_co2 else math.nan,
                "duration_s": duration, "energy_nodes": len(agents), "energy_nodes_measured": len(measured)}

    def release(self) -> None:
        """Removes the node trackers."""
        import ray

        with self.lock:
            agents, self.agents = dict(self.agents), {}
        for agent in agents.values():
            ray.kill(agent, no_restart=True)
