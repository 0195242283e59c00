"""The Ray actor that hosts one worker of a `--launcher ray` run on its node (see launch/ray_placement.py).

A `WorkerHost` runs the worker command a local run starts, in a node-local
scratch directory holding the run's config.json (its results_dir pointing
there). `run` blocks until the worker exits and returns its exit code; beside
it (the actor serves HOST_CONCURRENCY calls at once) the driver signals the
worker, reads its files in chunks (checkpoints, its log) and seeds files into
the scratch directory.
"""

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Dict, List, Optional

from actorq_jax.launch.placement import worker_command, worker_env
from actorq_jax.launch.ray_energy import scratch_dir
from actorq_jax.run_dir import RunDir

# The most bytes one call carries (a checkpoint or a log comes over several calls).
CHUNK_BYTES = 8 << 20
# Calls a host serves at once: `run` blocks until the worker exits, signals and file reads go beside it.
HOST_CONCURRENCY = 4


class WorkerHost:
    """Ray actor that runs one worker's command on its node, in a scratch directory, and serves its files."""

    def __init__(self, name: str, config_json: str):
        import ray

        self.name = name
        self.dir = scratch_dir(f"{name}-")
        for sub in (RunDir.LOGS, RunDir.STATUS, RunDir.ACTORS):
            (self.dir / sub).mkdir()
        config = json.loads(config_json)
        config["run"]["results_dir"] = str(self.dir)  # every role writes under run.results_dir: here
        # The service advertises the address other nodes reach it at: its node's IP.
        config["run"]["advertise_host"] = config["run"].get("advertise_host") or ray.util.get_node_ip_address()
        RunDir(self.dir).config.write_text(json.dumps(config, indent=2, sort_keys=True))
        self.process: Optional[subprocess.Popen] = None
        self.pids: Dict[int, int] = {}
        self.started = threading.Condition()

    def where(self) -> Dict[str, str]:
        """This host's node id and node IP."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def _path(self, rel: str) -> Path:
        path = (self.dir / rel).resolve()
        if self.dir.resolve() not in path.parents:
            raise ValueError(f"{rel!r} is not inside {self.name}'s directory")
        return path

    def put(self, rel: str, offset: int, data: bytes) -> None:
        """Writes `data` at `offset` of file `rel` (chunks of a seeded checkpoint may come in any order)."""
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def run(self, attempt: int, role: str, args: List[str]) -> int:
        """Runs the worker command until it exits; its exit code."""
        # Ray sets a thread count for its own workers; the worker's --threads decides ours, as locally.
        env = {k: v for k, v in worker_env().items() if k != "OMP_NUM_THREADS"}
        with open(RunDir(self.dir).log(self.name), "ab") as log_file:
            process = subprocess.Popen(worker_command(role, os.getpid(), self.dir, args), stdout=log_file,
                                       stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        with self.started:
            self.process, self.pids[attempt] = process, process.pid
            self.started.notify_all()
        return process.wait()

    def pid(self, attempt: int, timeout_s: float) -> int:
        """The pid of the worker `run(attempt, ...)` started, once it has (0 if not within `timeout_s`)."""
        with self.started:
            self.started.wait_for(lambda: attempt in self.pids, timeout_s)
            return self.pids.get(attempt, 0)

    def signal(self, sig: int) -> None:
        """Sends `sig` to the worker process, if it runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def files(self, rel_dir: str) -> Dict[str, int]:
        """{path relative to the scratch directory: size} of the files under `rel_dir`."""
        root = self._path(rel_dir)
        found = {}
        for base, _, names in os.walk(root):
            for name in names:
                path = Path(base) / name
                try:
                    found[path.relative_to(self.dir).as_posix()] = path.stat().st_size
                except FileNotFoundError:  # removed while listed (a pruned checkpoint)
                    continue
        return found

    def read(self, rel: str, offset: int, size: int = CHUNK_BYTES) -> bytes:
        """At most `size` bytes of file `rel` from `offset` (b"" past its end, or when it does not exist)."""
        try:
            with open(self._path(rel), "rb") as f:
                f.seek(offset)
                return f.read(min(size, CHUNK_BYTES))
        except FileNotFoundError:
            return b""

    def close(self) -> None:
        """Kills the worker if it still runs and removes the scratch directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
