"""Starts and watches one ActorQ run: a replay service (owning Reverb), a learner, N actors and an evaluator.

Every worker is a fresh `python -m actorq_jax.launch.worker` process (never a fork of a process that
has initialised JAX), with its own thread budget, cores (`--layout`, `--*_cpus`) and a log file under
`<results_dir>/logs/`. The launcher starts the replay service first and hands its address to every
other worker. It restarts actors that die; a learner that dies restarts from its last checkpoint
against the same live replay table (up to `max_learner_restarts`); a replay service that dies restarts
on the same port from the replay checkpoint of the learner's last checkpoint (up to
`max_replay_restarts`), while the learner and actors reconnect on their own. A service that comes back at
another address (under Ray, on another node; or on a new port, when another process took the one the
launcher picked) is followed: the learner restarts there from its last checkpoint, the actors and the
evaluator restart there too (remote actors started by hand still look at the old one). It stops the run past
those, on Ctrl-C/SIGTERM or at a budget, and shuts down in an order that keeps every result: actors
first, then the learner (final checkpoint, publication), the evaluator's last evaluation, the service.

The service's port is in config.json (picked here when `run.port` is 0): `--resume` listens where the
remote actors already look, and fails clearly when something else holds it.
"""

import contextlib
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TextIO

from actorq_jax import net
from actorq_jax.launch import runtime
from actorq_jax.launch.channel import FileChannel, RunChannel, make_channel
from actorq_jax.launch.checkpoint import read_counters
from actorq_jax.launch.config import RunConfig, save_config
from actorq_jax.launch.leases import LEASE_TTL_S, read_leases
from actorq_jax.launch.placement import CpuMeter, LocalPlacement, Placement, WorkerProcess, ended, how_it_ended
from actorq_jax.launch.replay_service import CHECKPOINT_S_PER_ITEM
from actorq_jax.net import PortTaken
from actorq_jax.run_dir import NARROW_WINDOW_EVENT, STOP_EVENT, RunDir
from actorq_jax.telemetry.progress import is_terminal
from actorq_jax.telemetry.tensorboard import TensorBoardExport

START_TIMEOUT_S = 300.0
ACTOR_STOP_TIMEOUT_S = 20.0
# How long a min_size-regime run's table sits at --min_replay_size, the learner stepping, before the launcher says
# so (ReplayWindowWatch): longer than a learner restart's pause, short enough to be read while the run goes.
NARROW_WINDOW_HOLD_S = 60.0
LEARNER_FINAL_TIMEOUT_S = 180.0
EVALUATOR_FINAL_TIMEOUT_S = 600.0
# Starts on a fresh port when another process took the launcher's pick before the service bound it.
PORT_ATTEMPTS = 3
LEARNER_RESTART_STOP_S = 10.0
# A replay service that is alive but has not reported for this long (or half --server_timeout_s, if longer) is
# stopped or hung: it is killed and restarted, inside the window its clients keep reconnecting for.
SERVICE_SILENCE_S = 15.0
# The learner's reports travel through the service: its silence counts only while the service was heard this
# recently (the service reports twice a second).
SERVICE_HEARD_S = 3.0
# An actor whose id lease went unrenewed for this long, while the service was heard, is stopped (a renewal
# every LEASE_TTL_S / 3; a restarted service learns the leases again from the next ones).
LEASE_LOST_S = 3 * LEASE_TTL_S
LEASE_READ_EVERY_S = 2.0
# A pass of the launcher's watch this much later than the one before: the launcher itself was away (Ctrl-Z or a
# SIGSTOP of the run's process group, a starved or busy launcher), so the silences it would now count are not the
# workers' own.
WATCH_AWAY_S = 10.0


@dataclasses.dataclass
class Silence:
    """A live worker's reports as its watchdog sees them: the last new one, when it was read, the silence allowed."""

    key: Any = None
    heard_at: float = dataclasses.field(default_factory=time.monotonic)
    allowed: float = 0.0

    def heard(self, key: Any, allowed: float, now: float) -> bool:
        """Notes a report identified by `key` (None: no report); whether it is new, and `allowed` now applies."""
        if key is None or key == self.key:
            return False
        self.key, self.heard_at, self.allowed = key, now, allowed
        return True

    def over(self, now: float) -> Optional[float]:
        """The silence so far when it is past the one allowed, else None."""
        silent = now - self.heard_at
        return silent if self.allowed and silent > self.allowed else None


@dataclasses.dataclass
class Worker:
    """One child process and how to start it again."""

    name: str
    role: str
    args: List[str]
    threads: int
    process: Optional[WorkerProcess] = None  # a subprocess.Popen, or its Ray counterpart
    restarts: int = 0
    moves: int = 0  # restarts to follow a replay service that moved (not failures: they spend no restart budget)
    gave_up: bool = False
    # An actor's lease on its id, renewed by a thread of its own: when it was last seen held by this process.
    lease_seen_at: Optional[float] = None


class QuietWhenGone:
    """An output stream that falls silent, instead of failing, once writing to it fails (a closed terminal)."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        """Writes `text` while the stream takes it."""
        self._do(lambda: self._stream.write(text))
        return len(text)

    def flush(self) -> None:
        """Flushes while the stream takes it."""
        self._do(self._stream.flush)

    def isatty(self) -> bool:
        """Whether the stream is a terminal still there."""
        try:
            return not self.gone and bool(self._stream.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    def _do(self, action: Callable[[], Any]) -> None:
        if self.gone:
            return
        try:
            action()
        except OSError:  # EIO from a hung-up terminal, EPIPE from a closed pipe: the run's files say the rest
            self.gone = True


class Launcher:
    """Runs one experiment end to end and returns its summary."""

    def __init__(self, run: RunConfig, agent_config: Any, stream: TextIO = sys.stderr):
        self.run = run
        self.agent_config = agent_config
        self.results_dir = Path(run.results_dir).absolute()
        self.dir = RunDir(self.results_dir)
        self.stream = QuietWhenGone(stream)  # a hangup's stop must not fail on the terminal that went away
        self.stop = runtime.StopFlag()  # set from signal handlers: must take no lock (see StopFlag)
        # The replay service's and the learner's reports, for the watchdogs of live but silent workers.
        self._service_silence = Silence()
        self._learner_silence = Silence()
        self._evaluator_silence = Silence()
        self._leases_read_at = 0.0
        self._lease_client: Any = None
        self._last_pass = time.monotonic()  # the watch's last pass (see _came_back)
        # A second stop request while the first is carried out: kill the workers at once (a plain bool, as above).
        self.hurry = False
        self._hurry_said = False
        self.workers: List[Worker] = []
        self.events: List[str] = []
        # Where workers run (local subprocesses or Ray actors); everything else here is the same for both.
        self.placement: Placement = make_placement(run, self.results_dir)
        self.cpu = CpuMeter(self.placement)
        # Status: files until the service is placed, then the run's channel (under Ray: recorded into status/).
        self.record = FileChannel(self.results_dir)
        self.channel: RunChannel = self.record

    # -- processes ------------------------------------------------------------------

    def _start(self, worker: Worker) -> None:
        if worker.role == "replay":  # the port may have been picked again since the service's host started
            worker.args = ["--port", str(self.run.port)]
            self._service_silence = Silence()  # its silence counts from its start
        if worker.role == "learner":
            self._learner_silence = Silence()
        if worker.role == "evaluator":
            self._evaluator_silence = Silence()
        worker.lease_seen_at = None
        # A restarted worker gets new seeds (an actor would otherwise replay its first episodes).
        starts = worker.restarts + worker.moves
        restart = ["--restart", str(starts)] if starts else []
        worker.process = self.placement.start(worker.name, worker.role,
                                              ["--threads", str(worker.threads), *worker.args, *restart])

    def _say(self, message: str) -> None:
        self.events.append(message)
        # On a terminal the progress line has no newline yet: the message replaces it (the next update redraws it).
        clear = "\r\x1b[K" if is_terminal(self.stream) else ""
        print(f"{clear}[actorq] {message}", file=self.stream, flush=True)

    def _log_tail(self, worker: Worker, lines: int = 30) -> str:
        path = self.dir.log(worker.name)
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _terminate(self, workers: List[Worker], timeout_s: float,
                   killed_silent: Optional[Callable[[Worker], bool]] = None) -> None:
        """SIGTERMs the workers (an orderly stop) and waits up to `timeout_s` (0: does not wait) before killing;
        `killed_silent(worker)` ends the wait for one it killed for its silence."""
        self.cpu.sample(workers)
        for w in workers:
            if w.process is not None and not ended(w.process):
                w.process.send_signal(signal.SIGTERM)
        if timeout_s <= 0 and not self.hurry:
            return
        deadline = time.monotonic() + timeout_s
        for w in workers:
            silent = None if killed_silent is None else (lambda w=w: killed_silent(w))
            if w.process is None or self._wait_ended(w.process, deadline, silent):
                continue
            if not self.hurry:
                self._say(f"{w.name} did not stop within {timeout_s:.0f} s; killing it")
            w.process.kill()
            w.process.wait()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Flags only: the main thread may be inside a print when the signal lands (see StopFlag).
        if self.stop.is_set():
            self.hurry = True
        self.stop.set()

    def _wait_ended(self, process: Any, deadline: float, killed_silent: Optional[Callable[[], bool]] = None) -> bool:
        """Waits until `process` is over, at most until `deadline` or a second stop request; whether it is over.
        `killed_silent()`, asked twice a second, kills it when it stopped reporting (and says so)."""
        asked_at = time.monotonic()
        while not ended(process):
            if killed_silent is not None and time.monotonic() - asked_at >= 0.5:
                asked_at = time.monotonic()
                if killed_silent():
                    return True
            if self.hurry:
                if not self._hurry_said:
                    self._hurry_said = True
                    self._say("second stop request: killing the workers now; what they had not finished (the final "
                              "checkpoint, the final evaluation) is skipped, and --resume goes on from the newest "
                              "checkpoint written")
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    # -- main -----------------------------------------------------------------------

    def launch(self) -> Dict[str, Any]:
        """Runs the experiment; returns the summary (also written to summary.json)."""
        from actorq_jax.telemetry import ProgressLine, write_json

        run = self.run
        _import_summary_modules()
        for folder in (self.dir.logs, self.dir.status, self.dir.actors):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in ("replay", "learner", "launcher"):
            self.record.path(stale).unlink(missing_ok=True)
        self.port_chosen = run.port == 0  # ours to change if another process takes it before the service binds it
        if self.port_chosen:
            run = self.run = dataclasses.replace(run, port=runtime.free_port())
        save_config(self.dir.config, run, self.agent_config)
        self.started = {"start_time": time.time(), "pid": os.getpid()}
        self.record.report("launcher", self.started)
        # Before our signal handlers: Ray installs its own when it starts.
        self.placement.open()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in runtime.stop_signals()}
        energy = self.placement.energy_meter(run.country)
        energy.start()
        board = TensorBoardExport(self.results_dir).start() if run.tensorboard else None
        start = time.monotonic()
        replay = Worker("replay", "replay", [], 1)
        learner = Worker("learner", "learner", [], run.learner_threads)
        self.workers.extend([replay, learner])
        exit_code = 0
        try:
            while self.port_chosen and net.port_in_use(run.port):  # taken since the pick: pick again
                self._pick_port_again()
                run = self.run
            if net.port_in_use(run.port):
                raise PortTaken(f"port {run.port} (the replay service's, from {self.dir.config}) is "
                                f"taken by another process; stop it, or start a new run")
            exit_code = self._start_run(replay, learner, progress_factory=lambda: ProgressLine(self.stream),
                                        start=start)
        except PortTaken as error:
            self._say(f"cannot start the replay service: {error}")
            exit_code = 1
        finally:
            self._shutdown(replay, learner)
            if self.hurry and self._hurry_said:
                exit_code = 1  # no final checkpoint or evaluation: the run did not end complete
            elif exit_code == 0 and learner.process and ended(learner.process) and learner.process.returncode != 0:
                self._say(f"learner ended at shutdown ({how_it_ended(learner.process)}):\n{self._log_tail(learner)}")
                exit_code = 1
            energy_report = energy.stop()
            self.placement.close()  # the results directory is complete after it
            if board is not None:
                board.close()  # the rows the placement's close brought in are in the events too
            self.events.extend(self.placement.events)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        summary = self._summarise(time.monotonic() - start, energy_report, exit_code)
        write_json(self.dir.summary, summary)
        return summary

    def _start_run(self, replay: Worker, learner: Worker, progress_factory: Any, start: float, attempt: int = 1) -> int:
        """Starts the service, then the learner, actors and evaluator; watches them; the run's exit code."""
        run = self.run
        self._start(replay)
        try:
            server = self.placement.service_address(run.port)
        except RuntimeError as error:
            self._say(f"the replay service was not placed: {error}")
            return 1
        self.channel = make_channel(run, self.results_dir, server, record=True)
        self.server = server
        # The learner spends the service's start-up on its own imports; it waits for the server.
        learner.args = ["--server", server]
        self._start(learner)
        movable = self._port_movable(attempt)
        if self._wait_for(replay, "address", quiet_exit=runtime.EXIT_PORT_TAKEN if movable else None) is None:
            # A port the launcher picked can be taken by another process between the pick and the service's
            # bind (free_port releases it): pick another, as a user would, instead of failing the run.
            if movable and ended(replay.process) and replay.process.returncode == runtime.EXIT_PORT_TAKEN:
                self._terminate([learner], LEARNER_RESTART_STOP_S)  # it has not connected: nothing to lose
                self._pick_port_again()
                self._say(f"port {run.port} was taken before the replay service could bind it; "
                          f"starting again on port {self.run.port}")
                return self._start_run(replay, learner, progress_factory, start, attempt + 1)
            return 1
        self.channel.report("launcher", self.started)  # the evaluator's clock starts at the launcher's start
        self._say_unreadable_replay(self.channel.read("replay").get("restored", {}))
        self._say(f"replay service up; remote actors join with: python -m actorq_jax.launch.actor --server "
                  f"{self._joins(server)}")
        # Actors and the evaluator need only the service: they build their policies while the learner builds its
        # state and compiles its step, then wait there for its first parameters.
        for i in range(run.num_actors):
            self.workers.append(Worker(f"actor_{i}", "actor", ["--actor_id", str(i), "--server", server],
                                       run.actor_threads))
        self.workers.append(Worker("evaluator", "evaluator", ["--server", server], run.actor_threads))
        for w in self.workers[2:]:
            self._start(w)
        if self._wait_for(learner, "phase") is None:
            return 1
        restored = self.channel.read("learner").get("restored", {})
        if run.resume:
            self._say(f"resumed at learner step {restored.get('learner_steps', 0):,d} with "
                      f"{restored.get('items', 0):,d} replay items")
        self._say_unreadable(restored)
        with progress_factory() as progress:
            return self._watch(replay, learner, progress, start)

    def _wait_for(self, worker: Worker, key: str, quiet_exit: Optional[int] = None,
                  meanwhile: Optional[Callable[[], bool]] = None) -> Optional[Any]:
        """Waits until `worker` (this incarnation) reports `key`; its value, or None if it died or timed out (said,
        unless it exited with `quiet_exit`, which the caller handles). `meanwhile` is called on every poll; when it
        returns False the wait ends with None (it said why)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self._last_pass = time.monotonic()
        while time.monotonic() < deadline and not self.stop.is_set():
            deadline += self._came_back()
            if meanwhile is not None and not meanwhile():
                return None
            status = self.channel.read(worker.role)
            if status.get(key) and status.get("pid") == worker.process.pid:
                return status[key]
            if ended(worker.process):
                if quiet_exit is not None and worker.process.returncode == quiet_exit:
                    return None
                self._say(f"{worker.name} ended before starting ({how_it_ended(worker.process)}):\n"
                          f"{self._log_tail(worker)}")
                return None
            time.sleep(0.2)
        if not self.stop.is_set():
            self._say(f"{worker.name} did not start within {START_TIMEOUT_S:.0f} s:\n{self._log_tail(worker)}")
        return None

    def _watch(self, replay: Worker, learner: Worker, progress: Any, start: float) -> int:
        run = self.run
        last_steps, last_time = 0, time.monotonic()
        rate = 0.0
        seen_steps, seen_at = -1, time.monotonic()
        evals = EvalWatch(self.dir.eval_csv, run.stop_at_return, run.eval_episodes)
        window_watch = ReplayWindowWatch(self.agent_config)
        actors = [w for w in self.workers if w.role == "actor"]
        self._last_pass = time.monotonic()
        while not self.stop.wait(0.25):
            away = self._came_back()
            seen_at += away  # nor is the time without env steps the actors'
            self.cpu.sample(self.workers)
            if ended(replay.process) and not self._restart(replay, run.max_replay_restarts, "address"):
                return 1
            self._watch_service(replay)
            if learner.process.poll() == runtime.EXIT_DIVERGED:
                # Restarting would diverge again from the same checkpoint: the user changes a setting and resumes.
                report = self.channel.read("learner")
                self._say(report.get("message") or f"learner diverged (exit code {runtime.EXIT_DIVERGED})")
                return 1
            # Whether it had ended before its status is read: a learner reports "done", then exits at once.
            learner_ended = ended(learner.process)
            status = self.channel.read("learner")
            self._watch_learner(learner, status)
            if status.get("phase") == "done":
                self._say("learner reached its step budget")
                return 0
            if learner_ended and not self._restart(learner, run.max_learner_restarts, "phase"):
                return 1
            self._tend_actors()
            env_steps = int(self.channel.read("replay").get("env_steps", 0))
            learner_steps = int(status.get("learner_steps", 0))
            elapsed = time.monotonic() - start
            now = time.monotonic()
            if env_steps != seen_steps:
                seen_steps, seen_at = env_steps, now
            elif actors and all(w.gave_up for w in actors) and now - seen_at >= run.server_timeout_s:
                # With every launcher actor gone for good the learner would wait on replay until its budget;
                # remote actors, if any, keep the run going, and one that lost the service is given its whole
                # reconnection window (--server_timeout_s) before the run gives up on it.
                self._say(f"every actor died after its restarts and no env step arrived for {run.server_timeout_s:g} s "
                          f"(--server_timeout_s); "
                          f"stopping the run (everything collected is kept)")
                return 1
            if now - last_time >= 2.0:
                rate = (env_steps - last_steps) / (now - last_time)
                last_steps, last_time = env_steps, now
            evals.poll()
            # The replay table's size: a learner as fast as free-running actors holds it at --min_replay_size.
            items = None if status.get("replay_items") is None else int(status["replay_items"])
            window = f"  replay {items:>9,d}" if items is not None else ""
            narrow = window_watch.update(now, learner_steps, items)
            if narrow:
                self._say(narrow)
            progress.update(
                f"{elapsed:7.0f}s  env steps {env_steps:>9,d} ({rate:7.0f}/s)  learner steps {learner_steps:>7,d}"
                f"{window}  eval return {evals.last_return()}"
            )
            if run.max_env_steps is not None and env_steps >= run.max_env_steps:
                self._say(f"env step budget reached ({env_steps:,d} >= {run.max_env_steps:,d})")
                return 0
            if run.max_learner_steps is not None and learner_steps >= run.max_learner_steps:
                return 0
            if run.max_seconds is not None and elapsed >= run.max_seconds:
                self._say(f"wall-clock budget reached ({elapsed:.0f} s)")
                return 0
            reach = evals.reach
            if reach is not None:
                self._say(f"target return reached: the fp32 policy's evaluation at learner step "
                          f"{reach.learner_steps:,.0f} returned {reach.eval_return:.1f} >= {run.stop_at_return:g} "
                          f"({reach.wall_seconds:.0f} s, {reach.env_steps:,.0f} env steps)")
                return 0
        self._say(f"{STOP_EVENT}; shutting down")
        print("[actorq] the final checkpoint and evaluation follow; interrupt again to stop at once",
              file=self.stream, flush=True)
        return 0

    def _came_back(self) -> float:
        """Starts every silence the watchdogs count again from now when this pass of the watch comes WATCH_AWAY_S
        or more after the one before (said); the time away, else 0."""
        now = time.monotonic()
        away, self._last_pass = now - self._last_pass, now
        if away < WATCH_AWAY_S:
            return 0.0
        self._say(f"the launcher's watch was away for {away:.0f} s (the run stopped and continued, or the launcher "
                  f"starved or busy): the workers' silences count from now")
        for silence in (self._service_silence, self._learner_silence, self._evaluator_silence):
            silence.heard_at = now
        for w in self.workers:
            if w.lease_seen_at is not None:
                w.lease_seen_at = now
        return away

    def _watch_service(self, replay: Worker) -> None:
        """Kills a replay service that is alive but no longer reports (SIGSTOPped, hung): the next pass of the
        watch restarts it from its checkpoint, and its clients reconnect to it."""
        silent = self._hear_service()
        if silent is not None and not ended(replay.process):
            self._say(f"the replay service has not reported for {silent:.0f} s but is alive (stopped or hung); "
                      f"killing it")
            replay.process.kill()
            replay.process.wait()
            self._service_silence = Silence()

    def _hear_service(self) -> Optional[float]:
        """Takes in the replay service's newest report; its silence when past the one allowed, else None."""
        report = self.channel.read("replay")
        now = time.monotonic()
        allowed = max(SERVICE_SILENCE_S, self.run.server_timeout_s / 2)
        if report.get("phase") == "checkpointing":  # its loop is writing the table, which takes time
            allowed += CHECKPOINT_S_PER_ITEM * int(report.get("items", 0))
        key = (report.get("incarnation"), report["beat"]) if report.get("beat") is not None else None
        if self._service_silence.heard(key, allowed, now):
            return None
        return self._service_silence.over(now)

    def _watch_learner(self, learner: Worker, status: Dict[str, Any]) -> None:
        """Kills a learner that is alive but silent past what its last report allowed (SIGSTOPped, hung): the next
        pass of the watch restarts it from its checkpoint."""
        if self._silent_past_allowed(learner, status, self._learner_silence):
            self._learner_silence = Silence()

    def _watch_evaluator(self, evaluator: Optional[Worker]) -> None:
        """Kills an evaluator that is alive but silent past what its last report allowed: the next pass of the
        watch restarts it like a dead one."""
        if evaluator is None or evaluator.gave_up or evaluator.process is None:
            return
        if self._silent_past_allowed(evaluator, self.channel.read("evaluator"), self._evaluator_silence):
            self._evaluator_silence = Silence()

    def _evaluator_killed_silent(self, evaluator: Worker) -> bool:
        """At shutdown: kills an evaluator silent past what its last report allowed; whether it did."""
        self._hear_service()  # the watch loop that hears it has ended
        return self._silent_past_allowed(evaluator, self.channel.read("evaluator"), self._evaluator_silence)

    def _silent_past_allowed(self, worker: Worker, status: Dict[str, Any], silence: Silence) -> bool:
        """Kills `worker` when it is alive but has not reported for longer than its last report allowed; whether it
        did. Its reports count from its own pid on, and only while the service was heard (under Ray they travel
        through it)."""
        now = time.monotonic()
        ours = status.get("pid") == worker.process.pid
        key = (status.get("pid"), status["beat"]) if ours and status.get("beat") is not None else None
        if silence.heard(key, float(status.get("quiet_s", 0.0)), now):
            return False
        if now - self._service_silence.heard_at > SERVICE_HEARD_S:
            silence.heard_at = now  # no report of its could have come: the silence is not its
            return False
        silent = silence.over(now)
        if silent is None or ended(worker.process):
            return False
        self._say(f"the {worker.name} has not reported for {silent:.0f} s but is alive (stopped or hung); killing it")
        worker.process.kill()
        worker.process.wait()
        return True

    def _watch_actor_leases(self, actors: List[Worker]) -> None:
        """Kills an actor that is alive but no longer renews its id lease (SIGSTOPped, or frozen with the GIL held):
        the next pass of the watch restarts it."""
        import reverb

        now = time.monotonic()
        if now - self._leases_read_at < LEASE_READ_EVERY_S:
            return
        self._leases_read_at = now
        try:
            if self._lease_client is None:
                self._lease_client = reverb.Client(self.server)
            leases = read_leases(self._lease_client, timeout_s=2)["leases"]
        except (reverb.DeadlineExceededError, RuntimeError, ConnectionError, KeyError, ValueError):
            self._lease_client = None
            leases = None
        service_heard = leases is not None and now - self._service_silence.heard_at <= SERVICE_HEARD_S
        for w in actors:
            if w.gave_up or ended(w.process):
                continue
            held = service_heard and str(leases.get(int(w.name.rpartition("_")[2]), {}).get("holder", "")
                                         ).endswith(f":{w.process.pid}")
            if held or (not service_heard and w.lease_seen_at is not None):
                w.lease_seen_at = now  # a silent service renews no one's lease: the time is not the actor's
            elif w.lease_seen_at is not None and now - w.lease_seen_at > LEASE_LOST_S:
                self._say(f"{w.name} has not renewed its id lease for {now - w.lease_seen_at:.0f} s but is alive "
                          f"(stopped or frozen); killing it")
                w.process.kill()
                w.process.wait()
                w.lease_seen_at = None

    def _tend_actors(self) -> None:
        """The watch loop's care of the actors and the evaluator: silent ones killed, dead ones restarted."""
        self._watch_actor_leases([w for w in self.workers if w.role == "actor"])
        self._watch_evaluator(next((w for w in self.workers if w.role == "evaluator"), None))
        self._restart_actors()

    def _tend_others_than_the_learner(self) -> bool:
        """The watch loop's care of every worker but the learner; False when the replay service could not be
        restarted (said)."""
        replay = next(w for w in self.workers if w.role == "replay")
        if ended(replay.process) and not self._restart(replay, self.run.max_replay_restarts, "address"):
            return False
        self._watch_service(replay)  # also hears it: the others' watchdogs count a silence only while it is heard
        self._tend_actors()
        return True

    def _restart_actors(self) -> None:
        """Restarts dead actors and the evaluator within their budget; gives up on those past it."""
        run = self.run
        for w in self.workers:
            if w.role not in ("actor", "evaluator") or w.gave_up or not ended(w.process):
                continue
            how = how_it_ended(w.process)
            if w.restarts < run.max_actor_restarts:
                w.restarts += 1
                self._say(f"{w.name} died ({how}); restart {w.restarts}/{run.max_actor_restarts}")
                self._start(w)
            else:
                w.gave_up = True
                self._say(f"{w.name} died ({how}) after {w.restarts} restarts; "
                          f"the run goes on without it:\n{self._log_tail(w)}")

    def _restart(self, worker: Worker, budget: int, ready_key: str) -> bool:
        """Restarts a dead learner or replay service from its last checkpoint; False when the budget is spent or
        it fails."""
        how = how_it_ended(worker.process)
        if worker.restarts >= budget:
            self._say(f"{worker.name} died ({how}) after {worker.restarts} restarts; "
                      f"stopping the run:\n{self._log_tail(worker)}")
            return False
        worker.restarts += 1
        counters = read_counters(self.dir.checkpoints) or {}
        what = (f"replay checkpoint {counters.get('replay_checkpoint')}" if worker.role == "replay"
                else f"the checkpoint at learner step {counters.get('learner_steps', 0)}")
        self._say(f"{worker.name} died ({how}); restart {worker.restarts}/{budget} from {what}"
                  + (f" on port {self.run.port}" if worker.role == "replay" else ""))
        if worker.role == "replay":
            return self._restart_service(worker)
        self._start(worker)
        # A restarted learner restores and compiles for tens of seconds on a loaded machine, and waits for the
        # replay service: the service, the actors and the evaluator stay watched and restarted meanwhile, as in
        # the watch loop.
        if self._wait_for(worker, ready_key, meanwhile=self._tend_others_than_the_learner) is None:
            return self.stop.is_set()  # a stop request during the restart is an ordinary stop
        restored = self.channel.read(worker.role).get("restored", {})
        self._say(f"learner back at step {restored.get('learner_steps', 0)} with {restored.get('items', 0)} "
                  f"replay items in the live table")
        self._say_unreadable(restored)
        return True

    def _say_unreadable_replay(self, restored: Dict[str, Any]) -> None:
        """Says which replay checkpoints the service passed over (kept, renamed) and what it loaded instead."""
        if restored.get("unreadable"):
            instead = (f"replay checkpoint {restored['checkpoint']}" if restored.get("checkpoint")
                       else "an empty replay table")
            self._say(f"replay checkpoint(s) {', '.join(restored['unreadable'])} could not be read and are kept as "
                      f"replay_checkpoints/<name>.unreadable ({self.dir.log('replay')} says why); the service "
                      f"started from {instead}")

    def _say_unreadable(self, restored: Dict[str, Any]) -> None:
        """Says which newer learner checkpoints a restore passed over (they are kept, renamed)."""
        if restored.get("unreadable"):
            steps = restored["unreadable"]
            named = (f"checkpoint at step {steps[0]} could not be read and is" if len(steps) == 1 else
                     f"checkpoints at steps {', '.join(map(str, steps))} could not be read and are")
            self._say(f"the learner {named} kept as checkpoints/<step>.unreadable ({self.dir.log('learner')} says why); "
                      f"the learner went on from step {restored.get('learner_steps', 0)}")

    def _restart_service(self, replay: Worker) -> bool:
        """Starts the replay service again from its checkpoint; the other workers follow it if its address changed."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._start(replay)
            try:
                address = self.placement.service_address(self.run.port)
            except RuntimeError as error:
                self._say(f"the restarted replay service was not placed: {error}")
                return False
            if address != self.server:  # its reports come through its own server under Ray
                self.channel = make_channel(self.run, self.results_dir, address, record=True)
            movable = self._port_movable(attempt)
            if self._wait_for(replay, "address", quiet_exit=runtime.EXIT_PORT_TAKEN if movable else None) is not None:
                break
            if self.stop.is_set():
                return True  # a stop request during the restart is an ordinary stop
            if not (movable and replay.process.returncode == runtime.EXIT_PORT_TAKEN):
                return False
            taken = self._pick_port_again()
            self._say(f"port {taken} was taken while the replay service restarted; starting it on port {self.run.port}")
        restored = self.channel.read("replay").get("restored", {})
        self._say(f"replay service back on port {self.run.port} with {restored.get('items', 0)} replay items")
        self._say_unreadable_replay(restored)
        return address == self.server or self._follow_service(address)

    def _port_movable(self, attempt: int) -> bool:
        """Whether the service's port may be picked again after `attempt` starts found it taken."""
        # Only a port the launcher picked is its to change: remote actors look for the one a user gave.
        return self.port_chosen and attempt < PORT_ATTEMPTS

    def _pick_port_again(self) -> int:
        """Gives the service a new free port (recorded in config.json); returns the old one."""
        taken = self.run.port
        self.run = dataclasses.replace(self.run, port=runtime.free_port())
        save_config(self.dir.config, self.run, self.agent_config)
        return taken

    def _joins(self, server: str) -> str:
        """The --server a remote actor gives to reach the service at `server`."""
        if self.run.launcher != "local":
            return server
        # The run's own processes use the loopback; another machine needs a name or address of this one.
        port = server.rpartition(":")[2]
        return (f"{self.run.advertise_host}:{port}" if self.run.advertise_host
                else f"THIS_HOST:{port} (this machine's address)")

    def _follow_service(self, address: str) -> bool:
        """Restarts the learner (from its last checkpoint), actors and evaluator at the service's new address."""
        self._say(f"the replay service moved from {self.server} to {address}: restarting the learner (from its last "
                  f"checkpoint), the actors and the evaluator there; remote actors started by hand must be "
                  f"started again with --server {self._joins(address)}")
        self.server = address
        self._lease_client = None
        followers = [w for w in self.workers if w.role != "replay" and not w.gave_up]
        self.cpu.sample(followers)
        for w in followers:
            # Killed, not stopped: an orderly stop would spend its timeout on a final checkpoint or flush to an
            # address nothing listens at. The learner's last checkpoint is the one the service restored.
            if w.process is not None and not ended(w.process):
                w.process.kill()
                w.process.wait()
        for w in followers:
            w.args = _with_server(w.args, address)
            w.moves += 1
        learner = next(w for w in followers if w.role == "learner")
        self._start(learner)
        if self._wait_for(learner, "phase") is None:
            return self.stop.is_set()
        restored = self.channel.read("learner").get("restored", {})
        self._say(f"learner back at step {restored.get('learner_steps', 0)} at {address}")
        for w in followers:
            if w is not learner:
                self._start(w)
        return True

    def _shutdown(self, replay: Worker, learner: Worker) -> None:
        evaluators = [w for w in self.workers if w.role == "evaluator"]
        self._terminate(evaluators, 0)  # its final evaluation waits for the learner's last publication anyway
        self._terminate([w for w in self.workers if w.role == "actor"], ACTOR_STOP_TIMEOUT_S)
        # The learner's final checkpoint and publication go through the service, which is still up. A learner
        # that reported "done" is exiting on its own: a signal now could land in its interpreter's teardown.
        if self.channel.read("learner").get("phase") == "done" and learner.process is not None:
            self._wait_ended(learner.process, time.monotonic() + LEARNER_FINAL_TIMEOUT_S)
        self._terminate([learner], LEARNER_FINAL_TIMEOUT_S)
        self.channel.read("learner")  # its final report (recorded into status/ under Ray)
        # The evaluator's final evaluation waits for the learner's last publication; one that ended without
        # making it (diverged, failed, gave up) will not, and the evaluator need not wait out its timeout.
        self.channel.report("launcher", {**self.started, "learner_ended": True})
        # Its final evaluation gets up to EVALUATOR_FINAL_TIMEOUT_S while it reports; a silent one is not waited for.
        self._terminate(evaluators, EVALUATOR_FINAL_TIMEOUT_S, killed_silent=self._evaluator_killed_silent)
        # What the workers sent through the service (rows, the final checkpoint) comes in while it is up.
        self.placement.collect()
        self._terminate([replay], ACTOR_STOP_TIMEOUT_S)

    # -- results --------------------------------------------------------------------

    def _counters(self, exit_code: int) -> Dict[str, Any]:
        """learner_steps and env_steps for the summary, and where they come from.

        A clean run's final status report is written after its final checkpoint and is
        exact. After a failure the last report may be up to a second old (or from before
        a restart), so the figures are the last checkpoint's, which is on disk; the
        report's own figures are kept apart, labelled.
        """
        status = self.record.read("learner")
        reported = {k: status.get(k, 0) for k in ("learner_steps", "env_steps", "wall_seconds")}
        if exit_code == 0 and status.get("phase") == "done":
            return {"learner_steps": int(reported["learner_steps"]), "env_steps": int(reported["env_steps"]),
                    "counters_from": "final status report"}
        checkpoint = read_counters(self.dir.checkpoints) or {}
        return {
            "learner_steps": int(checkpoint.get("learner_steps", 0)),
            "env_steps": int(checkpoint.get("env_steps", 0)),
            "counters_from": (f"checkpoint at learner step {checkpoint['learner_steps']}" if checkpoint
                              else "no checkpoint (nothing provable: 0)"),
            "last_status_report": reported,  # figures from the last status report, not provable
        }

    def _summarise(self, wall_seconds: float, energy: Dict[str, float], exit_code: int) -> Dict[str, Any]:
        import pandas as pd

        from actorq_jax.analysis.aggregate import final_and_best_returns
        from actorq_jax.telemetry import ACTOR_PHASES
        from actorq_jax.telemetry.machine import cpu_id, cpu_model
        from actorq_jax.telemetry.schema import CPU_CLOCK

        counters = self._counters(exit_code)
        env_steps = counters["env_steps"]
        eval_path = self.dir.eval_csv  # the same aggregation as the analysis tools (no evaluation: NaN)
        evals = pd.read_csv(eval_path) if eval_path.exists() and eval_path.stat().st_size else pd.DataFrame()
        summary: Dict[str, Any] = {
            "agent": self.run.agent,
            "task": self.run.task,
            "seed": self.run.seed,
            "actor_bits": self.run.actor_bits,
            "comm_bits": self.run.wire_bits,
            "num_actors": self.run.num_actors,
            **counters,
            "wall_seconds": wall_seconds,
            "env_steps_per_second": env_steps / wall_seconds if wall_seconds > 0 else 0.0,
            "energy_kwh": energy.get("energy_kwh", math.nan),
            "emissions_kg": energy.get("emissions_kg", math.nan),
            "exit_code": exit_code,
            "launcher": self.placement.name,
            "energy_nodes": int(energy.get("energy_nodes", 1)),
            "events": self.events,
            "cpu_clock": CPU_CLOCK,  # what the CPU columns of the actor CSVs and learner.csv measured
            # The launcher's machine (under Ray, the driver's; its workers' nodes are in the events).
            "machine": {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count()},
        }
        for policy, suffix in (("fp32", ""), ("actor", "_actor_policy")):
            final, best = final_and_best_returns(evals, policy)
            summary[f"final_eval_return{suffix}"] = final
            summary[f"best_eval_return{suffix}"] = best
        totals = {phase: 0.0 for phase in ACTOR_PHASES}
        cpu = {phase: 0.0 for phase in ACTOR_PHASES}
        episodes, backends = 0, set()
        for path in self.dir.actor_csvs():
            for row in _read_rows(path):
                episodes += 1
                if row.get("policy_backend"):
                    backends.add(str(row["policy_backend"]))
                for phase in ACTOR_PHASES:
                    totals[phase] += float(row.get(f"{phase}_s") or 0.0)
                    cpu[phase] += float(row.get(f"{phase}_cpu_s") or 0.0)
        summary["actor_episodes"] = episodes
        summary["actor_policy_backends"] = sorted(backends)  # what computed the actors' policies (the int8 kernel path)
        summary["actor_time_s"] = totals
        summary["actor_cpu_time_s"] = cpu  # beside the wall time: what the actors' threads computed
        summary["worker_cpu_s"] = self.cpu.by_worker()  # each process's CPU, the replay service's included
        if self.run.launcher == "local":  # the cores each worker could use: which of them shared a core
            every = sorted(os.sched_getaffinity(0))
            summary["worker_cores"] = {w.name: list(runtime.role_cpus(w.role, self.run)) or every for w in self.workers}
        for role in ("learner", "replay"):
            summary[f"{role}_restarts"] = next((w.restarts for w in self.workers if w.role == role), 0)
        return summary


class ReplayWindowWatch:
    """Says once when a run of the `min_size` regime holds its replay table at --min_replay_size while it learns.

    There an item leaves after its --max_times_sampled-th sample; a learner as fast as the actors samples each
    new item that often as soon as it arrives, so the table stays at its floor and every batch comes from the
    newest --min_replay_size transitions, a window a D4PG policy was seen to collapse on (RESULTS.md, "The
    free-running regime's replay window"). Nothing else in the run shows it: the losses stay finite.
    """

    def __init__(self, agent_config: Any, hold_s: float = NARROW_WINDOW_HOLD_S):
        floor = int(agent_config.min_replay_size)
        self.times = int(agent_config.max_times_sampled)
        # At its floor the table's size moves by a batch's removals and an episode's inserts; a tenth of the
        # floor (at least a batch) above it still counts as held there.
        self.margin = max(int(agent_config.batch_size), floor // 10)
        # Watched in the min_size regime only, and not with a floor at the table's capacity: the window is then the
        # whole table the user asked for.
        watched = agent_config.rate_limiter == "min_size" and floor + self.margin < int(agent_config.max_replay_size)
        self.floor: Optional[int] = floor if watched else None
        self.hold_s = hold_s
        self._since: Optional[float] = None
        self._steps_since = 0
        self.said = False

    def update(self, now: float, learner_steps: int, items: Optional[int]) -> Optional[str]:
        """Takes one reading (monotonic seconds, the learner's steps, the table's size); the warning the first time
        the table has sat at its floor for `hold_s` while the learner stepped, else None."""
        if self.floor is None or self.said or items is None:
            return None
        if learner_steps <= 0 or items > self.floor + self.margin:
            self._since = None  # filling before the first step, or a window wider than the floor
            return None
        if self._since is None:
            self._since, self._steps_since = now, learner_steps
            return None
        # A learner that stopped stepping (actors gone, the limiter holding it) is not drawing from that window.
        if now - self._since < self.hold_s or learner_steps <= self._steps_since:
            return None
        self.said = True
        return (f"{NARROW_WINDOW_EVENT} {self.floor:,d} items (--min_replay_size) for {now - self._since:.0f} s "
                f"while the learner stepped: with --rate_limiter min_size each item leaves after its {self.times} "
                f"samples (--max_times_sampled), which this learner takes as soon as the item arrives, so every batch "
                f"comes from the newest {self.floor:,d} transitions; a policy can collapse on so narrow a window. A "
                f"larger --min_replay_size widens it (the demo uses 10000), a slower learner or more actors too")


class EvalWatch:
    """The run's fp32 evaluations as eval.csv grows, reading only its new rows: the last return for the progress
    line, and the first complete evaluation whose mean return reaches `--stop_at_return`."""

    def __init__(self, path: Path, target: Optional[float], episodes: int):
        from actorq_jax.telemetry.tensorboard import CsvFollower

        self.path = path
        self.target = target
        self.episodes = episodes
        self.reach: Optional[Any] = None  # the TargetReach once an evaluation reached the target
        self._follower = CsvFollower(path)
        self._fp32: List[Dict[str, Any]] = []

    def poll(self) -> None:
        """Takes in the rows evaluated since the last poll."""
        rows = self._follower.new_rows()
        if self._follower.rewritten:  # a restored learner's evaluations replaced the lost timeline's: from the start
            self._fp32 = []
        fresh = [r for r in rows if r.get("policy") == "fp32"]
        if not fresh:
            return
        self._fp32.extend(fresh)
        if self.target is not None and self.reach is None:
            import pandas as pd

            from actorq_jax.analysis.aggregate import time_to_target

            frame = pd.DataFrame(self._fp32)
            # An evaluation whose rows are still being written is not judged on its first episodes alone.
            rows = frame.groupby(["learner_steps", "final"])["return"].transform("size")
            reach = time_to_target(frame[rows >= self.episodes], self.target)
            self.reach = reach if reach.reached else None

    def last_return(self) -> str:
        """The last fp32 evaluation episode's return, for the progress line ("-" before the first)."""
        return f"{float(self._fp32[-1]['return']):.1f}" if self._fp32 else "-"


def _with_server(args: List[str], address: str) -> List[str]:
    """Worker flags `args` with --server set to `address`."""
    flags = list(args)
    if "--server" in flags:
        flags[flags.index("--server") + 1] = address
    else:
        flags += ["--server", address]
    return flags


def _read_rows(path: Path) -> List[Dict[str, Any]]:
    """Rows of a CSV, numbers parsed ([] when the file does not exist yet)."""
    from actorq_jax.telemetry import read_csv

    try:
        return read_csv(path)
    except FileNotFoundError:
        return []


def make_placement(run: Any, results_dir: Path) -> Placement:
    """The placement `run.launcher` names (local unless --launcher ray)."""
    if run.launcher == "ray":
        from actorq_jax.launch.ray_placement import RayPlacement

        return RayPlacement(run, results_dir)
    if run.launcher != "local":
        raise ValueError(f"--launcher: {run.launcher!r} not in {runtime.LAUNCHERS}")
    return LocalPlacement(run, results_dir)


def launch(run: RunConfig, agent_config: Any, stream: TextIO = sys.stderr) -> Dict[str, Any]:
    """Runs one experiment and returns its summary."""
    return Launcher(run, agent_config, stream).launch()


def _import_summary_modules() -> None:
    """Imports what the run's closing summary needs when the run starts: a checkout that changes under a
    long run (a pull, an edit) then cannot break the summary the run ends with."""
    for name in ("pandas", "actorq_jax.analysis.aggregate", "actorq_jax.telemetry.schema"):
        importlib.import_module(name)


def run_experiment(agent: str, argv: Optional[List[str]], description: Optional[str] = None) -> int:
    """Entry point of the run scripts: parses flags, runs, prints the summary; returns the exit code."""
    from actorq_jax.launch.flags import parse_run
    from actorq_jax.run_dir import ResultsDirInUse, claimed

    run, agent_config = parse_run(agent, argv, description=description)
    flag = "--resume" if run.resume else "--results_dir"
    Path(run.results_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        try:
            # One launcher per results directory: a second one (a --resume of a run still going, two new runs
            # given one directory) would rewrite the first's config, status and files under it.
            held.enter_context(claimed(run.results_dir))
        except ResultsDirInUse as error:
            print(f"{Path(sys.argv[0]).name}: error: {flag}: {error}", file=sys.stderr)
            return 2
        if not run.resume and RunDir(run.results_dir).config.exists():  # a run started there since the flags' check
            print(f"{Path(sys.argv[0]).name}: error: {flag}: {run.results_dir} already holds a run; pick another "
                  f"or use --resume {run.results_dir}", file=sys.stderr)
            return 2
        summary = launch(run, agent_config)
    out = QuietWhenGone(sys.stdout)  # summary.json holds the same
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2), file=out, flush=True)
    print(f"results: {run.results_dir}", file=out, flush=True)
    return int(summary["exit_code"])
