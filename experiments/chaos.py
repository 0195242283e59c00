"""Fault-injection soak: one D4PG run under fire, then the checks that nothing was lost.

    python experiments/chaos.py --minutes 15            # the full soak (results in results/chaos_<time>)
    python experiments/chaos.py --quick                 # a few minutes; what the test suite runs

Every 20-40 s (seeded) it SIGKILLs a random actor; once it SIGKILLs the learner (the launcher restarts it
in place), once the replay service (restarted on its port from its last checkpoint while the learner and
actors reconnect), once it SIGSTOPs the replay service for a few seconds (shorter than
--server_timeout_s: nobody may exit or restart), once it starts two hand-started remote actors with one
id and one log directory at once (one must exit 2 naming the id, the other act on), once it stops the
whole run and resumes it with --resume, once it inserts malformed payloads into the variables table
(again and again for MALFORMED_BURST_S: the learner's next publication replaces each within a fraction
of a second, so one alone could be gone before any actor refreshed).
Then it runs an undisturbed run of the same number of learner steps and checks: every actor CSV row
well-formed; learner steps and env steps monotonic across the whole run (learner.csv, eval.csv and the
summary of each launch); no process left; the paused service held everyone; no live process was killed as hung
(every fault kills, or pauses for less than any watchdog allows); the duplicate id refused; no non-finite
parameter published (no actor rejected more payloads than the malformed ones injected, no launch ended
diverged); an actor rejected a malformed payload; the chaos run's final evaluation return within the
range of the undisturbed run's evaluations.
Prints one line per check; exit code 0 when every check passes, 1 otherwise.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from actorq_jax.launch.placement import worker_env  # noqa: E402  (after the path insert)
from actorq_jax.launch.runtime import command_words  # noqa: E402
from actorq_jax.run_dir import RunDir  # noqa: E402

ENV = worker_env()
# Small networks: the soak is about faults, not about learning fast. Each checkpoint writes the
# whole replay table, so the table is kept small and checkpoints some seconds apart.
RUN_FLAGS = [
    "--task", "cartpole_balance", "--policy_layers", "32,32", "--critic_layers", "64,64",
    "--batch_size", "32", "--min_replay_size", "200", "--samples_per_insert", "4", "--max_replay_size", "20000",
    "--publish_period", "10", "--update_period", "50", "--eval_period", "500", "--checkpoint_period", "1000",
    "--server_timeout_s", "60", "--max_actor_restarts", "100000",
]
QUICK_FLAGS = ["--max_replay_size", "5000", "--checkpoint_period", "500"]
SPECIAL = ("kill_learner", "kill_replay", "pause_replay", "duplicate_actor", "stop_and_resume", "malformed_payload")
# SIGSTOP of the replay service: well inside RUN_FLAGS' --server_timeout_s, so it must go unnoticed.
PAUSE_S = 5.0
# What the launcher says when it kills a live worker that went silent (a stopped or hung one).
SILENCE_KILLS = "but is alive (stopped or hung); killing it"
LEASE_KILLS = "has not renewed its id lease for"
# Malformed payloads are inserted every MALFORMED_EVERY_S for MALFORMED_BURST_S: longer than several of an
# actor's variable refreshes (every --update_period env steps), so one finds a malformed payload newest.
MALFORMED_BURST_S = 2.0
MALFORMED_EVERY_S = 0.02


@dataclasses.dataclass
class Soak:
    """One soak's settings."""

    results: Path
    seconds: float
    gap_s: tuple
    num_actors: int
    seed: int
    flags: tuple = tuple(RUN_FLAGS)


def _status(results: Path, role: str = "learner") -> Dict[str, Any]:
    try:
        return json.loads(RunDir(results).status_file(role).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _launch(results: Path, flags: List[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "experiments" / "run_d4pg.py"), *flags,
                             "--results_dir", str(results)], cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _children(proc: subprocess.Popen) -> List[Any]:
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _role(child: Any) -> Optional[str]:
    """The worker role a launcher's child process runs (None: not a worker, or gone while we looked)."""
    try:
        cmd = command_words(child)
    except Exception:  # gone while we looked (psutil.NoSuchProcess, AccessDenied)
        return None
    return cmd[cmd.index("actorq_jax.launch.worker") + 1] if "actorq_jax.launch.worker" in cmd else None


def _actors(proc: subprocess.Popen) -> List[Any]:
    return [child for child in _children(proc) if _role(child) == "actor"]


def _wait_up(results: Path, proc: subprocess.Popen, old_pid: Optional[int] = None, timeout_s: float = 600) -> Dict:
    """The learner's status once it trains again: running (another process than old_pid), past its restored step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        status = _status(results)
        if (status.get("phase") == "running" and status.get("pid") != old_pid
                and status.get("learner_steps", 0) > status.get("restored", {}).get("learner_steps", 0)):
            return status
        time.sleep(0.5)
    raise RuntimeError(f"the learner of {results} did not come up within {timeout_s:.0f} s (launcher code {proc.poll()})")


def _schedule(soak: Soak) -> List[tuple]:
    """(seconds from the start, event) every gap_s, the special events at seeded places, actor kills between."""
    rng = random.Random(soak.seed)
    times, t = [], 0.0
    while True:
        t += rng.uniform(*soak.gap_s)
        if t > soak.seconds:
            break
        times.append(t)
    if len(times) < len(SPECIAL):
        raise ValueError(f"{soak.seconds:.0f} s leave room for {len(times)} events; need {len(SPECIAL)} at least")
    events = ["kill_actor"] * len(times)
    for slot, name in zip(rng.sample(range(len(times)), len(SPECIAL)), SPECIAL):
        events[slot] = name
    return list(zip(times, events))


def _malformed_payloads(address: str) -> int:
    """Inserts a malformed payload into the variables table every MALFORMED_EVERY_S for MALFORMED_BURST_S; how many."""
    import numpy as np
    import reverb

    from actorq_jax.launch import runtime
    from actorq_jax.replay.variables import insert_wire

    client = reverb.Client(address)
    payload = [np.frombuffer(b'{"format": "actorq-wire", "format_version": 1, "chaos": true}', np.uint8)]
    inserted, end = 0, time.monotonic() + MALFORMED_BURST_S
    while time.monotonic() < end:
        insert_wire(client, runtime.VARIABLES_TABLE, payload)
        inserted += 1
        time.sleep(MALFORMED_EVERY_S)
    return inserted


def _paused(results: Path, proc: subprocess.Popen, old_pid: Optional[int] = None) -> float:
    """Seconds until the learner trains again: the schedule's clock stands still meanwhile, so the run gets its time."""
    began = time.monotonic()
    _wait_up(results, proc, old_pid)
    return time.monotonic() - began


def _service_paused(results: Path, proc: subprocess.Popen, old_pid: int, timeout_s: float = 600) -> float:
    """Seconds until a new replay service answers and the learner (not restarted) trains past its step at the kill."""
    began = time.monotonic()
    steps = _status(results).get("learner_steps", 0)
    while time.monotonic() - began < timeout_s and proc.poll() is None:
        service = _status(results, "replay")
        if (service.get("phase") == "running" and service.get("pid") != old_pid
                and _status(results).get("learner_steps", 0) > steps):
            return time.monotonic() - began
        time.sleep(0.5)
    raise RuntimeError(f"the replay service of {results} did not come back within {timeout_s:.0f} s "
                       f"(launcher code {proc.poll()})")


def _worker_pids(proc: subprocess.Popen) -> Dict[int, str]:
    """{pid: role} of the launcher's worker processes now."""
    return {child.pid: role for child in _children(proc) if (role := _role(child)) is not None}


def _pause_replay(results: Path, proc: subprocess.Popen) -> Dict[str, Any]:
    """SIGSTOPs the replay service for PAUSE_S, SIGCONTs it, waits as long again: who exited meanwhile."""
    service = _status(results, "replay")["pid"]
    before = _worker_pids(proc)
    steps = _status(results).get("learner_steps", 0)
    os.kill(service, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
    finally:
        os.kill(service, signal.SIGCONT)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and _status(results).get("learner_steps", 0) <= steps:
        time.sleep(0.5)
    time.sleep(PAUSE_S)
    after = _worker_pids(proc)
    gone = sorted(f"{role} {pid}" for pid, role in before.items() if pid not in after)
    return {"service_pid": service, "gone": gone, "trained_after": _status(results).get("learner_steps", 0) > steps}


def _duplicate_actor(results: Path, soak: Soak) -> Dict[str, Any]:
    """Starts two remote actors with one id and one log directory at once: one must exit 2 naming the id, the other
    run on (an episode in its file) and exit 0 when stopped."""
    address = _status(results, "replay")["local_address"]
    actor_id = soak.num_actors + 10  # outside the launcher's ids 0..num_actors-1
    logs = results.parent / "remote_actors"
    logs.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "actorq_jax.launch.actor", "--server", address, "--actor_id", str(actor_id),
               "--log_dir", str(logs)]
    # Started together (the service grants the lease to one), which also halves the wait for two start-ups.
    outputs = [logs / f"twin_{i}.log" for i in range(2)]
    twins = []
    for output in outputs:
        with open(output, "ab") as out:
            twins.append(subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 300.0
        while all(t.poll() is None for t in twins) and time.monotonic() < deadline:
            time.sleep(0.5)
        first_out = next((i for i, t in enumerate(twins) if t.poll() is not None), 1)
        refused, holder = twins[first_out], twins[1 - first_out]
        csv = logs / RunDir.actor_file(actor_id)
        # A finished episode: the holder acts under its lease, in a file the refused twin left alone.
        while holder.poll() is None and time.monotonic() < deadline and len(csv.read_text().splitlines()
                                                                            if csv.exists() else []) < 2:
            time.sleep(0.5)
        holder_running = holder.poll() is None
    finally:
        for twin in twins:
            if twin.poll() is None:
                twin.send_signal(signal.SIGTERM)
        for twin in twins:
            try:
                twin.wait(timeout=120)
            except subprocess.TimeoutExpired:
                twin.kill()
                twin.wait()
    said = outputs[first_out].read_text(errors="replace").strip().splitlines()
    return {"actor_id": actor_id, "refused_code": refused.returncode, "holder_running": holder_running,
            "holder_code": holder.returncode, "said": any(f"--actor_id {actor_id} is held by another actor" in line
                                                           for line in said), "refused_tail": said[-1:]}


def run_soak(soak: Soak, say) -> Dict[str, Any]:
    """Runs the disturbed run; returns what the checks need (pids seen, summaries of each launch)."""
    rng = random.Random(soak.seed + 1)
    flags = [*soak.flags, "--num_actors", str(soak.num_actors), "--seed", str(soak.seed), "--max_seconds", "100000"]
    soak.results.parent.mkdir(parents=True, exist_ok=True)
    log = open(soak.results.parent / f"{soak.results.name}.launcher.log", "ab")
    seen: Set[int] = set()
    summaries: List[Dict[str, Any]] = []
    events: Dict[str, Any] = {"malformed": 0}
    proc = _launch(soak.results, flags, log)
    try:
        _wait_up(soak.results, proc)  # the clock starts once the run trains
        start = time.monotonic()
        for at, event in _schedule(soak):
            while time.monotonic() - start < at:
                seen.update(c.pid for c in _children(proc))
                if proc.poll() is not None:
                    raise RuntimeError(f"the launcher exited (code {proc.returncode}) before the {event} at {at:.0f} s")
                time.sleep(0.5)
            status = _status(soak.results)
            if event == "kill_actor":
                actors = _actors(proc)
                if actors:
                    victim = rng.choice(actors)
                    victim.kill()
                    say(f"{at:6.0f}s  SIGKILL actor pid {victim.pid}")
            elif event == "kill_learner":
                os.kill(status["pid"], signal.SIGKILL)
                say(f"{at:6.0f}s  SIGKILL learner at step {status.get('learner_steps')}")
                start += _paused(soak.results, proc, old_pid=status["pid"])
            elif event == "kill_replay":
                service = _status(soak.results, "replay")
                os.kill(service["pid"], signal.SIGKILL)
                say(f"{at:6.0f}s  SIGKILL replay service at {service.get('env_steps')} env steps")
                start += _service_paused(soak.results, proc, service["pid"])
            elif event == "pause_replay":
                events["pause"] = _pause_replay(soak.results, proc)
                say(f"{at:6.0f}s  SIGSTOP replay service {PAUSE_S:.0f} s, then SIGCONT; exited meanwhile: "
                    f"{events['pause']['gone'] or 'nobody'}")
            elif event == "duplicate_actor":
                events["duplicate"] = duplicate = _duplicate_actor(soak.results, soak)
                say(f"{at:6.0f}s  two remote actors with --actor_id {duplicate['actor_id']}: the refused one exited "
                    f"{duplicate['refused_code']}: {' '.join(duplicate['refused_tail'])}")
            elif event == "malformed_payload":
                inserted = _malformed_payloads(_status(soak.results, "replay")["local_address"])
                events["malformed"] += inserted
                say(f"{at:6.0f}s  malformed payload into the variables table, {inserted} times in "
                    f"{MALFORMED_BURST_S:.0f} s")
            else:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=600)
                summaries.append(json.loads(RunDir(soak.results).summary.read_text()))
                say(f"{at:6.0f}s  stopped the run (code {proc.returncode}) at step {summaries[-1]['learner_steps']}; resuming")
                proc = _launch(soak.results, ["--resume", str(soak.results)], log)
                start += _paused(soak.results, proc)
        while time.monotonic() - start < soak.seconds:
            seen.update(c.pid for c in _children(proc))
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
        summaries.append(json.loads(RunDir(soak.results).summary.read_text()))
        say(f"{soak.seconds:6.0f}s  stopped the run (code {proc.returncode}) at step {summaries[-1]['learner_steps']}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    return {"pids": seen, "summaries": summaries, "events": events}


def run_reference(results: Path, learner_steps: int, soak: Soak) -> Dict[str, Any]:
    """An undisturbed run of the same number of learner steps; its summary."""
    flags = [*soak.flags, "--num_actors", str(soak.num_actors), "--seed", str(soak.seed),
             "--max_learner_steps", str(learner_steps)]
    with open(results.parent / f"{results.name}.launcher.log", "ab") as log:
        subprocess.run([sys.executable, str(REPO / "experiments" / "run_d4pg.py"), *flags, "--results_dir", str(results)],
                       cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=3600)
    return json.loads(RunDir(results).summary.read_text())


def _monotonic(values: List[float], strict: bool) -> bool:
    return all((b > a) if strict else (b >= a) for a, b in zip(values, values[1:]))


def check(soak: Soak, disturbed: Dict[str, Any], reference_dir: Path) -> List[tuple]:
    """(name, passed, detail) of every check."""
    from actorq_jax.telemetry import ACTOR_FIELDS, read_csv

    results = []
    bad_rows, rows, rejected = [], 0, 0
    for path in RunDir(soak.results).actor_csvs():
        for i, row in enumerate(read_csv(path)):
            rows += 1
            rejected = max(rejected, row.get("rejected_payloads") or 0)
            text = ("incarnation", "policy_backend")
            numbers = [k for k in ACTOR_FIELDS if k not in text]
            if (list(row) != list(ACTOR_FIELDS) or any(not isinstance(row[k], (int, float)) for k in numbers)
                    or any(not isinstance(row[k], str) for k in text)):
                bad_rows.append(f"{path.name}:{i + 2}")
    results.append(("actor CSV rows well-formed", rows > 0 and not bad_rows,
                    f"{rows} rows, {len(bad_rows)} malformed {bad_rows[:5]}; most payloads one actor rejected: {rejected}"))
    learner = read_csv(RunDir(soak.results).learner_csv)
    steps = [r["learner_steps"] for r in learner]
    env_steps = [r["env_steps"] for r in learner]
    summaries = disturbed["summaries"]
    # eval.csv too: a restored learner's evaluations replace the lost timeline's (launch/run_rows.py).
    evaluated = [r["learner_steps"] for r in read_csv(RunDir(soak.results).eval_csv)]
    ok = (_monotonic(steps, strict=True) and _monotonic(env_steps, strict=False)
          and _monotonic(evaluated, strict=False)
          and _monotonic([s["learner_steps"] for s in summaries], strict=False)
          and _monotonic([s["env_steps"] for s in summaries], strict=False))
    results.append(("learner and env steps monotonic", ok,
                    f"learner.csv {len(steps)} rows up to step {steps[-1] if steps else 0}; eval.csv "
                    f"{len(evaluated)} rows; per launch: "
                    + ", ".join(f"{s['learner_steps']}/{s['env_steps']}" for s in summaries)))
    import psutil

    left = [pid for pid in disturbed["pids"] if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    results.append(("no process left", not left, f"{len(disturbed['pids'])} worker processes seen, alive: {left}"))
    events = disturbed["events"]
    pause = events.get("pause", {})
    results.append(("paused replay service held everyone", bool(pause) and not pause["gone"] and pause["trained_after"],
                    f"SIGSTOP {PAUSE_S:.0f} s: exited meanwhile {pause.get('gone')}, learner trained after: "
                    f"{pause.get('trained_after')}"))
    # Every fault injected either kills (and the launcher restarts on the death) or pauses for less than any
    # watchdog allows: a process killed for its silence would be a watchdog mistaking a busy process for a hung one.
    silenced = [e for s in summaries for e in s.get("events", []) if SILENCE_KILLS in e or LEASE_KILLS in e]
    results.append(("no live process killed as hung", not silenced,
                    f"{len(silenced)} killed for their silence: {silenced[:3]}"))
    duplicate = events.get("duplicate", {})
    results.append(("duplicate actor id refused", bool(duplicate) and duplicate["refused_code"] == 2
                    and duplicate["said"] and duplicate["holder_running"] and duplicate["holder_code"] == 0,
                    f"one exited {duplicate.get('refused_code')} naming the id: {duplicate.get('said')}; the holder "
                    f"ran on: {duplicate.get('holder_running')}, exited {duplicate.get('holder_code')}"))
    losses_finite = all(math.isfinite(v) for r in learner for k, v in r.items()
                        if k.endswith("_loss") and isinstance(v, float))
    learner_log = RunDir(soak.results).log("learner")
    diverged = learner_log.exists() and "learner diverged" in learner_log.read_text(errors="replace")
    failed = [s["exit_code"] for s in summaries if s.get("exit_code") != 0]
    results.append(("no non-finite parameter published",
                    rejected <= events.get("malformed", 0) and losses_finite and not diverged and not failed,
                    f"most payloads one actor rejected {rejected} (malformed injected: {events.get('malformed', 0)}); "
                    f"learner.csv losses finite: {losses_finite}; learner diverged: {diverged}; launches that "
                    f"failed: {failed}"))
    # The actors' rejection at work: a soak whose malformed payloads no actor ever fetched proves nothing by them.
    results.append(("malformed payload rejected", rejected >= 1,
                    f"most payloads one actor rejected {rejected} of {events.get('malformed', 0)} injected"))
    returns = [r["return"] for r in read_csv(RunDir(reference_dir).eval_csv) if r["policy"] == "fp32"]
    final = summaries[-1]["final_eval_return"]
    low, high = (min(returns), max(returns)) if returns else (float("nan"), float("nan"))
    # Widened by one standard deviation of those evaluations: a short run's returns are noisy, and one
    # seed's evaluations alone miss values an equally healthy run reaches (the --quick soak fell 4 below
    # its reference's lowest of 11). A collapsed or non-finite run still fails.
    spread = statistics.pstdev(returns) if len(returns) > 1 else 0.0
    results.append(("final return within the undisturbed run's range", low - spread <= final <= high + spread,
                    f"final {final:.1f}; undisturbed evaluations {low:.1f} .. {high:.1f} ({len(returns)}), "
                    f"widened by their std {spread:.1f}"))
    return results


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the soak and its checks; 0 when every check passes."""
    parser = argparse.ArgumentParser(description="Fault-injection soak of one D4PG run (see the module doc).")
    parser.add_argument("--minutes", type=float, default=15.0, help="length of the disturbed run")
    parser.add_argument("--quick", action="store_true", help="a short soak: 36 s of events 3.5-5 s apart")
    parser.add_argument("--num_actors", type=int, default=3, help="actors of the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule, the victims and the runs")
    parser.add_argument("--results_dir", default=None, help="where both runs go (default results/chaos_<time>)")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if args.num_actors < 1:
        parser.error(f"--num_actors must be >= 1, got {args.num_actors}")
    root = Path(args.results_dir or f"results/chaos_{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    if RunDir(root / "chaos").config.exists():
        parser.error(f"--results_dir: {root} already holds a soak")
    # --quick: room for the special events and at least one actor kill (restarts stop the clock).
    seconds, gap = (36.0, (3.5, 5.0)) if args.quick else (args.minutes * 60.0, (20.0, 40.0))
    soak = Soak(root / "chaos", seconds, gap, args.num_actors, args.seed,
                tuple(RUN_FLAGS + (QUICK_FLAGS if args.quick else [])))

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"chaos soak: {seconds:.0f} s, {args.num_actors} actors, seed {args.seed}, results in {root}")
    disturbed = run_soak(soak, say)
    learner_steps = disturbed["summaries"][-1]["learner_steps"]
    if learner_steps < 1:
        say("FAIL  the disturbed run took no learner step")
        return 1
    say(f"undisturbed run of {learner_steps} learner steps for the return range")
    run_reference(root / "reference", learner_steps, soak)
    outcome = check(soak, disturbed, root / "reference")
    for name, passed, detail in outcome:
        say(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    (root / "chaos_report.json").write_text(json.dumps(
        [{"check": n, "passed": bool(p), "detail": d} for n, p, d in outcome], indent=2))
    return 0 if all(p for _, p, _ in outcome) else 1


if __name__ == "__main__":
    sys.exit(main())
