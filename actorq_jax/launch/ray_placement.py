"""`--launcher ray`: the run's workers placed on a Ray cluster's nodes, sharing only the network.

Each worker (replay service, learner, actor, evaluator) is hosted by one Ray
actor, a `WorkerHost` (launch/ray_host.py), placed with its role's resources (`--replay_resources`,
`--learner_resources`, `--actor_resources`; the evaluator goes with the replay
service's node). The host runs the very command a local run starts, `python -m
actorq_jax.launch.worker ROLE ...`, in a node-local scratch directory holding
config.json. `WorkerHost.run` returns the worker's exit code: the driver (the
launcher's process) holds that call's result as the worker's process, and a
host whose node is lost fails the call with a RayActorError, which the
launcher reads as a worker that died and restarts through a new host, placed by
Ray on a node that remains (within --max_*_restarts; Ray's own max_restarts is
0 so that one budget counts every restart).

Nothing mirrors files. What the launcher's results directory gets comes by
explicit roads:
- status reports through the replay service's tables (launch/channel.py); the
  driver records the reports it reads into status/;
- rows through the replay service: the actors' (launch/actor_rows.py, each
  exactly once) and the learner's and evaluator's (launch/run_rows.py), drained
  by the driver about twice a second;
- checkpoints by export: when the learner reports a new finished checkpoint,
  the driver copies that step from the learner's host and its replay checkpoint
  from the service's host, in chunks, into a temporary directory renamed into
  place, and prunes the steps the learner pruned; a new learner or service host
  (a resumed run, a lost node) is seeded with them the same way;
- each worker's log, fetched in chunks when the worker exits.

Flags are checked in launch/ray_flags.py, energy measured per node by
launch/ray_energy.py.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from actorq_jax.launch.channel import ServiceChannel
from actorq_jax.launch.placement import Placement
from actorq_jax.launch.ray_energy import RayEnergyMeter
from actorq_jax.launch.ray_flags import actor_options, parse_resources
from actorq_jax.launch.ray_host import CHUNK_BYTES, HOST_CONCURRENCY, WorkerHost
from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
PLACE_TIMEOUT_S = 300.0
COLLECT_PERIOD_S = 0.5
# How long a host whose worker exited may take to show it is still there before it counts as lost.
HOST_CHECK_S = 10.0
# Checkpoint trees, and the file that marks a step in each finished.
FINISHED = {RunDir.CHECKPOINTS: "counters/metadata", RunDir.REPLAY_CHECKPOINTS: "DONE"}


class RayWorkerProcess:
    """A worker running under a WorkerHost, seen as a subprocess.Popen: its exit code is `run`'s result."""

    def __init__(self, placement: "RayPlacement", host: "_Host", run_ref: Any, pid_ref: Any):
        self._placement, self._host, self._run_ref, self._pid_ref = placement, host, run_ref, pid_ref
        self._pid: Optional[int] = None
        self.returncode: Optional[int] = None
        self.lost: Optional[str] = None  # why its host is gone, when it is (no exit code then)

    @property
    def pid(self) -> int:
        """The worker's pid on its node (0 until its host started it)."""
        if self._pid is None:
            import ray
            from ray.exceptions import RayError

            if ray.wait([self._pid_ref], timeout=0)[0]:
                try:
                    self._pid = int(ray.get(self._pid_ref)) or None
                except RayError:
                    self._pid = -1  # a host that died first: poll() says how
        return self._pid or 0

    def _over(self) -> bool:
        return self.returncode is not None or self.lost is not None

    def poll(self) -> Optional[int]:
        """The exit code once the worker exited (its log fetched first); None while it runs or when its host was
        lost (see `lost`)."""
        import ray
        from ray.exceptions import RayError

        if not self._over() and ray.wait([self._run_ref], timeout=0)[0]:
            try:
                code = int(ray.get(self._run_ref))
            # RayActorError (its node or Ray worker died), RayTaskError, and ActorUnschedulableError (a host
            # bound to a node that left before it was placed): each leaves the worker without a host.
            except RayError as error:
                self.lost = f"its host is gone ({type(error).__name__}): its node or Ray worker died"
                self._placement.lost(self._host, self.lost)
                return None
            self._placement.fetch_log(self._host)
            self.returncode = code
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits for the end; the exit code (None for a lost host); subprocess.TimeoutExpired past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and self.lost is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self._host.name, timeout)
            time.sleep(0.1)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the worker through its host."""
        if not self._over():
            self._host.actor.signal.remote(int(sig))

    def kill(self) -> None:
        """Kills the worker (its host stays, so its files can still be read)."""
        self.send_signal(signal.SIGKILL)


class _Host:
    """The driver's record of one WorkerHost: its actor, node, and how much of its log came over."""

    def __init__(self, name: str, role: str, actor: Any, incarnation: int):
        self.name, self.role, self.actor, self.incarnation = name, role, actor, incarnation
        self.where_ref = actor.where.remote()
        self.where: Optional[Dict[str, str]] = None
        self.attempts = 0
        self.log_offset = 0
        self.dead = False


class RayPlacement(Placement):
    """Places workers on a Ray cluster (joined with --ray_address, or a local instance started for the run)."""

    name = "ray"

    def __init__(self, run: Any, results_dir: Path):
        super().__init__(run, results_dir)
        self.resources = {role: parse_resources(getattr(run, f"{role}_resources"))
                          for role in ("learner", "replay", "actor")}
        self.hosts: Dict[str, _Host] = {}
        self.incarnations: Dict[str, int] = {}
        self.lock = threading.RLock()
        self.initialized_here = False
        self.energy: Optional[RayEnergyMeter] = None
        self.channel: Optional[ServiceChannel] = None
        self.address: Optional[str] = None
        self._collect_lock = threading.Lock()
        self._drains: Any = None  # (client, actor rows, learner and evaluator rows) while the service answers
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def open(self) -> None:
        """Joins --ray_address, or starts a Ray instance on this machine (loopback only) for the run."""
        address = self.run.ray_address
        if not address:
            # Read when Ray is imported: its processes then take loopback for this machine's address.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        self.initialized_here = not ray.is_initialized()
        if not self.initialized_here:
            pass  # a caller's Ray session (a notebook, a test): use it, leave it up
        elif address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:
            # A private single-machine instance: nothing else joins it, so it listens on loopback only.
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False)

    def close(self) -> None:
        """Removes every host (once their last files came over) and, for a local instance, shuts Ray down."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(CALL_TIMEOUT_S)
        with self._collect_lock:
            if self._drains is not None:
                self._close_drains()
        with self.lock:
            hosts = list(self.hosts.values())
        closing = [h.actor.close.remote() for h in hosts if not h.dead]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CALL_TIMEOUT_S)
        for host in hosts:
            ray.kill(host.actor, no_restart=True)
        for tree in FINISHED:  # an export cut short leaves its temporary directory
            for stale in (self.results_dir / tree).glob(".*.export"):
                shutil.rmtree(stale, ignore_errors=True)
        if self.energy is not None:
            self.energy.release()
        if self.initialized_here:
            ray.shutdown()  # disconnects from a joined cluster; stops the instance this run started

    # -- workers ----------------------------------------------------------------------------

    def start(self, name: str, role: str, args: List[str]) -> RayWorkerProcess:
        """Starts worker `name` on its host (a new host, placed by Ray, when it has none or lost its node)."""
        with self.lock:
            host = self.hosts.get(name)
            if host is None or host.dead or not self._answers(host):
                host = self._new_host(name, role)
            host.attempts += 1
            run_ref = host.actor.run.remote(host.attempts, role, args)
            return RayWorkerProcess(self, host, run_ref, host.actor.pid.remote(host.attempts, PLACE_TIMEOUT_S))

    def _answers(self, host: _Host) -> bool:
        """Whether a host whose worker exited is still there to start it again (its node may have gone with it)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            ray.get(host.actor.where.remote(), timeout=HOST_CHECK_S)
            return True
        except (RayError, GetTimeoutError) as error:
            self.lost(host, f"{type(error).__name__}: its node or Ray worker died")
            return False

    def _new_host(self, name: str, role: str) -> _Host:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if role == "evaluator":
            # Beside the replay service: it fetches every published policy from its server. Hard: Ray's soft
            # affinity placed it elsewhere with the service's node alive. Should that node be gone by the
            # time the evaluator starts, its host is unschedulable, which poll() reports as a lost host.
            service = self.hosts.get("replay")
            node = service.where["node_id"] if service and service.where else None
            options: Dict[str, Any] = {"num_cpus": 0}
            if node:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        else:
            resources = self.resources["actor" if role == "actor" else role]
            options = actor_options(resources)
            if role == "actor" and not resources:
                # Nothing reserved (as local processes, they may oversubscribe): spread them over the nodes.
                options["scheduling_strategy"] = "SPREAD"
            elif role == "replay" and not resources:
                # Nothing asked for: beside the launcher's process, where a node that leaves does not take it.
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=True)
        incarnation = self.incarnations.get(name, -1) + 1
        self.incarnations[name] = incarnation
        actor = ray.remote(WorkerHost).options(max_restarts=0, max_task_retries=0, max_concurrency=HOST_CONCURRENCY,
                                               **options).remote(name, RunDir(self.results_dir).config.read_text())
        host = _Host(name, role, actor, incarnation)
        if role in ("learner", "replay"):
            # A resumed run, or a learner or service whose node was lost, restores from the exported checkpoints.
            self._seed(host)
        self.hosts[name] = host
        return host

    def _seed(self, host: _Host) -> None:
        """Copies the results directory's checkpoints to a new host, chunk by chunk (before its worker starts)."""
        import ray

        for tree in FINISHED:
            for path in sorted((self.results_dir / tree).rglob("*")):
                rel = path.relative_to(self.results_dir).as_posix()
                if not path.is_file() or any(part.startswith(".") for part in rel.split("/")):
                    continue
                with open(path, "rb") as f:
                    offset, data = 0, f.read(CHUNK_BYTES)
                    while True:  # an empty file (Reverb's DONE) is one empty chunk
                        ray.get(host.actor.put.remote(rel, offset, data), timeout=PLACE_TIMEOUT_S)
                        offset += len(data)
                        data = f.read(CHUNK_BYTES)
                        if not data:
                            break

    def _learn_where(self, host: _Host, timeout_s: float) -> Optional[Dict[str, str]]:
        """The host's node (None while Ray has not placed it within `timeout_s`); notes where it landed."""
        import ray
        from ray.exceptions import RayError

        if host.where is None and ray.wait([host.where_ref], timeout=timeout_s)[0]:
            try:
                where = ray.get(host.where_ref)
            except RayError:
                return None  # its worker's call says how it was lost
            with self.lock:
                if host.where is not None:  # the other thread noted it first
                    return host.where
                host.where = where
                if self.energy is not None:
                    self.energy.node(where["node_id"], where["ip"])
                self.events.append(f"{host.name} (incarnation {host.incarnation}) on node {where['ip']} "
                                   f"{where['node_id'][:12]}")
        return host.where

    def lost(self, host: _Host, why: str) -> None:
        """Notes that `host` is gone with its node (its log ends with the driver's note)."""
        with self.lock:
            host.dead = True
            self.events.append(f"{host.name} lost its host ({why})")
        with open(RunDir(self.results_dir).log(host.name), "a") as f:
            f.write(f"\n[actorq driver] the host of {host.name} is gone: {why}\n")

    def fetch_log(self, host: _Host) -> None:
        """Appends what is new in the worker's log on its host to logs/<name>.log, chunk by chunk."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        rel = f"{RunDir.LOGS}/{host.name}.log"
        try:
            with open(self.results_dir / rel, "ab") as out:
                while True:
                    data = ray.get(host.actor.read.remote(rel, host.log_offset), timeout=CALL_TIMEOUT_S)
                    if not data:
                        return
                    out.write(data)
                    host.log_offset += len(data)
        except (RayError, GetTimeoutError) as error:
            log.warning("the log of %s did not come over: %s", host.name, error)
            if isinstance(error, RayActorError):  # the worker exited as its node went: the host is gone too
                self.lost(host, f"{type(error).__name__}: its node or Ray worker died")

    def service_address(self, port: int) -> str:
        """HOST:PORT of the replay service as every node reaches it: --advertise_host, else its node's IP (waits
        for Ray to place it); the driver's collecting starts there."""
        where = self._learn_where(self.hosts["replay"], PLACE_TIMEOUT_S)
        if where is None:
            raise RuntimeError(f"Ray placed no host for it within {PLACE_TIMEOUT_S:.0f} s "
                               f"(--replay_resources {self.run.replay_resources!r})")
        address = f"{self.run.advertise_host or where['ip']}:{port}"
        if address != self.address:  # a first start, or a restart on another node: the drains follow it
            with self._collect_lock:
                if self._drains is not None:
                    self._close_drains()
                self.address = address
                self.channel = ServiceChannel(address)
        if self._thread is None:
            self._thread = threading.Thread(target=self._collect_loop, name="ray-collect", daemon=True)
            self._thread.start()
        return self.address

    def energy_meter(self, country: str) -> RayEnergyMeter:
        """Measures each node that hosts a worker (codecarbon there); the summary gets their sum."""
        self.energy = RayEnergyMeter(self.results_dir, country)
        return self.energy

    # -- what comes back through the service --------------------------------------------------

    def _collect_loop(self) -> None:
        while not self._stop.wait(COLLECT_PERIOD_S):
            self.collect()

    def collect(self) -> None:
        """Notes where new hosts landed, writes the rows waiting on the service, exports new checkpoints (a pass
        that fails is logged; the next one retries)."""
        try:
            self._collect()
        except Exception as error:  # noqa: BLE001 (a host or the service lost mid-pass: the run goes on)
            log.warning("collecting from the workers failed: %s: %s", type(error).__name__, error)

    def _collect(self) -> None:
        with self.lock:
            hosts = [h for h in self.hosts.values() if not h.dead]
        for host in hosts:
            self._learn_where(host, 0)
        if self.address is None:
            return
        with self._collect_lock:
            self._drain_rows()
            self._export_checkpoints()

    def _drain_rows(self) -> None:
        import reverb

        from actorq_jax.launch.actor_rows import RowDrain
        from actorq_jax.launch.run_rows import RunRowDrain

        try:
            if self._drains is None:
                client = reverb.Client(self.address)
                client.server_info(timeout=2)  # up (and not restarting) before anything is written to it
                # Every actor sends its rows under Ray: ids of the launcher's actors included.
                self._drains = (client, RowDrain(client, RunDir(self.results_dir).actors, 0),
                                RunRowDrain(client, self.results_dir))
            self._drains[1].drain(timeout_s=2)
            self._drains[2].drain(timeout_s=2)
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            log.debug("the replay service did not answer the rows drain: %s", error)
            if self._drains is not None:
                self._close_drains()  # rebuilt when it answers again (acknowledgements read back from actors/)

    def _close_drains(self) -> None:
        _, actor_rows, run_rows = self._drains
        self._drains = None
        actor_rows.close()
        run_rows.close()

    def _export_checkpoints(self) -> None:
        """Copies each finished learner checkpoint the learner reports, and its replay checkpoint, then prunes."""
        steps = [int(s) for s in self.channel.read("learner").get("checkpoints") or []]
        learner, service = self.hosts.get("learner"), self.hosts.get("replay")
        if not steps or learner is None or service is None or learner.dead:
            return
        import ray

        for step in steps:
            if (RunDir(self.results_dir).checkpoints / str(step) / FINISHED[RunDir.CHECKPOINTS]).exists():
                continue
            meta = ray.get(learner.actor.read.remote(f"{RunDir.CHECKPOINTS}/{step}/{FINISHED[RunDir.CHECKPOINTS]}", 0),
                           timeout=CALL_TIMEOUT_S)
            if not meta:
                return  # pruned meanwhile: the next report says so
            name = json.loads(meta).get("replay_checkpoint")
            # The replay checkpoint first: a learner checkpoint in results_dir always has its replay.
            if name and not (RunDir(self.results_dir).replay_checkpoints / name / FINISHED[RunDir.REPLAY_CHECKPOINTS]).exists():
                if service.dead or not self._export(service, f"{RunDir.REPLAY_CHECKPOINTS}/{name}"):
                    return
            self._export(learner, f"{RunDir.CHECKPOINTS}/{step}")
        self._prune(steps)

    def _export(self, host: _Host, rel_dir: str) -> bool:
        """Copies `rel_dir` from the host into a temporary directory renamed into place; whether it was finished."""
        import ray

        tree = rel_dir.split("/")[0]
        files = ray.get(host.actor.files.remote(rel_dir), timeout=CALL_TIMEOUT_S)
        if f"{rel_dir}/{FINISHED[tree]}" not in files:
            return False
        dest = self.results_dir / rel_dir
        tmp = dest.with_name(f".{dest.name}.export")
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in sorted(files):
            path = tmp / Path(rel).relative_to(rel_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as out:
                while True:
                    data = ray.get(host.actor.read.remote(rel, out.tell()), timeout=CALL_TIMEOUT_S)
                    out.write(data)
                    if len(data) < CHUNK_BYTES:
                        break
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
        return True

    def _prune(self, steps: List[int]) -> None:
        """Removes the checkpoints the learner no longer keeps, and the replay checkpoints none of those names."""
        from actorq_jax.launch.checkpoint import read_counters

        root = RunDir(self.results_dir).checkpoints
        for path in root.iterdir() if root.is_dir() else []:
            if path.name.isdigit() and int(path.name) not in steps:
                shutil.rmtree(path, ignore_errors=True)
        named = {(read_counters(root, s) or {}).get("replay_checkpoint") for s in steps}
        replay_root = RunDir(self.results_dir).replay_checkpoints
        for path in replay_root.iterdir() if replay_root.is_dir() else []:
            if not path.name.startswith(".") and path.name not in named:
                shutil.rmtree(path, ignore_errors=True)
