"""Worker processes forked from a template that imported the workers' libraries once per run.

A fresh `python -m actorq_jax.launch.worker` spends 5-7 CPU-seconds importing JAX, Reverb (which
brings TensorFlow), dm_control and Flax before it does any work: more than a short run's workers
spend working, and paid again by every restarted worker. The launcher instead starts one template
process (`python -m actorq_jax.launch.forker`), which imports them and then forks a worker per
request. Importing computes nothing: the template has no JAX backend, no TensorFlow runtime and no
Reverb connection, so a fork copies no running threads or sockets.

Each worker is still the launcher's own child: the template forks twice and the intermediate exits,
so the worker is re-parented to the launcher, which declared itself the subreaper of its
descendants while the template runs (Linux's PR_SET_CHILD_SUBREAPER). The launcher waits for its exit code, signals it and
sees it in `ps` under its own command line (setproctitle), exactly as a started subprocess;
`runtime.die_with_parent` still ties it to the launcher.

A launcher that is still single-threaded when it needs the template (the command-line launcher is)
imports PRELOAD itself and forks the template from its own image: the Reverb client the launcher needs
anyway and the rest of the import are then paid once per run instead of twice (about 5 CPU-seconds
of a tiny run's 22 on 2 cores). A process with other threads (a test, a second template after a loss)
starts `python -m actorq_jax.launch.forker` instead, since a fork copies no thread but may copy a
lock one of them held.

The protocol is one JSON line each way per worker on the template's request and reply pipes (its
stdin and stdout when started as a process): {"argv", "log", "env", "title", "parent"} in, {"pid"}
(or {"error"}) out. The template exits when its request pipe closes (the launcher is done or gone).
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO, Tuple

# What the workers of every role import (see the module docstring).
PRELOAD = ("actorq_jax.launch.worker", "jax", "jax.numpy", "numpy", "reverb", "dm_control.suite", "flax.linen",
           "actorq_jax.agents.registry", "actorq_jax.launch.replay_service", "actorq_jax.launch.learner",
           "actorq_jax.launch.actor", "actorq_jax.launch.evaluator", "optax", "rlax", "orbax.checkpoint")
PR_SET_CHILD_SUBREAPER = 36
# How long a forked worker waits to be re-parented to the launcher (immediate on Linux; a bound, not a sleep).
REPARENT_TIMEOUT_S = 10.0


def set_subreaper(on: bool) -> bool:
    """Makes orphaned descendants of this process its children (Linux), or stops it; False where the kernel cannot."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


class ForkedWorker:
    """A worker forked by the template and re-parented to this process, seen as a subprocess.Popen."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """The exit code (minus the signal's number when a signal ended it), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost, but it is over
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit code; subprocess.TimeoutExpired past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Sends a signal (nothing once it has exited: its pid is not ours any more)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """Kills it at once."""
        self.send_signal(signal.SIGKILL)


class WorkerForker:
    """The launcher's side: starts the template on the first worker, asks it for each worker, stops it at close."""

    def __init__(self, log_path: Path, env: Dict[str, str], fork_here: Optional[bool] = None):
        self.log_path = Path(log_path)
        self.env = env
        # None: fork the template from this process when that is safe (see can_fork_here).
        self.fork_here = fork_here
        self._template: Optional[Any] = None
        self._lock = threading.Lock()

    def start(self, command: List[str], log_path: Path, env: Dict[str, str]) -> ForkedWorker:
        """Forks the worker `command` (python -m actorq_jax.launch.worker ...) with `env`, output appended to log_path."""
        module = command.index("-m") + 2
        request = {"argv": command[module:], "log": str(log_path), "env": env, "title": " ".join(command),
                   "parent": os.getpid()}
        with self._lock:
            template = self.ensure_running()
            try:
                template.stdin.write(json.dumps(request) + "\n")
                template.stdin.flush()
                line = template.stdout.readline()
            except OSError:  # it died since the last start (the next start brings a new one)
                line = ""
        if not line:
            raise RuntimeError(f"the worker template exited (code {template.wait()}); its log: {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the worker template could not fork {command[module]}: {reply['error']}")
        return ForkedWorker(int(reply["pid"]))

    def ensure_running(self) -> Any:
        """The template process, started now if it is not running (its imports take a few seconds)."""
        if self._template is not None and self._template.poll() is None:
            return self._template
        if not set_subreaper(True):
            raise RuntimeError("forked workers need Linux's PR_SET_CHILD_SUBREAPER")
        if self.fork_here if self.fork_here is not None else can_fork_here():
            self._template = _fork_template(self.log_path, self.env)
            return self._template
        with open(self.log_path, "ab") as log:
            self._template = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=log, env=self.env, text=True)
        return self._template

    def close(self) -> None:
        """Stops the template (workers already started are not its children and go on)."""
        if self._template is None:
            return
        # This process adopts no more orphans: a process that goes on after the run (a test, a sweep) would
        # otherwise collect every orphan of its later children as a zombie nobody waits for.
        set_subreaper(False)
        self._template.stdin.close()
        try:
            self._template.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._template.kill()
            self._template.wait()
        self._template.stdout.close()
        self._template = None


class _TemplateHere(ForkedWorker):
    """The template forked from this process, with the launcher's ends of its request and reply pipes."""

    def __init__(self, pid: int, stdin: TextIO, stdout: TextIO):
        super().__init__(pid)
        self.stdin = stdin
        self.stdout = stdout


def can_fork_here() -> bool:
    """Whether this process may become the template's image: one Python thread (a fork copies no other thread,
    but may copy a lock another held), no library thread that named itself (gRPC's and Reverb's, alive while a
    client or server is) and no JAX backend started (its thread pools would not survive the fork either)."""
    if threading.active_count() != 1 or _named_threads():
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is None or not bridge.backends_are_initialized()


def _named_threads() -> List[str]:
    """The names of this process's OS threads named otherwise than its main thread (Linux)."""
    def name(path: str) -> Optional[str]:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:  # a thread that ended meanwhile
            return None

    main = name("/proc/self/comm")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    return [n for n in (name(f"/proc/self/task/{t}/comm") for t in tasks) if n not in (None, main)]


def _preload() -> None:
    """Imports what every worker role imports."""
    for name in PRELOAD:
        __import__(name)


def _fork_template(log_path: Path, env: Dict[str, str]) -> _TemplateHere:
    """Imports PRELOAD in this process, in the environment the template would start with, and forks the template."""
    # setproctitle finds the command line's memory from the environment's when first used, and a change of the
    # environment moves that: set up first, the workers forked from here can still retitle themselves.
    import setproctitle

    setproctitle.getproctitle()

    os.environ.update(env)  # what the imports read (MUJOCO_GL, TF_CPP_MIN_LOG_LEVEL) is the workers'
    _preload()
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write this process's buffered output again
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # Its own ends only: the template must see end-of-file when the launcher closes the request pipe.
            os.close(requests_write)
            os.close(replies_read)
            null_fd = os.open(os.devnull, os.O_RDWR)
            os.dup2(null_fd, 0)
            os.dup2(null_fd, 1)  # not the launcher's output: a reader of it would wait for the template too
            os.dup2(log_fd, 2)
            os.close(null_fd)
            os.close(log_fd)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            code = _serve_requests(os.fdopen(requests_read), os.fdopen(replies_write, "w"),
                                   (requests_read, replies_write))
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(requests_read)
    os.close(replies_write)
    os.close(log_fd)
    return _TemplateHere(pid, os.fdopen(requests_write, "w"), os.fdopen(replies_read))


def _run_worker(request: Dict, template_fds: Tuple[int, ...] = (), hangup: Any = signal.SIG_DFL) -> None:
    """In the forked worker: output, title and environment of the worker, then worker.main; never returns."""
    code = 1
    try:
        for fd in template_fds:  # the template's pipes: a worker holding them would hide the template's exit
            os.close(fd)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # Re-parented to the launcher once the intermediate process has exited (see set_subreaper).
        deadline = time.monotonic() + REPARENT_TIMEOUT_S
        while os.getppid() != request["parent"] and time.monotonic() < deadline:
            time.sleep(0.001)
        import setproctitle

        # Before the environment changes: setproctitle reuses the memory of the initial environment.
        setproctitle.setproctitle(request["title"])
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, hangup)  # ignored under nohup; else the worker's stop handlers take it
        from actorq_jax.launch.worker import main

        code = main(request["argv"])
    except SystemExit as exit_info:  # argparse's usage errors
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        from actorq_jax.launch import runtime  # loaded already: the template imported it

        runtime.exit_now(code)


def _serve() -> int:
    """The template started as a process: imports PRELOAD, then serves the requests on its stdin."""
    _preload()
    return _serve_requests(sys.stdin, sys.stdout)


def _serve_requests(requests: TextIO, replies: TextIO, template_fds: Tuple[int, ...] = ()) -> int:
    """The template: forks a worker for every request line until the request pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    # So is a hangup (a closed terminal); each worker starts with the disposition the template was given.
    hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    hangup = hangup if hangup in (signal.SIG_DFL, signal.SIG_IGN) else signal.SIG_DFL
    from actorq_jax.launch import runtime

    runtime.die_with_parent()
    for line in requests:
        request = json.loads(line)
        try:
            pid_read, pid_write = os.pipe()
            middle = os.fork()
        except OSError as error:
            replies.write(json.dumps({"error": str(error)}) + "\n")
            replies.flush()
            continue
        if middle == 0:
            try:
                os.close(pid_read)
                worker = os.fork()
                if worker == 0:
                    os.close(pid_write)
                    _run_worker(request, template_fds, hangup)
                os.write(pid_write, str(worker).encode())
            finally:
                os._exit(0)
        os.close(pid_write)
        with os.fdopen(pid_read) as pid_pipe:
            worker_pid = pid_pipe.read()
        os.waitpid(middle, 0)
        # Only now is the worker the launcher's child: the launcher may wait for it as soon as it has the pid.
        replies.write(json.dumps({"pid": int(worker_pid)} if worker_pid else {"error": "the fork failed"}) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
