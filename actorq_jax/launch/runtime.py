"""Process plumbing shared by the learner, actor and evaluator workers (imports no JAX)."""

import ctypes
import os
import signal
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from actorq_jax.net import LOOPBACK

# The backends a run launches its workers on (--launcher).
LAUNCHERS = ("local", "ray")
# Tables on the replay service's Reverb server besides the replay table.
VARIABLES_TABLE = "variables"  # the actors' policy at comm_bits, refreshed every publish_period
EVAL_VARIABLES_TABLE = "eval_variables"  # the float32 policy, refreshed every eval_period
CONFIG_TABLE = "config"  # config.json as uint8, so remote actors run the same configuration
# The learner's exit code when a loss or parameter stopped being finite: restarting it would diverge again.
EXIT_DIVERGED = 4
# The replay service's exit code when its port was taken before it could bind it (the launcher may pick another).
EXIT_PORT_TAKEN = 5
# An actor's exit code when its own watchdog found its main loop stuck for --actor_hang_s (launch/leases.py).
EXIT_HUNG = 6


def thread_env(threads: int) -> Dict[str, str]:
    """Environment variables that hold XLA, TensorFlow and OpenMP to `threads` threads (0: no limit)."""
    if threads <= 0:
        return {}
    env = {
        "OMP_NUM_THREADS": str(threads),
        "TF_NUM_INTRAOP_THREADS": str(threads),
        "TF_NUM_INTEROP_THREADS": "1",
    }
    if threads == 1:
        # XLA:CPU's Eigen pool otherwise starts one thread per core in every process.
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return env


def apply_thread_env(threads: int) -> None:
    """Sets the thread budget in this process; must run before JAX or TensorFlow is imported."""
    for key, value in thread_env(threads).items():
        if key == "XLA_FLAGS" and os.environ.get("XLA_FLAGS"):
            value = os.environ["XLA_FLAGS"] + " " + value
        os.environ[key] = value


def jax_platform(role: str, run: Any) -> Optional[str]:
    """The JAX_PLATFORMS value a role runs with: "cpu" for every role but the learner, which follows
    --learner_platform (None: JAX's own choice, an accelerator when it sees one)."""
    if role != "learner":
        # An actor on a GPU machine would otherwise open the device (and reserve its memory) with JAX's defaults.
        return "cpu"
    return {"auto": None, "cpu": "cpu", "gpu": "cuda"}[getattr(run, "learner_platform", "auto")]


def apply_jax_platform(role: str, run: Any) -> Optional[str]:
    """Sets this process's JAX platform for its role (before JAX's first computation); returns the value set."""
    import sys

    platform = jax_platform(role, run)
    if platform is not None:
        os.environ["JAX_PLATFORMS"] = platform
        if "jax" in sys.modules:  # imported already (configs import the agents): the env var was read then
            sys.modules["jax"].config.update("jax_platforms", platform)
    return platform


def parse_cpu_list(text: str) -> Tuple[int, ...]:
    """Parses a core list such as '0', '1,3' or '0-2,5' (sorted, no repeats); ValueError naming it if malformed."""
    cores = set()
    for part in str(text).split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()) or (sep and int(high) < int(low)):
            raise ValueError(f"malformed core list {text!r}: expected cores like 0 or 1,3 or 0-2")
        cores.update(range(int(low), int(high if sep else low) + 1))
    return tuple(sorted(cores))


def cpu_list_problem(text: str) -> Optional[str]:
    """Why a core list cannot be used on this machine (None when it can)."""
    if not text:
        return None
    try:
        cores = parse_cpu_list(text)
    except ValueError as error:
        return str(error)
    available = sorted(os.sched_getaffinity(0))
    absent = [c for c in cores if c not in available]
    if absent:
        return f"core(s) {absent} are not available to this process; available: {available}"
    return None


def role_cpus(role: str, run: Any, available: Optional[List[int]] = None) -> Tuple[int, ...]:
    """The cores a role is pinned to: its --*_cpus flag, else what --layout gives it (() for every core).

    --learner_cpus pins the learner, --replay_cpus the replay service, --actor_cpus the actors and the
    evaluator. --layout pinned gives the learner the first core this process may use and every other
    role the rest, as the paper's learner had a device of its own. `available`: the cores to place on
    (default: those this process may use).
    """
    flag = {"learner": "learner_cpus", "replay": "replay_cpus"}.get(role, "actor_cpus")
    text = getattr(run, flag, "")
    if text:
        return parse_cpu_list(text)
    if getattr(run, "layout", "shared") == "pinned":
        available = sorted(os.sched_getaffinity(0) if available is None else available)
        if len(available) < 2:
            return ()  # one core: nothing to separate (the flags refuse this before a run starts)
        return (available[0],) if role == "learner" else tuple(available[1:])
    return ()


def apply_cpu_affinity(role: str, run: Any) -> Tuple[int, ...]:
    """Pins this process to its role's cores (nothing when the run gives none); returns the cores.

    ValueError (naming the flag) when this machine cannot give them.
    """
    cores = role_cpus(role, run)
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as error:  # a config from another machine, or a cgroup that shrank since the run started
            flag = {"learner": "learner_cpus", "replay": "replay_cpus"}.get(role, "actor_cpus")
            raise ValueError(f"cannot pin the {role} to cores {list(cores)} (--{flag} or --layout): "
                             f"{error.strerror or error}; this process may use {sorted(os.sched_getaffinity(0))}"
                             ) from None
    return cores


class StopFlag:
    """A stop request with threading.Event's interface that a signal handler can set safely.

    threading.Event.set() takes a lock, and a signal handler runs in the main thread between
    bytecodes: if the signal lands while that thread is inside the same Event (or a second signal
    lands inside the first handler's set()), the handler waits for a lock its own thread holds,
    forever. A learner hung that way after its launcher was killed. Setting a bool takes no lock;
    waiting polls it.
    """

    _POLL_S = 0.05

    def __init__(self) -> None:
        self._flag = False

    def set(self) -> None:
        """Requests the stop (safe from signal handlers and any thread)."""
        self._flag = True

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        return self._flag

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the stop is requested or `timeout` seconds pass; returns whether it was requested."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            remaining = self._POLL_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(self._POLL_S, remaining))
        return self._flag


def stop_signals() -> Tuple[int, ...]:
    """The signals that ask a run's processes to stop: SIGTERM, SIGINT, and SIGHUP unless it is ignored."""
    # A closed terminal hangs up on the launcher and its workers alike: a stop request, as Ctrl-C is, so the
    # final checkpoint is written. Under nohup (SIGHUP ignored, and inherited so) the run goes on.
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGTERM, signal.SIGINT, *hangup)


def stop_on_signals(stop: Any = None) -> StopFlag:
    """A StopFlag (or the given one) set by each of stop_signals(); returns it."""
    flag = stop if stop is not None else StopFlag()

    def handler(signum: int, frame: Any) -> None:
        flag.set()

    for sig in stop_signals():
        signal.signal(sig, handler)
    return flag


def install_stop_handlers() -> StopFlag:
    """A stop flag set by SIGTERM, SIGINT or SIGHUP, so loops can finish their step and shut down cleanly."""
    return stop_on_signals()


def command_words(process: Any) -> List[str]:
    """A psutil.Process's command line as words (a forked worker's title is one string: launch/forker.py)."""
    return " ".join(process.cmdline()).split()


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies, so no orphan outlives a killed launcher."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return  # not Linux/glibc: the launcher's own shutdown still reaps children
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def make_builder(agent: str, config: Any, spec: Any) -> Any:
    """The registered agent's builder (an actorq_jax.agents.builder.AgentBuilder) for a task's spec."""
    from actorq_jax.agents.registry import get_agent

    return get_agent(agent).make_builder(config, spec)


def service_tables(builder: Any, replay: Any = None) -> list:
    """The data tables of a run's Reverb server: the builder's replay tables (of table config `replay` when given),
    variables, eval variables, config, the remote actors' episode rows, and (under Ray) the learner's and
    evaluator's rows."""
    from actorq_jax.launch.actor_rows import make_actor_rows_tables
    from actorq_jax.launch.run_rows import make_run_rows_table
    from actorq_jax.replay import make_variables_table

    return [
        *builder.replay_tables(replay),
        make_variables_table(VARIABLES_TABLE),
        make_variables_table(EVAL_VARIABLES_TABLE),
        make_variables_table(CONFIG_TABLE),
        *make_actor_rows_tables(),
        make_run_rows_table(),
    ]


def publish_config(client: Any, config_json: str) -> None:
    """Puts config.json on the run's server, where remote actors read it."""
    import numpy as np

    client.insert([np.frombuffer(config_json.encode(), np.uint8)], {CONFIG_TABLE: 1.0})


def derive_seed(*parts: int) -> int:
    """A 32-bit seed derived from several integers (run seed, actor id, restart...)."""
    import numpy as np

    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def exit_now(code: Optional[int]) -> None:
    """Ends the process as an interpreter's exit would (atexit handlers, flushed streams), without tearing its
    objects down."""
    import atexit

    # A Reverb sampler or dataset still waiting in a thread (a read given up at its deadline, a server gone)
    # aborts the process in its destructor ("terminate called without an active exception") or blocks for ever.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
