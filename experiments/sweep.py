"""Runs one ActorQ experiment across actor bit-widths and seeds, one run after another.

    python experiments/sweep.py --agent d4pg --bits 32,16,8 --seeds 0,1 --results_dir results/sweep \\
        --task cartpole_balance --max_seconds 360

Each run goes to SWEEP_DIR/<agent>_<task>_q<bits>_s<seed>/ (its console output
to SWEEP_DIR/logs/); SWEEP_DIR/sweep.json indexes the runs and is rewritten
after each one. Every flag besides the sweep's own is passed unchanged to
`experiments/run.py --agent <agent>`. A failing run is recorded and the sweep goes on;
Ctrl-C or SIGTERM stops the current run cleanly and ends the sweep.
Then: python experiments/plot.py SWEEP_DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from actorq_jax.agents.registry import agent_names, get_agent
from actorq_jax.analysis.records import stopped_before_budget
from actorq_jax.launch.flags import parse_run
from actorq_jax.launch.runtime import die_with_parent
from actorq_jax.quantization.config import VALID_BITS
from actorq_jax.run_dir import RunDir
from actorq_jax.telemetry import write_json

EXPERIMENTS = Path(__file__).resolve().parent
# Flags the sweep sets itself for every run; passing them through would be ambiguous.
OWNED_FLAGS = ("--actor_bits", "--seed", "--results_dir", "--resume")
INDEX = "sweep.json"


def _int_list(flag: str, text: str, allowed: Optional[Sequence[int]] = None, minimum: int = 0) -> List[int]:
    parts = [p.strip() for p in text.split(",")]
    values = []
    for part in parts:
        if not part.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{flag}: {part!r} in {text!r} is not an integer")
        value = int(part)
        if allowed is not None and value not in allowed:
            raise argparse.ArgumentTypeError(f"{flag}: {value} is not a supported bit-width; choose from {allowed}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag}: {value} must be >= {minimum}")
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{flag}: {text!r} repeats a value")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The sweep's own flags; everything else is left for the run script."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any other flag (e.g. --task, --max_seconds, --num_actors, --policy_layers) goes to "
               "experiments/run.py --agent <agent> unchanged; see its --help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # otherwise a pass-through --seed would be read as the sweep's --seeds
    )
    parser.add_argument("--agent", required=True, choices=agent_names(), help="which registered agent to sweep")
    parser.add_argument("--bits", default="32,16,8", help=f"comma list of actor bit-widths from {VALID_BITS}")
    parser.add_argument("--seeds", default="0", help="comma list of seeds (non-negative integers)")
    parser.add_argument("--results_dir", required=True, help="sweep directory (runs, logs and sweep.json)")
    parser.add_argument("--run_script", default=None,
                        help="script each run executes (default: experiments/run.py --agent <agent>); it gets the "
                             "pass-through flags plus --actor_bits, --seed and --results_dir")
    parser.add_argument("--skip_existing", action="store_true",
                        help="keep runs whose directory already has a summary.json instead of failing on them")
    return parser


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of `flag` in a pass-through list (`--flag v` or `--flag=v`), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def parse(argv: Optional[Sequence[str]]) -> tuple:
    """(sweep args, bits, seeds, pass-through flags); exits 2 naming the flag on bad input."""
    parser = build_parser()
    args, passthrough = parser.parse_known_args(argv)
    try:
        bits = _int_list("--bits", args.bits, allowed=VALID_BITS)
        seeds = _int_list("--seeds", args.seeds, minimum=0)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    for arg in passthrough:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS:
            parser.error(f"{name}: set by the sweep for each run (use --bits, --seeds and --results_dir)")
    if passthrough and not passthrough[0].startswith("-"):
        parser.error(f"unexpected argument {passthrough[0]!r}: pass-through flags look like --name value")
    return args, bits, seeds, passthrough


def check_runs(agent: str, passthrough: Sequence[str], planned: Sequence[tuple]) -> None:
    """Parses every planned run's flags as its run script will, so a bad flag exits 2 before any run starts."""
    for bits, seed, run_dir in planned:
        parse_run(agent, [*passthrough, "--actor_bits", str(bits), "--seed", str(seed), "--results_dir", str(run_dir)],
                  description=f"experiments/run.py --agent {agent} (checked by sweep.py)")


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class _Stopper:
    """Turns SIGINT/SIGTERM into a request to stop the current run and the sweep."""

    def __init__(self) -> None:
        self.requested = False
        self.child: Optional[subprocess.Popen] = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        # The run's launcher turns SIGTERM into a clean shutdown (final checkpoint, summary).
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _plan(args: argparse.Namespace, bits_list: List[int], seeds: List[int], passthrough: List[str],
          argv: Optional[Sequence[str]]) -> Dict[str, Any]:
    """The sweep index before any run: one pending entry per (seed, bits)."""
    task = _flag_value(passthrough, "--task") or get_agent(args.agent).default_task
    command = shlex.join([sys.executable, *sys.argv] if argv is None else ["experiments/sweep.py", *argv])
    index: Dict[str, Any] = {
        "command": command, "agent": args.agent, "task": task, "bits": bits_list, "seeds": seeds,
        "passthrough": list(passthrough), "started": _now(), "finished": None, "runs": [],
    }
    # Seed-major order: every bit-width of a seed runs close in time, so a change in machine load
    # over the sweep affects all bit-widths alike.
    for seed in seeds:
        for bits in bits_list:
            name = f"{args.agent}_{task}_q{bits}_s{seed}"
            index["runs"].append({"name": name, "dir": name, "bits": bits, "seed": seed, "status": "pending",
                                  "exit_code": None, "wall_seconds": None, "log": str(Path("logs") / f"{name}.log")})
    return index


def _run_one(entry: Dict[str, Any], script_cmd: List[str], passthrough: List[str], sweep_dir: Path,
             stopper: _Stopper, index_path: Path, index: Dict[str, Any], label: str) -> int:
    """Runs one planned run to its end, recording it in the index; returns its exit code."""
    run_dir = sweep_dir / entry["dir"]
    cmd = [*script_cmd, *passthrough, "--actor_bits", str(entry["bits"]), "--seed", str(entry["seed"]),
           "--results_dir", str(run_dir)]
    entry.update(command=shlex.join(cmd), status="running", started=_now())
    write_json(index_path, index)
    print(f"[sweep] {label} {entry['name']}: running (log: {sweep_dir / entry['log']})", flush=True)
    start = time.monotonic()
    with open(sweep_dir / entry["log"], "ab") as log:
        # Same process group: a Ctrl-C at the terminal reaches the run's processes as the launcher
        # expects; die_with_parent ends the run if the sweep itself is killed.
        stopper.child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        code = stopper.child.wait()
        stopper.child = None
    # A run stopped by the sweep's signal exits 0 after a clean shutdown, yet did not finish its budget.
    status = "stopped" if stopper.requested else "ok" if code == 0 else "failed"
    entry.update(exit_code=code, wall_seconds=round(time.monotonic() - start, 3), status=status)
    print(f"[sweep] {label} {entry['name']}: {status}, exit code {code} after {entry['wall_seconds']:.0f} s",
          flush=True)
    write_json(index_path, index)
    return code


def unfinished(run_dir: Path) -> Optional[str]:
    """Why the run in run_dir with a summary.json did not finish its budget (None when it did)."""
    summary = json.loads(RunDir(run_dir).summary.read_text())
    if summary.get("exit_code") != 0:
        return f"it exited {summary.get('exit_code')}"
    if stopped_before_budget(summary):
        return "it was stopped before its budget"
    return None


def _keep_existing(entry: Dict[str, Any], run_dir: Path) -> None:
    summary = json.loads(RunDir(run_dir).summary.read_text())
    entry.update(status="existing", exit_code=summary.get("exit_code"), wall_seconds=summary.get("wall_seconds"))


def run_sweep(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the sweep; returns 0 when every run exited 0, 1 otherwise (2 for bad flags, via argparse)."""
    args, bits_list, seeds, passthrough = parse(argv)
    if args.run_script:
        script_cmd = [sys.executable, args.run_script]
        if not Path(args.run_script).is_file():
            print(f"sweep: --run_script: {args.run_script} does not exist", file=sys.stderr)
            return 2
    else:
        script_cmd = [sys.executable, str(EXPERIMENTS / "run.py"), "--agent", args.agent]
    sweep_dir = Path(args.results_dir).absolute()
    index_path = sweep_dir / INDEX
    index = _plan(args, bits_list, seeds, passthrough, argv)
    existing = {e["name"] for e in index["runs"] if args.skip_existing and RunDir(sweep_dir / e["dir"]).summary.is_file()}
    # Only a run that finished its budget stands for its cell: a stopped or failed one would skew the table.
    cut_short = [(e["dir"], unfinished(sweep_dir / e["dir"])) for e in index["runs"] if e["name"] in existing]
    cut_short = [(name, why) for name, why in cut_short if why]
    if cut_short:
        for name, why in cut_short:
            print(f"sweep: --skip_existing: {sweep_dir / name} did not finish ({why}); move it aside to run it again",
                  file=sys.stderr)
        return 2
    check_runs(args.agent, passthrough,
               [(e["bits"], e["seed"], sweep_dir / e["dir"]) for e in index["runs"] if e["name"] not in existing])
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_json(index_path, index)
    stopper = _Stopper()
    failures = 0
    total = len(index["runs"])
    try:
        for i, entry in enumerate(index["runs"]):
            label = f"{i + 1}/{total}"
            if stopper.requested:
                entry["status"] = "not run (sweep stopped)"
            elif entry["name"] in existing:
                _keep_existing(entry, sweep_dir / entry["dir"])
                print(f"[sweep] {label} {entry['name']}: kept the existing run", flush=True)
                write_json(index_path, index)
            elif _run_one(entry, script_cmd, passthrough, sweep_dir, stopper, index_path, index, label) != 0:
                failures += 1
    finally:
        stopper.restore()
        if stopper.child is not None and stopper.child.poll() is None:
            stopper.child.send_signal(signal.SIGTERM)
            stopper.child.wait()
        index.update(finished=_now(), stopped=stopper.requested)
        write_json(index_path, index)
    done = sum(entry["status"] in ("ok", "existing") for entry in index["runs"])
    print(f"[sweep] {done}/{total} runs ok; index: {index_path}", flush=True)
    print(f"[sweep] plots: {sys.executable} experiments/plot.py {sweep_dir}", flush=True)
    return 1 if failures or stopper.requested else 0


if __name__ == "__main__":
    sys.exit(run_sweep())
