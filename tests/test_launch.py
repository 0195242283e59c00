"""The launcher end to end: a real learner, Reverb server, actors and evaluator on the loopback.

Each behaviour has its run, so one failure fails one test: a budget run leaves a
complete results directory; SIGTERM stops a run without orphans; a killed actor
is restarted; a remote actor joins with --server; --resume continues a run.
Flag validation runs in-process, with one run of the script itself.
(Crashes of the learner and the launcher: tests/test_faults.py.)
"""

import dataclasses
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from launch_support import (
    ENV,
    ROOT,
    TINY,
    alive,
    load_script,
    start_remote_actor,
    start_run,
    status,
    stop_all,
    usage_error,
    wait_for,
    worker_process,
)
from launch_support import rows as _rows

from actorq_jax.launch.checkpoint import finished_steps, read_counters
from actorq_jax.launch.flags import parse_run


def _started(results, proc):
    """The replay service's status once the learner trains against it."""
    wait_for(lambda: status(results).get("phase") == "running", 150, "the learner", proc)
    return status(results, "replay")


def _first_episode(results, proc) -> None:
    _started(results, proc)
    wait_for(lambda: _rows(results / "actors" / "actor_0.csv"), 150, "actor 0's first episode", proc)


@pytest.mark.process
@pytest.mark.timeout(400)
def test_budget_run_leaves_a_complete_results_directory(tmp_path):
    d = tmp_path / "run"
    proc = subprocess.run([sys.executable, "experiments/run_d4pg.py", *TINY, "--num_actors", "1", "--actor_bits", "8",
                           "--max_learner_steps", "300", "--results_dir", str(d)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("config.json", "summary.json", "learner.csv", "eval.csv", "emissions.csv", "actors/actor_0.csv"):
        assert (d / name).exists(), name
    summary = json.loads((d / "summary.json").read_text())
    for key in ("env_steps", "learner_steps", "wall_seconds", "final_eval_return", "best_eval_return",
                "env_steps_per_second", "energy_kwh", "emissions_kg"):
        assert key in summary, key
    assert summary["learner_steps"] == 300 and summary["counters_from"] == "final status report"
    # The learner's reports carry the replay table's size (the launcher's progress line shows it).
    assert 100 <= status(d)["replay_items"] <= summary["env_steps"], status(d)
    assert summary["energy_kwh"] > 0 and summary["emissions_kg"] > 0
    # Where the run's CPU went, per process: the replay service's as well as the learner's and the actor's.
    assert set(summary["worker_cpu_s"]) == {"replay", "learner", "actor_0", "evaluator"}
    assert all(seconds > 0.1 for seconds in summary["worker_cpu_s"].values()), summary["worker_cpu_s"]
    # And the cores each could use (the shared layout: all of this process's), which tell who shared a core.
    every = sorted(os.sched_getaffinity(0))
    assert summary["worker_cores"] == {name: every for name in summary["worker_cpu_s"]}
    # What computed the 8-bit actor's policy, as the actor resolved it (the kernel path of this CPU).
    from actorq_jax import kernels

    assert summary["actor_policy_backends"] == [f"int8/w8a8/{kernels.kernel_path()}"], summary["actor_policy_backends"]
    # The machine that ran it: its CPU's name, and its vendor, family and model numbers, which tell apart CPUs
    # of one name.
    from actorq_jax.telemetry.machine import cpu_id, cpu_model

    assert summary["machine"] == {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count()}
    assert summary["final_eval_return"] == summary["final_eval_return"]  # not NaN: a final evaluation ran
    # The run's processes met on the loopback; the hint for other machines names none of its addresses.
    joins = [e for e in summary["events"] if "remote actors join with" in e]
    assert len(joins) == 1 and "--server THIS_HOST:" in joins[0] and "127.0.0.1" not in joins[0], summary["events"]
    eval_rows = _rows(d / "eval.csv")
    assert {"wall_seconds", "env_steps", "learner_steps", "return", "policy"} <= set(eval_rows[0])
    assert {r["policy"] for r in eval_rows} == {"fp32", "actor"}
    assert any(r["final"] == 1 for r in eval_rows)
    learner_rows = _rows(d / "learner.csv")
    assert {"learner_steps", "wall_seconds", "critic_loss", "policy_loss", "sgd_steps_per_s"} <= set(learner_rows[0])
    # The pool the batches came from: never more than was inserted, and by the end at least --min_replay_size
    # (TINY's 100; the ratio regime removes nothing).
    assert all(r["replay_items"] <= r["env_steps"] for r in learner_rows), learner_rows
    assert learner_rows[-1]["replay_items"] >= 100, learner_rows[-1]
    actor_rows = _rows(d / "actors" / "actor_0.csv")
    assert {"actor_id", "env_steps", "episode_return", "env_step_s", "inference_s", "adder_s", "pull_s",
            "deserialize_s", "load_s", "rejected_payloads"} <= set(actor_rows[0])
    assert max(r["params_version"] for r in actor_rows) > 0  # actors received advancing versions
    config = json.loads((d / "config.json").read_text())
    assert config["run"]["actor_bits"] == 8 and config["agent"]["policy_layers"] == [16, 16]
    assert config["run"]["port"] > 0  # picked by the launcher, kept for --resume
    assert any((d / "checkpoints").iterdir()) and any((d / "replay_checkpoints").iterdir())
    # TensorBoard (on by default): one event file per stream, holding what the CSVs hold.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(d / "tensorboard" / "learner"))
    board.Reload()
    steps = [e.step for e in board.Scalars("learner/critic_loss")]
    assert steps == [int(r["learner_steps"]) for r in learner_rows]
    for stream in ("eval", "actor_0"):
        assert list((d / "tensorboard" / stream).glob("events.out.tfevents.*")), stream


@pytest.mark.process
@pytest.mark.timeout(400)
def test_a_run_given_a_target_return_stops_at_the_first_evaluation_that_reaches_it(tmp_path):
    d = tmp_path / "run"
    # cartpole_balance pays up to 1 per step, so any trained policy's episode returns more than 1: the run stops
    # at its first evaluation after an SGD step, long before the budget.
    proc = subprocess.run([sys.executable, "experiments/run_d4pg.py", *TINY, "--num_actors", "1", "--actor_bits", "32",
                           "--eval_episodes", "2", "--stop_at_return", "1", "--max_seconds", "3000",
                           "--results_dir", str(d)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((d / "summary.json").read_text())
    reached = [e for e in summary["events"] if e.startswith("target return reached")]
    assert len(reached) == 1, summary["events"]
    assert not any("budget reached" in e for e in summary["events"]), summary["events"]
    # The evaluation it names is the first complete fp32 one after an SGD step whose mean is >= 1.
    evals = [r for r in _rows(d / "eval.csv") if r["policy"] == "fp32" and r["final"] == 0 and r["learner_steps"] >= 1]
    by_step = {}
    for r in evals:
        by_step.setdefault(r["learner_steps"], []).append(r["return"])
    first = min(step for step, returns in by_step.items() if len(returns) == 2 and sum(returns) / 2 >= 1)
    assert f"at learner step {first:,d} returned {sum(by_step[first]) / 2:.1f} >= 1 " in reached[0], reached[0]
    # The stop is an ordinary one: a final evaluation and checkpoint follow it.
    assert any(r["final"] == 1 for r in _rows(d / "eval.csv"))
    assert summary["wall_seconds"] < 3000 and summary["exit_code"] == 0
    assert json.loads((d / "config.json").read_text())["run"]["stop_at_return"] == 1.0


@pytest.mark.process
@pytest.mark.timeout(300)
def test_killed_actor_is_restarted_then_sigterm_stops_the_run_cleanly_without_orphans(tmp_path):
    results = tmp_path / "run"
    # Two environments per actor: the restarted incarnation steps both again.
    proc = start_run(results, *TINY, "--num_actors", "1", "--envs_per_actor", "2", "--max_seconds", "250",
                     "--tensorboard", "false")
    try:
        _first_episode(results, proc)
        launcher = psutil.Process(proc.pid)
        worker_process(launcher, "actor", 0).kill()
        wait_for(lambda: worker_process(launcher, "actor", 0, restart=1), 60, "actor 0's restart", proc)
        episodes = len(_rows(results / "actors" / "actor_0.csv"))
        wait_for(lambda: len(_rows(results / "actors" / "actor_0.csv")) >= episodes + 2, 150, "episodes after it", proc)
        pids = [p.pid for p in launcher.children(recursive=True)]
        assert len(pids) >= 3  # at least the learner, the actor and the evaluator (the replay service besides)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=200)
    finally:
        stop_all(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "stop requested" in out
    assert alive(pids) == [], f"processes outlived the run: {alive(pids)}"
    assert not (results / "tensorboard").exists()  # --tensorboard false writes no events
    summary = json.loads((results / "summary.json").read_text())
    assert any(e.startswith("actor_0 died") and "restart 1/3" in e for e in summary["events"])
    assert summary["learner_steps"] > 0 and summary["env_steps"] > 0
    assert json.loads((results / "config.json").read_text())["run"]["envs_per_actor"] == 2
    rows = _rows(results / "actors" / "actor_0.csv")
    # cartpole episodes are 1000 steps: both environments of an actor end at actor step 1000, env step 2000.
    assert sorted(r["env_index"] for r in rows[:2]) == [0, 1]
    assert {(r["env_steps"], r["episode_length"]) for r in rows[:2]} == {(2000, 1000)}
    assert {r["env_index"] for r in rows[episodes:]} == {0, 1}  # both environments of the new incarnation finish episodes


class _Terminal:
    """A pseudo-terminal a launcher runs in (as its controlling terminal), read as it writes, hung up by close()."""

    def __init__(self):
        self.master, self.slave = pty.openpty()
        self.output = bytearray()
        self._close = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # The reader closes the master itself: a close from another thread would not end a read blocked on it.
        while not self._close.is_set():
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:
                    break
        os.close(self.master)

    def close(self) -> None:
        """Closes the terminal's master side: the kernel hangs up on every process it controls."""
        self._close.set()
        self._reader.join(timeout=10)

    def text(self) -> str:
        return self.output.decode(errors="replace")


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_second_launcher_is_refused_a_running_runs_directory_and_a_hangup_stops_the_run_cleanly(tmp_path):
    results = tmp_path / "run"
    terminal = _Terminal()
    # A session of its own whose controlling terminal is the pseudo-terminal, as a shell's job in a terminal window.
    command = [sys.executable, "experiments/run_d4pg.py", *TINY, "--num_actors", "1", "--max_seconds", "250",
               "--tensorboard", "false", "--results_dir", str(results)]
    # SIGHUP as a shell's job has it, whatever this test process was started with (nohup would pass it on ignored).
    take_terminal = ("import fcntl, os, signal, sys, termios; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                     "fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.executable, sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", take_terminal, *command], cwd=ROOT, env=ENV, stdin=terminal.slave,
                            stdout=terminal.slave, stderr=terminal.slave, start_new_session=True)
    os.close(terminal.slave)
    try:
        _started(results, proc)
        config, launcher_status = (results / "config.json").read_bytes(), status(results, "launcher")
        # A resume of the running run, and a new run given its directory, both while it goes on.
        second = [subprocess.Popen([sys.executable, "experiments/run_d4pg.py", *flags], cwd=ROOT, env=ENV,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for flags in (["--resume", str(results), "--max_seconds", "30"],
                                [*TINY, "--results_dir", str(results), "--max_seconds", "30"])]
        (resume_out, resume_err), (new_out, new_err) = (p.communicate(timeout=120) for p in second)
        assert second[0].returncode == 2, resume_out[-2000:] + resume_err[-2000:]
        assert f"--resume: {results} is in use" in resume_err and f"pid {proc.pid}" in resume_err, resume_err[-2000:]
        assert second[1].returncode == 2, new_out[-2000:] + new_err[-2000:]
        assert "--results_dir" in new_err and ("already holds a run" in new_err or "is in use" in new_err), new_err
        assert (results / "config.json").read_bytes() == config  # not rewritten (a new port, a new resume flag)
        assert status(results, "launcher") == launcher_status and proc.poll() is None
        # The terminal window closed: the kernel hangs up on the launcher and every worker, and writing to the
        # terminal fails from then on. An orderly stop, as Ctrl-C is, not a crash.
        wait_for(lambda: status(results).get("learner_steps", 0) >= 20, 150, "the learner's first steps", proc)
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(pids) >= 4  # the service, the learner, the actor and the evaluator at least
        terminal.close()
        try:
            proc.wait(timeout=200)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no stop after the hangup:\n{terminal.text()[-3000:]}") from None
    finally:
        stop_all(proc)
        terminal.close()
    assert proc.returncode == 0, terminal.text()[-3000:]
    assert alive(pids) == [], f"processes outlived the run: {alive(pids)}"
    summary = json.loads((results / "summary.json").read_text())
    assert any(e.startswith("stop requested") for e in summary["events"]), summary["events"]
    # The final checkpoint at the last step, and the final evaluation, as at any clean stop.
    assert read_counters(results / "checkpoints")["learner_steps"] == summary["learner_steps"] >= 20
    assert any(r["final"] == 1 for r in _rows(results / "eval.csv"))


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(300)
def test_remote_actor_contributes_transitions(tmp_path):
    results = tmp_path / "run"
    proc = start_run(results, *TINY, "--num_actors", "1", "--max_seconds", "250")
    pair = {}
    try:
        address = _started(results, proc)["local_address"]
        # The id of a launcher actor is refused, naming the flag, before the actor starts.
        taken = start_remote_actor(address, tmp_path / "taken", "--actor_id", "0")
        taken_out, _ = taken.communicate(timeout=100)
        assert taken.returncode == 2 and "--actor_id 0 is one of the run's 1 launcher actors" in taken_out, taken_out[-3000:]
        assert not (tmp_path / "taken").exists()
        # Two hand-started actors given one id: one holds the id's lease, the other exits 2 naming the holder.
        # Each sizes its own environment count (the run has 1 per actor).
        pair = {d: start_remote_actor(address, d, "--actor_id", "7", "--envs_per_actor", "2", "--max_episodes", "2")
                for d in (tmp_path / "remote_a", tmp_path / "remote_b")}
        outputs = {d: p.communicate(timeout=200)[0] for d, p in pair.items()}
        codes = sorted(p.returncode for p in pair.values())
        assert codes == [0, 2], outputs
        remote_dir = next(d for d, p in pair.items() if p.returncode == 0)
        refused = next(out for d, out in outputs.items() if d != remote_dir)
        assert len(re.findall(r"--actor_id 7 is held by another actor \([^)]+:\d+\)", refused)) == 1, refused[-3000:]
        assert "Traceback" not in refused
        # The refused twin never opened the id's results file: the holder's rows are the holder's alone.
        assert not (next(d for d in pair if d != remote_dir) / "actor_7.csv").exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=200)
    finally:
        stop_all(proc, *pair.values())
    assert proc.returncode == 0, out[-3000:]
    remote_rows = _rows(remote_dir / "actor_7.csv")
    # Two full cartpole episodes, one per environment, ending together at 2 x 1000 env steps.
    assert sorted(r["env_index"] for r in remote_rows) == [0, 1]
    assert {(r["env_steps"], r["episode_length"]) for r in remote_rows} == {(2000, 1000)}
    # Its rows travelled through the replay service into the run's results directory; the refused twin's none.
    assert _rows(results / "actors" / "actor_7.csv") == remote_rows
    summary = json.loads((results / "summary.json").read_text())
    local_logged = sum(r["episode_length"] for r in _rows(results / "actors" / "actor_0.csv"))
    assert summary["env_steps"] >= local_logged + 2000


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--actor_bits", "12"], "--actor_bits"),
        (["--comm_bits", "1"], "--comm_bits"),
        (["--num_actors", "0"], "--num_actors"),
        (["--seed", "-3"], "--seed: must be in 0..4294967295, got -3"),
        (["--seed", str(2**32)], "--seed: must be in 0..4294967295"),
        (["--task", "no_such_task"], "--task"),
        (["--task", "CartPole-v1"], "--task: CartPole-v1 has 2 discrete actions; d4pg needs a task with continuous"),
        (["--policy_layers", "64,x"], "--policy_layers"),
        (["--granularity", "per_row"], "--granularity"),
        (["--actor_backend", "fp32", "--actor_bits", "8"], "--actor_backend"),
        (["--country", "XXX"], "--country: unknown country code 'XXX'; codecarbon knows ISO 3166-1 alpha-3"),
        (["--stop_at_return", "nan"], "--stop_at_return: must be a finite return, got nan"),
        (["--task", "lqr_lqr_2_1"], "--task: lqr_lqr_2_1 has unbounded actions (minimum -1e+10, maximum 1e+10); "
                                    "d4pg needs finite action bounds"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, named, tmp_path, capsys):
    err = usage_error(capsys, lambda: parse_run("d4pg", [*flags, "--results_dir", str(tmp_path / "r")]))
    assert named in err
    assert not (tmp_path / "r").exists()  # nothing started


def test_a_task_that_cannot_start_here_is_a_usage_error_before_any_worker(tmp_path, capsys):
    # quadruped_escape draws its terrain with OpenGL at reset; without it (the suite sets MUJOCO_GL=disable)
    # every worker failed the same way.
    err = usage_error(capsys, lambda: parse_run("d4pg", ["--task", "quadruped_escape", "--results_dir",
                                                         str(tmp_path / "r")]))
    assert "--task: quadruped_escape cannot start on this machine" in err and "MUJOCO_GL=egl" in err
    assert not (tmp_path / "r").exists()


def test_an_agent_given_a_task_of_the_other_action_kind_is_a_usage_error(tmp_path, capsys):
    err = usage_error(capsys, lambda: parse_run("dqn", ["--task", "cartpole_balance", "--results_dir",
                                                        str(tmp_path / "r")]))
    assert "--task: cartpole_balance has 1 continuous action(s); dqn needs a task with discrete actions" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_script_exits_2_naming_a_bad_flag_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "experiments/run_d4pg.py", "--actor_bits", "12", "--results_dir",
                           str(tmp_path / "r")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert "--actor_bits" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script("run_d4pg").main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--task", "--seed", "--num_actors", "--actor_bits", "--comm_bits", "--granularity", "--actor_backend",
                 "--policy_layers", "--critic_layers", "--update_period", "--max_env_steps", "--max_learner_steps",
                 "--max_seconds", "--results_dir", "--country", "--resume"):
        assert flag in out, flag


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_second_stop_request_kills_the_workers_at_once_and_keeps_what_was_written(tmp_path):
    results = tmp_path / "run"
    # A final evaluation of 200 episodes a policy takes minutes: the orderly stop is still waiting on it.
    proc = start_run(results, *TINY, "--num_actors", "1", "--eval_episodes", "200", "--eval_period", "100000",
                     "--max_seconds", "250", "--tensorboard", "false")
    try:
        wait_for(lambda: status(results).get("learner_steps", 0) >= 50, 150, "50 learner steps", proc)
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        # The learner has written its final checkpoint; the launcher waits on the evaluator's final evaluation.
        wait_for(lambda: status(results, "launcher").get("learner_ended"), 150, "the learner's end", proc)
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - asked
    finally:
        stop_all(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "interrupt again to stop at once" in out and "second stop request: killing the workers now" in out
    assert took < 30, f"{took:.0f} s from the second request to the launcher's exit"
    assert alive(pids) == [], f"processes outlived the run: {alive(pids)}"
    summary = json.loads((results / "summary.json").read_text())
    final = read_counters(results / "checkpoints")
    assert summary["exit_code"] == 1 and summary["learner_steps"] == final["learner_steps"] >= 50
    assert not any(r["final"] == 1 for r in _rows(results / "eval.csv"))  # the final evaluation was cut short


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(600)
def test_resume_continues_learner_steps_and_env_steps(tmp_path):
    results = tmp_path / "run"
    base = [sys.executable, "experiments/run_d4pg.py"]
    first = subprocess.run([*base, *TINY, "--num_actors", "1", "--envs_per_actor", "2", "--max_learner_steps", "100",
                            "--results_dir", str(results)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    before = json.loads((results / "summary.json").read_text())
    second = subprocess.run([*base, "--resume", str(results), "--max_learner_steps", "200"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=280)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    after = json.loads((results / "summary.json").read_text())
    assert before["learner_steps"] == 100 and after["learner_steps"] == 200
    assert json.loads((results / "config.json").read_text())["run"]["envs_per_actor"] == 2  # kept by --resume
    assert after["env_steps"] > before["env_steps"]  # the counter carries on from the checkpoint
    steps = [r["learner_steps"] for r in _rows(results / "learner.csv")]
    assert steps == [100, 200]  # one stream, continued rather than restarted
    # The port is part of the run: a resume whose port is taken says so and starts nothing.
    port = json.loads((results / "config.json").read_text())["run"]["port"]
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the run's connections may linger in TIME_WAIT
        holder.bind(("127.0.0.1", port))
        holder.listen()
        third = subprocess.run([*base, "--resume", str(results), "--max_learner_steps", "300"], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=200)
    assert third.returncode == 1 and f"port {port}" in third.stderr and "taken" in third.stderr, third.stderr[-2000:]
    failed = json.loads((results / "summary.json").read_text())
    assert failed["learner_steps"] == 200 and failed["counters_from"] == "checkpoint at learner step 200"
    # A damaged newest checkpoint is passed over for the one before it, said, and kept aside.
    _damage_checkpoint(results / "checkpoints" / "200")
    fourth = subprocess.run([*base, "--resume", str(results), "--max_learner_steps", "250"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=200)
    assert fourth.returncode == 0, fourth.stdout[-2000:] + fourth.stderr[-2000:]
    assert "resumed at learner step 100" in fourth.stderr and "checkpoint at step 200 could not be read" in fourth.stderr
    assert (results / "checkpoints" / "200.unreadable").is_dir()
    assert json.loads((results / "summary.json").read_text())["learner_steps"] == 250
    # None readable: the learner says why without a traceback and the run stops at once, not restarting it.
    for step in finished_steps(results / "checkpoints"):
        _damage_checkpoint(results / "checkpoints" / str(step))
    fifth = subprocess.run([*base, "--resume", str(results), "--max_learner_steps", "300"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=200)
    assert fifth.returncode == 1 and "learner ended before starting (exit code 2)" in fifth.stderr, fifth.stderr[-2000:]
    assert "no learner checkpoint in" in fifth.stderr and "restart 1/" not in fifth.stderr
    assert "Traceback" not in fifth.stderr  # the learner log's tail is in it


def _damage_checkpoint(step_dir: Path) -> None:
    """Empties the data files of a learner checkpoint's state, as a full disk or a bad copy leaves them."""
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")


# The launcher's run, with its port pick handed to a socket this wrapper holds and the pre-start check blinded,
# so the replay service's bind is what finds the port taken (another process won the race after the pick).
_PORT_RACE = """
import socket, sys
from actorq_jax import net
from actorq_jax.launch import runtime
held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen(1)
picks = iter([held.getsockname()[1]])
real_free_port = runtime.free_port
runtime.free_port = lambda: next(picks, None) or real_free_port()
net.port_in_use = lambda port: False
# The workers' template as a process of its own: forked from here, the workers would inherit the patches above.
from actorq_jax.launch import forker
forker.can_fork_here = lambda: False
from actorq_jax.launch.launcher import run_experiment
sys.exit(run_experiment("d4pg", sys.argv[1:]))
"""


@pytest.mark.process
@pytest.mark.timeout(400)
def test_a_picked_port_taken_before_the_service_binds_it_is_picked_again(tmp_path):
    d = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _PORT_RACE, *TINY, "--num_actors", "1", "--max_learner_steps", "100",
                           "--results_dir", str(d)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["learner_steps"] == 100 and summary["env_steps"] > 0
    moved = [e for e in summary["events"] if "was taken before the replay service could bind it" in e]
    assert len(moved) == 1, summary["events"]
    port = json.loads((d / "config.json").read_text())["run"]["port"]
    assert f"starting again on port {port}" in moved[0]  # the config names the port the run used


def test_the_eval_watch_judges_only_complete_evaluations_after_an_sgd_step(tmp_path):
    from actorq_jax.launch.launcher import EvalWatch

    path = tmp_path / "eval.csv"
    header = "wall_seconds,env_steps,learner_steps,policy,bits,episode,return,final\n"
    watch = EvalWatch(path, 500.0, episodes=2)
    watch.poll()  # no file yet
    assert watch.last_return() == "-" and watch.reach is None
    # The untrained policy's evaluation never counts; the second evaluation has one of its two episodes in.
    path.write_text(header + "1.0,0,0,fp32,32,0,900.0,0\n1.5,0,0,fp32,32,1,900.0,0\n"
                    "5.0,4000,100,fp32,32,0,800.0,0\n")
    watch.poll()
    assert watch.last_return() == "800.0" and watch.reach is None
    with open(path, "a") as f:  # its second episode: mean 450, below the target; the actors' policy row is not fp32
        f.write("5.5,4000,100,fp32,32,1,100.0,0\n5.7,4000,100,actor,8,0,990.0,0\n9.0,8000,200,fp32,32,0,600.0,0\n")
    watch.poll()
    assert watch.last_return() == "600.0" and watch.reach is None
    with open(path, "a") as f:
        f.write("9.5,8000,200,fp32,32,1,400.0,0\n")
    watch.poll()
    # An evaluation's time is its last episode's.
    assert (watch.reach.learner_steps, watch.reach.wall_seconds, watch.reach.eval_return) == (200, 9.5, 500.0)
    # Without a target the watch only follows the returns.
    plain = EvalWatch(path, None, episodes=2)
    plain.poll()
    assert plain.last_return() == "400.0" and plain.reach is None


def test_the_replay_window_watch_says_once_when_a_min_size_table_sits_at_its_floor_while_the_learner_steps():
    from actorq_jax.agents.d4pg.config import D4PGConfig
    from actorq_jax.launch.launcher import ReplayWindowWatch

    config = D4PGConfig(rate_limiter="min_size", max_times_sampled=8, min_replay_size=1000,
                        batch_size=256)
    watch = ReplayWindowWatch(config, hold_s=60.0)
    # Filling before the first SGD step, then a table above its floor (more than a batch over it): nothing to say.
    assert watch.update(0.0, 0, 400) is None and watch.update(70.0, 0, 1000) is None
    assert watch.update(80.0, 50, 1257) is None and watch.update(150.0, 900, 5000) is None
    # Back at the floor (within a batch, 256 here, or a tenth of it), the learner stepping: said once the hold has passed.
    assert watch.update(160.0, 1000, 1040) is None
    assert watch.update(219.0, 1500, 998) is None  # 59 s
    said = watch.update(221.0, 1520, 1003)
    assert said and "1,000 items (--min_replay_size) for 61 s" in said and "its 8 samples" in said, said
    assert "--min_replay_size widens it" in said
    assert watch.update(400.0, 3000, 1000) is None  # once per run
    # The clock starts again when the window widens for a moment.
    watch = ReplayWindowWatch(config, hold_s=60.0)
    for now, steps, items in ((0.0, 10, 1000), (50.0, 60, 1300), (100.0, 110, 1000)):
        assert watch.update(now, steps, items) is None
    assert watch.update(159.0, 160, 1000) is None and watch.update(161.0, 170, 1000)
    # A learner that stopped stepping at the floor (its actors gone) is not drawing batches from it.
    stalled = ReplayWindowWatch(config, hold_s=60.0)
    assert stalled.update(0.0, 500, 999) is None and stalled.update(100.0, 500, 999) is None
    # The ratio regime keeps every item until the table is full: never said; nor without a size in the report.
    ratio = ReplayWindowWatch(D4PGConfig(min_replay_size=1000), hold_s=60.0)
    assert ratio.update(0.0, 10, 1000) is None and ratio.update(100.0, 500, 1000) is None
    assert ReplayWindowWatch(config, hold_s=60.0).update(0.0, 10, None) is None
    # A floor at the table's capacity: the window is the whole table asked for, not a narrow one.
    full = ReplayWindowWatch(dataclasses.replace(config, min_replay_size=2000, max_replay_size=2100), hold_s=60.0)
    assert full.update(0.0, 10, 2000) is None and full.update(100.0, 500, 2000) is None
