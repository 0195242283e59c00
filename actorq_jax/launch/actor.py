"""The actor process: runs a quantized policy in an environment and writes the agent's replay items.

An actor steps --envs_per_actor environments in lockstep (one batched policy call
per step, one adder stream per environment, made by the agent's builder; see launch/vector_env.py).

Remote actors join a running run from another machine:

    python -m actorq_jax.launch.actor --server HOST:PORT --actor_id 7 --log_dir ./remote_logs

The configuration (task, agent, bits...) is read from the run's replay service, so a
remote actor always runs the same experiment as the local ones. Its episode rows go
to its --log_dir and, through the replay service, to the run's results directory
(launch/actor_rows.py); its id must not be one of the launcher's actors (0..N-1).

No actor call blocks for long on the replay service: writes wait at most WRITE_TIMEOUT_S
before the actor asks whether the server still answers (a busy learner's rate
limiter holds writes legitimately; then the actor keeps waiting). A server that
does not answer (killed, or stopped without dying) is retried until it has been
gone for `server_timeout_s`; a service that answers again on the same address
(the launcher restarts it, or the stopped process goes on) gets its actors back,
which abandon the episode in progress. Past the timeout the actor
says so in one line and exits with EXIT_SERVER_GONE; every finished episode is
already in its CSV. A main loop stuck anywhere else (a call that never returns) is
caught by the id lease: without the loop's beats for --actor_hang_s it gives the id
back and ends the process with runtime.EXIT_HUNG (launch/leases.py).
"""

import argparse
import collections
import dataclasses
import json
import logging
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional

from actorq_jax.launch import runtime, vector_env
from actorq_jax.run_dir import RunDir

if TYPE_CHECKING:  # numpy and Reverb load after the thread budget is set (runtime.apply_thread_env)
    from actorq_jax.launch.actor_rows import RowForwarder

log = logging.getLogger(__name__)

FIRST_VARIABLES_TIMEOUT_S = 120.0
WRITE_TIMEOUT_S = 2.0
# While the limiter holds an actor's items it waits in slices this long, so a stop is noticed within one.
WAIT_SLICE_S = 0.5
# A stopping actor's last flush: at the end of a run the limiter holds inserts for good (the learner is done),
# so waiting the full WRITE_TIMEOUT_S only delays the shutdown.
STOP_FLUSH_S = 0.5
PROBE_EVERY_S = 0.5
EXIT_SERVER_GONE = 3
EXIT_ID_TAKEN = 2
# How long an exiting remote actor waits for the service to acknowledge its last rows.
ACK_WAIT_S = 15.0
DEFAULT_SERVER_TIMEOUT_S = 60.0


class ServerGone(RuntimeError):
    """The replay service stayed unreachable for longer than the actor's server timeout."""


class Link:
    """The actor's view of the replay service: is it there, and how long has it been gone."""

    def __init__(self, address: str, timeout_s: float, stop: threading.Event, version: Callable[[], Any],
                 beat: Callable[[], None] = lambda: None):
        self.address = address
        self.timeout_s = timeout_s
        self.stop = stop
        self.version = version
        self.beat = beat  # waiting for the service is progress, not a hang (leases.IdLease.beat)
        self.outages = 0

    def reachable(self) -> bool:
        """Whether the server answers within a second (through a fresh client: no stale channel)."""
        import reverb

        try:
            reverb.Client(self.address).server_info(timeout=1)
            return True
        except (reverb.DeadlineExceededError, RuntimeError):
            return False

    def wait(self, since: Optional[float] = None) -> bool:
        """Blocks until the server answers (True) or stop is set (False); ServerGone once it has been
        silent for timeout_s since `since` (default: now)."""
        since = time.monotonic() if since is None else since
        counted = False
        while not self.stop.is_set():
            self.beat()
            if self.reachable():
                return True
            if not counted:
                self.outages += 1
                counted = True
                log.warning("replay service at %s does not answer; retrying for up to %g s", self.address, self.timeout_s)
            gone = time.monotonic() - since
            if gone > self.timeout_s:
                raise ServerGone(
                    f"replay service at {self.address} unreachable for {gone:.0f} s (server_timeout_s {self.timeout_s:g}); "
                    f"last params version {self.version()}; exiting")
            self.stop.wait(PROBE_EVERY_S)
        return False


class Actor:
    """One actor: its K environments (--envs_per_actor), jitted batched policy, K adders and variable client.

    Each actor step is one policy call on the K observations, K environment steps and K adder writes;
    environment k has its own adder stream, and its episodes end and restart on their own.
    """

    def __init__(self, run: Any, agent_config: Any, actor_id: int, address: str, stop: threading.Event,
                 restart: int = 0, server_timeout_s: Optional[float] = None):
        from actorq_jax.environments import environment_spec
        from actorq_jax.launch.precision import ActorPrecision, describe_backend, make_param_loader, resolve_backend
        from actorq_jax.quantization import QuantConfig, quantized_shapes
        from actorq_jax.telemetry import PhaseTimer

        self.run, self.agent_config, self.actor_id, self.address, self.stop = run, agent_config, actor_id, address, stop
        envs_per_actor = int(getattr(run, "envs_per_actor", 1))
        self.envs = vector_env.VectorEnv(run.task, vector_env.env_seeds(run.seed, actor_id, restart, envs_per_actor))
        self.spec = environment_spec(self.envs.envs[0])
        self.builder = runtime.make_builder(run.agent, agent_config, self.spec)
        self.act = vector_env.make_vector_act(
            self.builder.vector_behaviour_policy(actor_id, run.num_actors, envs_per_actor))
        self.feedback = self.builder.priority_feedback()  # None: items enter at the adder's own priority
        precision = ActorPrecision(run.actor_bits, run.wire_bits, run.granularity, run.actor_backend, run.int8_mode)
        backend = resolve_backend(precision)
        self.backend = describe_backend(precision, backend)  # written into every episode row
        if backend == "int8":
            from actorq_jax import kernels

            kernels.set_num_threads(max(1, run.actor_threads))
            log.info("%s", kernels.describe_kernel())
        self.load_fn = make_param_loader(precision)
        self.like = quantized_shapes(self.builder.params_template(),
                                     QuantConfig(bits=run.wire_bits, granularity=run.granularity))
        if server_timeout_s is None:
            server_timeout_s = run.server_timeout_s
        # The main loop's progress, told to the id lease by run_actor (a hung loop gives the id back: leases.py).
        self.beat: Callable[[], None] = lambda: None
        self.link = Link(address, server_timeout_s, stop, lambda: self.variables.version if self.variables else None,
                         beat=lambda: self.beat())
        self.timer = PhaseTimer()
        self.variables: Any = None
        self.adders: List[Any] = []
        self.needs_start = True  # every environment must start an episode before the next step
        self._ready: Deque[Dict[str, Any]] = collections.deque()  # rows of finished episodes run_episode has not returned
        self.steps = 0  # actor steps: each steps every environment once (and is each one's step count)
        self.total_steps = self.episodes = self.abandoned = self._timings_seen = 0
        # This process's token: a row's identity is (actor_id, incarnation, episode), unique across restarts.
        # (A letter first: a CSV reader must never take it for a number.)
        self.incarnation = "i" + secrets.token_hex(6)
        self.start = time.monotonic()

    # -- connection ---------------------------------------------------------------

    def connect(self) -> bool:
        """Joins the server and waits for the first parameters; False when stopped first."""
        from actorq_jax.replay import VariableClient

        if not self.link.wait():
            return False
        self.variables = VariableClient(self.address, runtime.VARIABLES_TABLE, update_period=self.run.update_period,
                                        like=self.like, load_fn=self.load_fn, raise_errors=False)
        try:
            # A stop while the learner is still starting (or failed to start) ends the wait at once.
            if self.variables.wait_for_first(FIRST_VARIABLES_TIMEOUT_S, stopped=self.stop.is_set) is None:
                return False
        except TimeoutError:
            if self.link.wait():  # the server is up but publishes nothing: a clear error, not a hang
                raise
            return False
        self._compile_policy()
        self.adders = [self._new_adder() for _ in range(len(self.envs))]
        return True

    def _compile_policy(self) -> None:
        """Compiles the batched policy for the parameters just fetched, on zero observations of the real shape."""
        import jax
        import numpy as np

        # Before run_actor takes the id lease: its watchdog (--actor_hang_s) would count a first call's compile,
        # seconds on a loaded machine, as a main loop that made no progress. Pure: no key, step or env advances.
        observations = np.zeros((len(self.envs), self.spec.observation_dim), np.float32)
        jax.block_until_ready(self.act(self.variables.params, self.envs.keys, self.steps, observations))

    def _new_adder(self) -> Any:
        import reverb

        return self.builder.make_adder(reverb.Client(self.address), timeout_s=min(WRITE_TIMEOUT_S, self.link.timeout_s),
                                       connect_timeout_s=self.link.timeout_s)

    def _write(self, k: int, call: Callable[[Any], None]) -> bool:
        """Runs one call on environment k's adder; False when the episodes had to be abandoned (the server
        restarted)."""
        from actorq_jax.replay import WriteTimeout

        try:
            call(self.adders[k])
            return True
        except WriteTimeout:
            return self._recover(self.adders[k], wait_for_writes=True)
        except (RuntimeError, ConnectionError) as error:  # a broken writer stream: start over
            log.warning("replay write to %s failed: %s", self.address, error)
            return self._recover(self.adders[k], wait_for_writes=False)

    def _recover(self, adder: Any, wait_for_writes: bool) -> bool:
        """Waits out a busy server, or reconnects to one that went away (abandoning every environment's episode)."""
        from actorq_jax.replay import WriteTimeout

        outages = self.link.outages
        # The server has not confirmed anything since the write that timed out began.
        silent_since = time.monotonic() - ((adder.timeout_s or 0.0) if wait_for_writes else 0.0)
        while wait_for_writes and not self.stop.is_set() and self.link.reachable():
            self.beat()  # a wait, not a hang
            try:
                adder.wait(WAIT_SLICE_S)  # the rate limiter holds our items: the learner is busy, not gone
                return True
            except WriteTimeout:
                silent_since = time.monotonic() - WAIT_SLICE_S
        if not self.link.wait(since=silent_since):
            return False  # stopped while waiting
        if wait_for_writes and self._confirmed(adder):
            # It answers and took the items written before it went quiet: the stream held, so the episodes go on.
            # A service that checkpoints a large table stops answering for seconds. A restarted one may land here
            # too (if Reverb's writer re-sent the items to it), and its variables table may count inserts from an
            # older figure: the variable client starts afresh either way.
            log.info("replay service at %s answers again and took our items; going on (params version %s)",
                     self.address, self.variables.version)
            self.variables.reconnect()
            return True
        if self.link.outages > outages:
            log.info("replay service at %s answers again; reconnecting (params version %s)", self.address,
                     self.variables.version)
        self._close_adders()
        self.variables.reconnect()
        self.adders = [self._new_adder() for _ in range(len(self.envs))]
        self.abandoned += 1
        return False

    def _confirmed(self, adder: Any) -> bool:
        """Whether the server confirms `adder`'s items in flight within a wait slice."""
        from actorq_jax.replay import WriteTimeout

        try:
            adder.wait(WAIT_SLICE_S)
            return True
        except (WriteTimeout, RuntimeError, ConnectionError) as error:
            log.info("items in flight to %s not confirmed after it answered again: %s", self.address, error)
            return False

    def _close_adders(self, flush: bool = True) -> None:
        from actorq_jax.replay import WriteTimeout

        timeout_s = STOP_FLUSH_S if self.stop.is_set() else None
        for adder in self.adders:
            try:
                adder.close(flush=flush, timeout_s=timeout_s)
            except (WriteTimeout, RuntimeError) as error:
                if self.stop.is_set():
                    # The usual end of a run: the learner samples no more, so the rate limiter keeps the last
                    # items out of the table for good, and nobody would train on them.
                    log.info("stopping: the last items for %s stay out of its table (its rate limiter holds them "
                             "once the learner samples no more): %s", self.address, error)
                else:
                    log.warning("dropped items that %s did not confirm: %s", self.address, error)
                flush = False  # the server did not take one adder's items: do not wait K times for it

    # -- acting -------------------------------------------------------------------

    def run_episode(self) -> Optional[Dict[str, Any]]:
        """Acts until one of the environments finishes an episode; its CSV row, or None when stopped or abandoned."""
        while not self._ready:
            self.beat()
            if self.stop.is_set() or (self.needs_start and not self.start_episodes()):
                return None
            self._ready.extend(self.step())
            if self.needs_start and not self._ready:
                return None  # the episodes were abandoned
        return self._ready.popleft()

    def start_episodes(self) -> bool:
        """Starts an episode in every environment; False when stopped or abandoned (call again)."""
        self.needs_start = not all(self._start_episode(k) for k in range(len(self.envs)))
        return not self.needs_start

    def _start_episode(self, k: int) -> bool:
        with self.timer.phase("env_step"):
            timestep = self.envs.reset(k)
        with self.timer.phase("adder"):
            return self._write(k, lambda a: a.add_first(timestep))

    def step(self) -> List[Dict[str, Any]]:
        """One actor step (one batched inference, K env steps, K adder writes); the CSV rows of the episodes it
        finished. When it had to abandon the episodes (stopped, or the server restarted) it sets needs_start."""
        import numpy as np

        with self.timer.phase("inference"):
            actions = np.asarray(self.act(self.variables.params, self.envs.keys, self.steps, self.envs.observations()))
        with self.timer.phase("env_step"):
            timesteps = self.envs.step(actions)
        with self.timer.phase("adder"):
            waited = sum(a.wait_s for a in self.adders)
            # Prioritized replay: new items enter where the learner's published feedback says.
            priority = self.feedback.insertion_priority(self.variables.meta) if self.feedback else None
            written = all(self._write(k, lambda a: a.add(actions[k], timesteps[k], priority))  # noqa: B023
                          for k in range(len(self.envs)))
            # A reconnect replaces the adders (their waits start again at 0): count no negative wait.
            self.timer.add("rate_limit_wait", max(0.0, sum(a.wait_s for a in self.adders) - waited))
        if not written:
            self.needs_start = True
            return []
        self.variables.update(steps=len(self.envs))  # update_period counts env steps
        self.steps += 1
        self.total_steps += len(self.envs)
        rows = []
        for finished in self.envs.finished():
            self.episodes += 1
            rows.append(self._row(finished))
            if not self._start_episode(finished.env_index):
                self.needs_start = True
                break
        return rows

    def _row(self, finished: "vector_env.Finished") -> Dict[str, Any]:
        from actorq_jax.telemetry import ACTOR_PHASES

        timings = self.variables.timings
        for t in timings[self._timings_seen:]:
            self.timer.add("pull", t.pull_s, cpu_seconds=t.pull_cpu_s)
            self.timer.add("deserialize", t.deserialize_s, cpu_seconds=t.deserialize_cpu_s)
            self.timer.add("load", t.load_s, cpu_seconds=t.load_cpu_s)
        self._timings_seen = len(timings)
        totals, cpu = self.timer.totals(), self.timer.cpu_totals()
        self.timer.reset()
        # The adder phase timed the whole call; its blocked part is reported as rate_limit_wait.
        totals["adder"] = max(0.0, totals.get("adder", 0.0) - totals.get("rate_limit_wait", 0.0))
        return {
            "actor_id": self.actor_id,
            "incarnation": self.incarnation,
            "episode": self.episodes,
            "env_index": finished.env_index,
            "env_steps": self.total_steps,
            "episode_return": finished.episode_return,
            "episode_length": finished.episode_length,
            "wall_seconds": round(time.monotonic() - self.start, 3),
            "params_version": self.variables.version,
            "rejected_payloads": self.variables.rejected,
            "policy_backend": self.backend,
            **{f"{phase}_s": round(totals.get(phase, 0.0), 6) for phase in ACTOR_PHASES},
            **{f"{phase}_cpu_s": round(cpu.get(phase, 0.0), 6) for phase in ACTOR_PHASES},
        }

    def close(self, server_gone: bool = False) -> None:
        """Stops the variable client and flushes the adder (bounded; not at all when the server is gone)."""
        if self.variables is not None:
            self.variables.stop(timeout_s=0.5 if server_gone else None)
        self._close_adders(flush=not server_gone)


def run_actor(
    run: Any,
    agent_config: Any,
    actor_id: int,
    address: str,
    stop: threading.Event,
    log_dir: Path,
    restart: int = 0,
    max_episodes: Optional[int] = None,
    server_timeout_s: Optional[float] = None,
    forwarder: Optional["RowForwarder"] = None,
    takeover_id: bool = False,
) -> int:
    """Actor main loop: lease the id, act, write replay items, log each episode (and send it with `forwarder`);
    0, EXIT_ID_TAKEN when another actor holds the id, or EXIT_SERVER_GONE when the replay service left.

    `takeover_id`: the launcher's own actors take their slot's lease over (a restart replaces a dead holder).
    """
    from actorq_jax.launch.leases import IdLease, IdTaken
    from actorq_jax.telemetry import ACTOR_FIELDS
    from actorq_jax.telemetry.csv_logger import open_run_csv

    actor = Actor(run, agent_config, actor_id, address, stop, restart, server_timeout_s)
    lease = IdLease(address, actor_id, takeover=takeover_id, hang_s=run.actor_hang_s)
    actor.beat = lease.beat
    csv_path = Path(log_dir) / RunDir.actor_file(actor_id)
    logger = None
    gone: Optional[ServerGone] = None
    try:
        if not actor.connect():
            return 0
        try:
            lease.acquire(timeout_s=actor.link.timeout_s)
        except IdTaken as error:
            log.error("%s", error)  # the one line that says why this actor stops
            return EXIT_ID_TAKEN
        except TimeoutError as error:
            raise ServerGone(str(error)) from None
        # Opened only under the lease: opening trims a partial last line (or starts the file), which would cut
        # into the rows of the actor that holds the id when a refused twin shares its log directory.
        # One row per episode, flushed at once: a killed actor loses no finished episode.
        logger = open_run_csv(csv_path, ACTOR_FIELDS, flush_every_s=0)
        written = 0
        while not stop.is_set() and (max_episodes is None or written < max_episodes):
            row = actor.run_episode()
            if row is not None:
                logger.write(row)
                if forwarder is not None:
                    forwarder.send(row)
                written += 1
        return 0
    except ServerGone as error:
        gone = error
        log.error("%s", gone)  # the one line that says why this actor stops
        return EXIT_SERVER_GONE
    finally:
        lease.release(tell_server=gone is None)
        if logger is not None:
            logger.close()
        actor.close(server_gone=gone is not None)
        if forwarder is not None and (gone is not None or not forwarder.wait_acknowledged(ACK_WAIT_S)):
            log.warning("%d episode rows did not reach the run's results directory; %s has them all",
                        forwarder.unsent, csv_path)


def fetch_config(address: str, timeout_s: float) -> str:
    """config.json text published on the run's replay service; TimeoutError or ValueError saying what is wrong."""
    import reverb

    from actorq_jax.launch.config import config_from_json
    from actorq_jax.replay import wait_for_server
    from actorq_jax.replay.messages import sample_one

    client = wait_for_server(address, timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while client.server_info(timeout=max(1, int(timeout_s)))[runtime.CONFIG_TABLE].current_size == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replay service at {address} published no configuration within {timeout_s:g} s")
        time.sleep(PROBE_EVERY_S)
    try:
        sample = sample_one(client, runtime.CONFIG_TABLE, max(1.0, timeout_s))
    except reverb.DeadlineExceededError:
        raise TimeoutError(f"the replay service at {address} did not hand out its configuration within "
                           f"{max(1.0, timeout_s):g} s") from None
    try:
        text = bytes(sample.data[0].astype("uint8")).decode()
        config_from_json(text)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"the config table on {address} holds a malformed row ({type(error).__name__}: {error})") from None
    return text


def main(argv: Optional[list] = None) -> int:
    """Entry point of a (possibly remote) actor joining a running run."""
    parser = argparse.ArgumentParser(description="Join a running ActorQ run as one more actor.")
    parser.add_argument("--server", required=True, help="the run's replay service, HOST:PORT (printed by the launcher)")
    parser.add_argument("--actor_id", type=int, default=100, help="id used in logs and for seeding (default 100)")
    parser.add_argument("--log_dir", default="remote_actor_logs", help="where this actor writes actor_<id>.csv")
    parser.add_argument("--threads", type=int, default=1, help="XLA/intra-op threads of this actor (default 1)")
    parser.add_argument("--envs_per_actor", type=int, default=None,
                        help="environments this actor steps in lockstep (default: the run's --envs_per_actor)")
    parser.add_argument("--max_episodes", type=int, default=None, help="stop after this many episodes")
    parser.add_argument("--server_timeout_s", type=float, default=None,
                        help="seconds to keep reconnecting to an unreachable replay service before exiting (default: the run's)")
    args = parser.parse_args(argv)
    if args.actor_id < 0:
        parser.error(f"--actor_id must be >= 0 (it seeds the actor's environments), got {args.actor_id}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.envs_per_actor is not None and args.envs_per_actor < 1:
        parser.error(f"--envs_per_actor must be >= 1, got {args.envs_per_actor}")
    if args.max_episodes is not None and args.max_episodes < 1:
        parser.error(f"--max_episodes must be >= 1, got {args.max_episodes}")
    if args.server_timeout_s is not None and not args.server_timeout_s > 0:
        parser.error(f"--server_timeout_s must be > 0, got {args.server_timeout_s}")
    from actorq_jax.launch.flags import results_dir_problem

    problem = results_dir_problem(Path(args.log_dir))
    if problem:  # found now, not after the wait for the service and the first episode
        parser.error(f"--log_dir: {problem}")
    try:
        from actorq_jax.replay.server import parse_address

        parse_address(args.server)
    except ValueError as error:
        parser.error(f"--server: {error}")
    runtime.apply_thread_env(args.threads)
    stop = runtime.install_stop_handlers()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s actor {args.actor_id}: %(message)s")
    from actorq_jax.launch.config import config_from_json

    try:
        run, agent_config = config_from_json(fetch_config(args.server, args.server_timeout_s or DEFAULT_SERVER_TIMEOUT_S))
        # This machine's budget, not the learner's.
        run = dataclasses.replace(run, actor_threads=args.threads,
                                  envs_per_actor=args.envs_per_actor or run.envs_per_actor)
    except (TimeoutError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    from actorq_jax.launch.actor_rows import RowForwarder, check_remote_actor_id

    taken = check_remote_actor_id(args.actor_id, run.num_actors)
    if taken:
        parser.error(taken)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    # Rows also go to the replay service, which writes them into the run's results directory.
    forwarder = RowForwarder(args.server, WRITE_TIMEOUT_S)
    return run_actor(run, agent_config, args.actor_id, args.server, stop, Path(args.log_dir),
                     max_episodes=args.max_episodes, server_timeout_s=args.server_timeout_s, forwarder=forwarder)


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as exit_info:  # argparse's usage errors
        exit_code = exit_info.code if isinstance(exit_info.code, int) else 1
    runtime.exit_now(exit_code)
