"""`--launcher ray`: the run's workers placed on a Ray cluster's nodes, sharing only the network.

Each worker (replay service, learner, actor, evaluator) is hosted by one Ray
actor, a `WorkerHost`, placed with its role's resources (`--replay_resources`,
`--learner_resources`, `--actor_resources`; the evaluator goes with the replay
service's node). The host
runs the very command a local run starts, `python -m actorq_jax.launch.worker
ROLE ...`, as its child, in a node-local scratch directory seeded with
config.json. The driver (the launcher's process) mirrors the scratch files
(status reports, actors/*.csv, eval.csv, learner.csv, logs/, finished learner
and replay checkpoints) into the real results directory through Ray calls,
reading each file from the offset it already has, and pushes the reports the
workers read (the launcher's start time, the learner's status) the other way;
a new learner or replay host (a resumed run, a lost node) is seeded with the
mirrored checkpoints. A hand-started remote actor's rows reach the replay
service over its Reverb server and are written by it (launch/actor_rows.py), so
they come with the service's files.
So the launcher's watch, restart and shutdown logic, and the role
functions, work on the results directory exactly as under `--launcher local`.

Restarts are the launcher's, as locally: a host whose node disappears reads
as a worker that died, and the launcher starts it again (within
--max_actor_restarts / --max_learner_restarts / --max_replay_restarts) through a new host, which Ray
places on a node that remains. Ray's own max_restarts is left at 0 so that
one budget counts every restart.

Energy: one `NodeEnergy` Ray actor per node that hosts a worker runs
codecarbon in machine mode there; emissions.csv gets a row per node and the
summary their sum.

Bad flags (`ray_flag_problems`) are found before anything starts: a
--ray_address that does not answer, a resource list that does not parse,
resources that no node (or not enough nodes for --num_actors) has.
"""

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from actorq_jax.launch.placement import LAUNCHERS, Placement, worker_command, worker_env

log = logging.getLogger(__name__)

SYNC_PERIOD_S = 0.25
# Bytes one host sends per sync call; a larger backlog (a checkpoint) comes over several calls.
SYNC_CHUNK_BYTES = 8 << 20
CALL_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 3.0
# Scratch entries never mirrored: the driver's own input.
NOT_MIRRORED = ("config.json",)
# Checkpoint trees, mirrored one finished step at a time, and the file that marks a step finished.
CHECKPOINT_TREES = {"checkpoints": "counters/metadata", "replay_checkpoints": "DONE"}
RESOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")
LOST_NODE_EXIT = -int(signal.SIGKILL)

DEFAULTS = {"launcher": "local", "ray_address": "", "learner_resources": "", "replay_resources": "", "actor_resources": "",
            "advertise_host": ""}


def setting(run: Any, name: str) -> Any:
    """A Ray-related RunConfig field, with its default while config.py does not declare it yet."""
    return getattr(run, name, DEFAULTS[name])


# -- flags ---------------------------------------------------------------------------------


def parse_resources(text: str) -> Dict[str, float]:
    """Parses 'GPU=1,CPU=2,actor_node=1' into {name: amount}; ValueError naming the bad part."""
    resources: Dict[str, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, amount = part.partition("=")
        name = name.strip()
        if not sep or not RESOURCE_NAME.match(name):
            raise ValueError(f"malformed resource {part!r}: expected NAME=AMOUNT, e.g. CPU=1,GPU=1,actor_node=1")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"malformed amount in {part!r}: expected a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"amount in {part!r} must be a positive number")
        if name in resources:
            raise ValueError(f"resource {name!r} given twice in {text!r}")
        resources[name] = value
    return resources


def actor_options(resources: Dict[str, float]) -> Dict[str, Any]:
    """Ray actor options that reserve `resources` (CPU and GPU by their own keywords)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options: Dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    if custom:
        options["resources"] = custom
    return options


def address_problem(address: str) -> Optional[str]:
    """Why --ray_address cannot be joined (None when a cluster answers there)."""
    if address == "auto":
        from ray._private import services

        try:
            found = services.canonicalize_bootstrap_address(address)
        except (ConnectionError, ValueError) as error:
            return f"no running Ray cluster found on this machine ({error}); start one with `ray start --head`"
        if not found:
            return "no running Ray cluster found on this machine; start one with `ray start --head`"
        address = found
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"{address!r} is neither 'auto' nor HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        return f"nothing answers at {address} ({error.strerror or error}); is the Ray head running there?"
    return None


def local_node_resources() -> List[Dict[str, float]]:
    """The resources a Ray instance started here would have (CPUs, GPUs; no custom ones)."""
    gpus = len(list(Path("/proc/driver/nvidia/gpus").glob("*"))) if Path("/proc/driver/nvidia/gpus").exists() else 0
    return [{"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}]


def cluster_node_resources(address: str) -> List[Dict[str, float]]:
    """Total resources of each live node of the cluster at `address` (connects, reads, disconnects)."""
    import ray

    already = ray.is_initialized()
    if not already:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    finally:
        if not already:
            ray.shutdown()


def placement_problems(learner: Dict[str, float], actor: Dict[str, float], num_actors: int,
                       nodes: List[Dict[str, float]]) -> List[Tuple[str, str]]:
    """(flag, message) when the nodes cannot hold the learner and `num_actors` actors with these resources."""
    def fits(need: Dict[str, float], node: Dict[str, float]) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in need.items())

    def describe(need: Dict[str, float]) -> str:
        return ",".join(f"{k}={v:g}" for k, v in need.items())

    problems = []
    for flag, need in (("learner_resources", learner), ("actor_resources", actor)):
        if not any(fits(need, n) for n in nodes):
            missing = sorted(k for k, v in need.items() if not any(n.get(k, 0.0) >= v for n in nodes))
            problems.append((flag, f"no node has {describe(need)} (lacking: {', '.join(missing) or 'all at once'}); "
                             f"nodes have: {_describe_nodes(nodes)}"))
    if problems:
        return problems
    # Enough room for the learner and every actor at once (first fit, the learner tried on each node).
    for first in range(len(nodes)):
        if not fits(learner, nodes[first]):
            continue
        free = [dict(n) for n in nodes]
        for k, v in learner.items():
            free[first][k] -= v
        placed = 0
        for node in free:
            while placed < num_actors and fits(actor, node) and actor:
                for k, v in actor.items():
                    node[k] -= v
                placed += 1
        if placed >= num_actors or not actor:
            return []
    return [("actor_resources", f"the nodes hold fewer than --num_actors {num_actors} actors of {describe(actor)} "
             f"beside the learner's {describe(learner) or 'nothing'}; nodes have: {_describe_nodes(nodes)}")]


def _describe_nodes(nodes: List[Dict[str, float]]) -> str:
    shown = []
    for node in nodes:
        useful = {k: v for k, v in node.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        shown.append("{" + ",".join(f"{k}={v:g}" for k, v in sorted(useful.items())) + "}")
    return " ".join(shown)


def ray_flag_problems(run: Any) -> List[Tuple[str, str]]:
    """(flag, message) for every Ray flag that cannot work; connects to --ray_address to check resources."""
    launcher = setting(run, "launcher")
    if launcher not in LAUNCHERS:
        return [("launcher", f"{launcher!r} not in {LAUNCHERS}")]
    problems: List[Tuple[str, str]] = []
    parsed: Dict[str, Dict[str, float]] = {}
    for flag in ("learner_resources", "replay_resources", "actor_resources"):
        try:
            parsed[flag] = parse_resources(setting(run, flag))
        except ValueError as error:
            problems.append((flag, str(error)))
    if launcher != "ray":
        for flag in ("ray_address", "learner_resources", "replay_resources", "actor_resources"):
            if setting(run, flag):
                problems.append((flag, "needs --launcher ray"))
        return problems
    address = setting(run, "ray_address")
    if address:
        problem = address_problem(address)
        if problem:
            return problems + [("ray_address", problem)]
    if problems:
        return problems
    try:
        nodes = cluster_node_resources(address) if address else local_node_resources()
    except Exception as error:  # noqa: BLE001 (whatever stops us joining, e.g. a token mismatch, is the flag's problem)
        return [("ray_address", f"cannot join the Ray cluster at {address}: {type(error).__name__}: {error}")]
    # The replay service is placed like a second learner: both must fit beside the actors.
    learner = dict(parsed["learner_resources"])
    for k, v in parsed["replay_resources"].items():
        learner[k] = learner.get(k, 0.0) + v
    return placement_problems(learner, parsed["actor_resources"], run.num_actors, nodes)


# -- the Ray actors --------------------------------------------------------------------------


def _mirrored(rel: str, root: Path) -> bool:
    """Whether a scratch file goes to the results directory (finished checkpoints only; no temp files)."""
    parts = rel.split("/")
    if parts[0] in NOT_MIRRORED or any(p.startswith(".") for p in parts):
        return False
    if parts[0] in CHECKPOINT_TREES:
        # Orbax renames a finished step to its number and Reverb writes DONE last: only finished steps go.
        return len(parts) > 2 and (root / parts[0] / parts[1] / CHECKPOINT_TREES[parts[0]]).exists()
    return True


def _scratch(prefix: str) -> Path:
    """A new node-local directory, inside this Ray session's directory (Ray's place for a session's files)."""
    try:
        import ray._private.worker

        root = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "actorq"
        root.mkdir(exist_ok=True)
    except (AttributeError, OSError):  # a Ray without that (private) attribute: the system's temp dir
        root = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def _without_repeated_header(data: bytes, dest: Path) -> bytes:
    """`data` less its first line when that line is `dest`'s header already."""
    try:
        with open(dest, "rb") as f:
            header = f.readline()
    except FileNotFoundError:
        return data
    return data[len(header):] if header and data.startswith(header) else data


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class WorkerHost:
    """Ray actor that runs one worker process in a node-local scratch directory and serves its files."""

    def __init__(self, name: str, files: Dict[str, bytes]):
        self.name = name
        self.dir = _scratch(f"{name}-")
        for sub in ("logs", "status", "actors"):
            (self.dir / sub).mkdir()
        self.pushed: set = set()
        self.put(files)
        if "config.json" in files:
            # Every role writes under run.results_dir: here, this node's scratch directory.
            config = json.loads(files["config.json"])
            config["run"]["results_dir"] = str(self.dir)
            if not config["run"].get("advertise_host"):
                import ray

                # The learner advertises the address other nodes reach it at: its node's IP.
                config["run"]["advertise_host"] = ray.util.get_node_ip_address()
            _write_atomic(self.dir / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
        self.process: Optional[subprocess.Popen] = None

    def where(self) -> Dict[str, Any]:
        """This host's node id, node IP, pid and scratch directory."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "dir": str(self.dir)}

    def start(self, role: str, args: List[str]) -> int:
        """Starts the worker command (a restart replaces a finished process); returns its pid."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"{self.name} is still running (pid {self.process.pid})")
        # Ray sets a thread count for its own workers; the worker's --threads decides ours, as locally.
        env = {k: v for k, v in worker_env().items() if k != "OMP_NUM_THREADS"}
        with open(self.dir / "logs" / f"{self.name}.log", "ab") as log_file:
            self.process = subprocess.Popen(worker_command(role, os.getpid(), self.dir, args), stdout=log_file,
                                            stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        return self.process.pid

    def put(self, files: Dict[str, bytes]) -> None:
        """Writes files the driver sends (config.json, the reports this worker reads)."""
        for rel, data in files.items():
            _write_atomic(self.dir / rel, data)
            self.pushed.add(rel)

    def state(self, known: Dict[str, List[int]], chunk_bytes: int = SYNC_CHUNK_BYTES) -> Dict[str, Any]:
        """The process's pid and exit code, then what changed in its files since `known` ({rel: [offset, mtime, inode]})."""
        # The exit code first: a process reported finished has nothing left to write.
        code = None if self.process is None else self.process.poll()
        pid = None if self.process is None else self.process.pid
        changes: Dict[str, Tuple[str, int, int, bytes, int]] = {}
        present: List[str] = []
        budget = chunk_bytes
        for path in self._files():
            rel = path.relative_to(self.dir).as_posix()
            if rel in self.pushed or not _mirrored(rel, self.dir):
                continue
            present.append(rel)
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            # -1: not even an empty file there yet (Reverb's DONE is empty).
            offset, mtime, inode = known.get(rel, [-1, 0, 0])
            try:
                change = self._change(path, stat, offset, mtime, inode, budget, rel.endswith(".json"))
            except FileNotFoundError:  # pruned while we looked: gone from `present` next pass
                continue
            if change is not None:
                budget -= len(change[3])
                changes[rel] = change
        return {"pid": pid, "returncode": code, "changes": changes, "present": present, "where": self.where()}

    @staticmethod
    def _change(path: Path, stat: os.stat_result, offset: int, mtime: int, inode: int, budget: int,
                whole: bool) -> Optional[Tuple[str, int, int, bytes, int]]:
        """(mode, new offset, mtime, bytes, inode) of what the driver lacks of one file; None when it has it all."""
        if whole:
            # Reports are replaced whole (os.replace): send the whole file when it changed.
            if stat.st_mtime_ns == mtime and stat.st_size == offset:
                return None
            return "replace", stat.st_size, stat.st_mtime_ns, path.read_bytes(), stat.st_ino
        # A file replaced by another (learner.csv trimmed after a restore) is sent again from its start.
        replaced = offset >= 0 and inode and stat.st_ino != inode
        if (stat.st_size == offset and not replaced) or budget <= 0:
            return None
        mode, start = ("append", max(offset, 0)) if stat.st_size > offset and not replaced else ("rewrite", 0)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(min(budget, stat.st_size - start))
        return mode, start + len(data), stat.st_mtime_ns, data, stat.st_ino

    def _files(self) -> List[Path]:
        """Files under the scratch directory (directories that vanish while walked, as Orbax's do, are skipped)."""
        found = []
        for root, dirs, names in os.walk(self.dir):
            dirs.sort()
            found.extend(Path(root) / name for name in sorted(names))
        return found

    def signal(self, sig: int) -> None:
        """Sends `sig` to the worker process, if it runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def close(self) -> None:
        """Kills the worker if it still runs and removes the scratch directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class NodeEnergy:
    """Ray actor measuring its node's energy (codecarbon, machine mode) for the run."""

    def __init__(self, country: str, label: str):
        from actorq_jax.telemetry import EnergyTracker

        self.dir = _scratch("energy-")
        self.tracker = EnergyTracker(self.dir, country_iso_code=country, tracking_mode="machine", project_name=label)
        self.tracker.start()

    def stop(self) -> Tuple[Dict[str, float], str]:
        """Stops measuring: the node's figures and its emissions.csv text ('' when codecarbon wrote none)."""
        report = self.tracker.stop()
        path = self.dir / "emissions.csv"
        text = path.read_text() if path.exists() else ""
        shutil.rmtree(self.dir, ignore_errors=True)
        return report, text


# -- the driver's side -----------------------------------------------------------------------


class RayWorkerProcess:
    """A worker running under a WorkerHost, seen as a subprocess.Popen (state kept fresh by the mirror)."""

    def __init__(self, placement: "RayPlacement", host: "_Host", start_ref: Any):
        self._placement = placement
        self._host = host
        self._start_ref = start_ref
        self._pid: Optional[int] = None
        self.returncode: Optional[int] = None

    @property
    def pid(self) -> int:
        """The worker's pid on its node (0 until Ray has placed its host)."""
        if self._pid is None:
            import ray

            ready, _ = ray.wait([self._start_ref], timeout=0)
            if ready:
                try:
                    self._pid = int(ray.get(ready[0]))
                except Exception:  # noqa: BLE001 (a host that died before starting: poll() reports it)
                    self._pid = -1
        return self._pid or 0

    def poll(self) -> Optional[int]:
        """The exit code seen by the last mirror pass (a lost node reads as killed)."""
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit code; subprocess.TimeoutExpired past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self._host.name, timeout)
            time.sleep(SYNC_PERIOD_S / 2)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the worker through its host."""
        if self.returncode is None:
            self._host.actor.signal.remote(int(sig))

    def kill(self) -> None:
        """Kills the worker (its host stays, so its files are still mirrored)."""
        self.send_signal(signal.SIGKILL)


class _Host:
    """The driver's record of one WorkerHost: its actor, node, mirror offsets and what it was sent."""

    def __init__(self, name: str, role: str, actor: Any, incarnation: int):
        self.name, self.role, self.actor, self.incarnation = name, role, actor, incarnation
        self.known: Dict[str, List[int]] = {}
        self.pushed: Dict[str, int] = {}
        self.where: Optional[Dict[str, Any]] = None
        self.process: Optional[RayWorkerProcess] = None
        self.inflight: Any = None  # the state call not answered yet
        self.dead = False


class RayPlacement(Placement):
    """Places workers on a Ray cluster (joined with --ray_address, or a local instance started for the run)."""

    name = "ray"

    def __init__(self, run: Any, results_dir: Path):
        super().__init__(run, results_dir)
        self.learner_resources = parse_resources(setting(run, "learner_resources"))
        self.replay_resources = parse_resources(setting(run, "replay_resources"))
        self.actor_resources = parse_resources(setting(run, "actor_resources"))
        self.hosts: Dict[str, _Host] = {}
        self.incarnations: Dict[str, int] = {}
        self.origin: Dict[str, str] = {}  # results file -> the host whose worker writes it
        self.lock = threading.RLock()
        self.initialized_here = False
        self.energy: Optional[RayEnergyMeter] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ------------------------------------------------------------------------

    def open(self) -> None:
        """Joins --ray_address, or starts a Ray instance on this machine (loopback only) for the run."""
        address = setting(self.run, "ray_address")
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
        self._thread = threading.Thread(target=self._mirror_loop, name="ray-mirror", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Mirrors the last files, removes every host and, for a local instance, shuts Ray down."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(CALL_TIMEOUT_S)
        self.sync(drain=True)
        with self.lock:
            hosts = list(self.hosts.values())
        closing = [h.actor.close.remote() for h in hosts if not h.dead]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CALL_TIMEOUT_S)
        for host in hosts:
            ray.kill(host.actor, no_restart=True)
        if self.energy is not None:
            self.energy.release()
        if self.initialized_here:
            ray.shutdown()  # disconnects from a joined cluster; stops the instance this run started

    # -- workers ----------------------------------------------------------------------------

    def start(self, name: str, role: str, args: List[str]) -> RayWorkerProcess:
        """Starts worker `name` on its host (a new host, placed by Ray, when it has none or lost its node)."""
        with self.lock:
            host = self.hosts.get(name)
            if host is None or host.dead:
                host = self._new_host(name, role)
            # The reports this worker reads must be there before it starts (a caller's calls run in order).
            host.actor.put.remote(self._push_files(host))
            process = RayWorkerProcess(self, host, host.actor.start.remote(role, args))
            host.process = process
            return process

    def _new_host(self, name: str, role: str) -> _Host:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if role == "evaluator":
            # Beside the replay service: it fetches every published policy from its server.
            service = self.hosts.get("replay")
            node = service.where["node_id"] if service and service.where else None
            options: Dict[str, Any] = {"num_cpus": 0}
            if node:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        else:
            resources = {"learner": self.learner_resources, "replay": self.replay_resources}.get(role,
                                                                                                self.actor_resources)
            options = actor_options(resources)
            if role == "actor" and not resources:
                # Nothing reserved (as local processes, they may oversubscribe): spread them over the nodes.
                options["scheduling_strategy"] = "SPREAD"
        incarnation = self.incarnations.get(name, -1) + 1
        self.incarnations[name] = incarnation
        files = {"config.json": (self.results_dir / "config.json").read_bytes()}
        if role in ("learner", "replay"):
            # A resumed run, or a learner or service whose node was lost, restores from the mirrored checkpoints.
            files.update(self._checkpoint_files())
        actor = ray.remote(WorkerHost).options(max_restarts=0, max_task_retries=0, **options).remote(name, files)
        host = _Host(name, role, actor, incarnation)
        self.hosts[name] = host
        return host

    def _placed(self, host: _Host) -> None:
        if self.energy is not None:
            self.energy.node(host.where["node_id"], host.where["ip"])
        self.events.append(f"{host.name} (incarnation {host.incarnation}) on node {host.where['ip']} "
                           f"{host.where['node_id'][:12]}")

    def _checkpoint_files(self) -> Dict[str, bytes]:
        files = {}
        for tree in CHECKPOINT_TREES:
            root = self.results_dir / tree
            if root.is_dir():
                for path in root.rglob("*"):
                    if path.is_file():
                        files[path.relative_to(self.results_dir).as_posix()] = path.read_bytes()
        return files

    def service_address(self, status: Dict[str, Any]) -> str:
        """HOST:PORT of the replay service as the other nodes reach it: --advertise_host, else its node's IP."""
        port = str(status["local_address"]).rpartition(":")[2]
        host = setting(self.run, "advertise_host")
        if not host:
            host = self.hosts["replay"].where["ip"]
        return f"{host}:{port}"

    def energy_meter(self, country: str) -> "RayEnergyMeter":
        """Measures each node that hosts a worker (codecarbon there); the summary gets their sum."""
        self.energy = RayEnergyMeter(self.results_dir, country)
        return self.energy

    # -- the mirror --------------------------------------------------------------------------

    def _mirror_loop(self) -> None:
        while not self._stop.wait(SYNC_PERIOD_S):
            try:
                self.sync()
            except Exception as error:  # noqa: BLE001 (the mirror must outlive one bad pass; the next retries)
                log.warning("mirror pass failed: %s: %s", type(error).__name__, error)

    def sync(self, drain: bool = False) -> None:
        """One mirror pass over every live host (with drain, passes until nothing is left to copy)."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            moved = self._sync_once(wait_s=CALL_TIMEOUT_S if drain else 1.0)
            if not drain or (not moved and not self._pending()) or time.monotonic() > deadline:
                return

    def _pending(self) -> bool:
        with self.lock:
            return any(h.inflight is not None for h in self.hosts.values() if not h.dead)

    def _sync_once(self, wait_s: float = 1.0) -> int:
        """Asks every live host for its state (one call in flight per host) and applies the answers that came."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        with self.lock:
            hosts = [h for h in self.hosts.values() if not h.dead]
            for host in hosts:
                files = self._push_files(host)
                if files:
                    host.actor.put.remote(files)  # ordered before the state call below
                if host.inflight is None:
                    host.inflight = host.actor.state.remote({k: list(v) for k, v in host.known.items()})
        refs = [h.inflight for h in hosts]
        if not refs:
            return 0
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        ready_ids = {r.hex() for r in ready}
        moved = 0
        for host in hosts:
            if host.inflight is None or host.inflight.hex() not in ready_ids:
                continue  # a host Ray has not placed yet, or a slow node: asked again next pass
            ref, host.inflight = host.inflight, None
            try:
                state = ray.get(ref)
            except RayActorError as error:
                self._lost(host, error)
                continue
            except RayTaskError as error:  # a failed read: the files are still there next pass
                log.warning("reading %s's files failed: %s", host.name, error)
                continue
            with self.lock:
                moved += self._apply(host, state)
        return moved

    def _lost(self, host: _Host, error: Exception) -> None:
        with self.lock:
            host.dead = True
            if host.process is not None and host.process.returncode is None:
                host.process.returncode = LOST_NODE_EXIT
            self.events.append(f"{host.name} lost its host ({type(error).__name__})")
            log_path = self.results_dir / "logs" / f"{host.name}.log"
            with open(log_path, "a") as f:
                f.write(f"\n[actorq driver] host of {host.name} is gone ({type(error).__name__}): its node or "
                        f"Ray worker died\n")

    def _apply(self, host: _Host, state: Dict[str, Any]) -> int:
        if host.where is None:
            host.where = state["where"]
            self._placed(host)
        moved = 0
        for rel, (mode, offset, mtime, data, inode) in state["changes"].items():
            dest = self.results_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.origin[rel] = host.name
            first = rel not in host.known
            if mode == "replace":
                _write_atomic(dest, data)
            elif mode == "rewrite":
                with open(dest, "wb") as f:
                    f.write(data)
            else:
                if first and rel.endswith(".csv"):
                    # A new host (a lost node, a resumed run) continues the results' CSV: one header.
                    data = _without_repeated_header(data, dest)
                with open(dest, "ab") as f:
                    f.write(data)
            host.known[rel] = [offset, mtime, inode]
            moved += len(data)
        self._forget_pruned(host, set(state["present"]))
        process = host.process
        # The answer may predate a restart on this host: only the process it names gets its exit code.
        if process is not None and process.returncode is None and state["returncode"] is not None:
            if state["pid"] is not None and process.pid == state["pid"]:
                process.returncode = int(state["returncode"])
        return moved

    def _forget_pruned(self, host: _Host, present: set) -> None:
        """Removes mirrored checkpoint files the learner pruned (it keeps only the newest few)."""
        for rel in [r for r in host.known if r not in present and r.split("/")[0] in CHECKPOINT_TREES]:
            del host.known[rel]
            path = self.results_dir / rel
            path.unlink(missing_ok=True)
            step_dir = self.results_dir.joinpath(*rel.split("/")[:2])
            if step_dir.exists() and not any(p.is_file() for p in step_dir.rglob("*")):
                shutil.rmtree(step_dir, ignore_errors=True)

    def _push_files(self, host: _Host) -> Dict[str, bytes]:
        """Status reports this host's worker reads and did not write, where they changed since last sent."""
        files = {}
        for path in sorted((self.results_dir / "status").glob("*.json")):
            rel = f"status/{path.name}"
            if self.origin.get(rel) == host.name:
                continue
            try:
                mtime = path.stat().st_mtime_ns
                if host.pushed.get(rel) != mtime:
                    files[rel] = path.read_bytes()
                    host.pushed[rel] = mtime
            except FileNotFoundError:
                continue
        return files


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
        from ray.exceptions import GetTimeoutError, RayActorError

        duration = time.monotonic() - (self.started or time.monotonic())
        with self.lock:
            agents, self.started = dict(self.agents), None
        energy, emissions, header, rows = [], [], None, []
        for agent in agents.values():
            try:
                report, text = ray.get(agent.stop.remote(), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                energy.append(math.nan)  # a node that left took its measurement with it
                emissions.append(math.nan)
                continue
            energy.append(report.get("energy_kwh", math.nan))
            emissions.append(report.get("emissions_kg", math.nan))
            lines = text.splitlines()
            if lines:
                header = header or lines[0]
                rows.extend(lines[1:])
        if header is not None:
            (self.results_dir / "emissions.csv").write_text("\n".join([header, *rows]) + "\n")
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
