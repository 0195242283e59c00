"""The replay service: the run's Reverb server as a process of its own.

As in the paper's topology, one process owns the run's Reverb server (the replay
table, the variables tables the learner publishes into, the config table remote
actors read, the remote actors' episode rows, which it writes into actors/) and the learner is one client of it
among the actors and the evaluator. Under `--launcher ray` the server also carries the
run's status reports (launch/channel.py) and the rows the launcher's process writes.
The learner can then be killed, restarted or
placed on an accelerator node without taking replay with it, and the server gets
cores the learner's SGD does not need (`--layout pinned`).

Checkpoints of the tables are written by the service, on the learner's request
(`ServiceClient.checkpoint`, a JSON message through a control table): the learner
drains the actors' rows, asks for `step_N`, then saves its own state naming that
replay checkpoint. A service that starts with `resume` (a `--resume`, or the
launcher restarting a dead service on the same port) loads the replay checkpoint
named by the learner's newest checkpoint, so learner state and replay stay a
consistent pair; the learner and actors reconnect to it on their own.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from actorq_jax.launch import runtime
from actorq_jax.launch.channel import RunChannel, make_channel
from actorq_jax.launch.checkpoint import finished_steps, read_counters
from actorq_jax.launch.leases import LEASE_REQUESTS, LEASES_TABLE, LeaseBook, lease_tables
from actorq_jax.net import LOOPBACK
from actorq_jax.run_dir import RunDir

log = logging.getLogger(__name__)

REQUESTS_TABLE = "service_requests"
REPLIES_TABLE = "service_replies"
REPORT_EVERY_S = 0.5
POLL_S = 0.05
# After a stop request, how long the service stays up for a learner still finishing its last checkpoint
# (the launcher stops the learner first; a killed launcher signals every worker at once).
LEARNER_FINAL_GRACE_S = 60.0
# The same when the launcher is gone: nobody waits for the run, so the workers leave within seconds.
ORPHAN_LEARNER_GRACE_S = 20.0
# A checkpoint's time grows with the table: about 44 s for a million walker transitions on a core shared
# with the actors (2-core Zen 5). A checkpoint request waits this much per item beyond the usual timeout.
CHECKPOINT_S_PER_ITEM = 1e-4


class ServiceError(RuntimeError):
    """The replay service refused a request, or did not answer it in time."""


def control_tables() -> List[Any]:
    """The service's control tables: requests to it, and its replies."""
    from actorq_jax.launch.channel import make_status_tables
    from actorq_jax.replay.messages import make_message_table

    return [make_message_table(REQUESTS_TABLE), make_message_table(REPLIES_TABLE), *make_status_tables()]


def restore_points(results_dir: Path) -> List[str]:
    """The replay checkpoints named by the learner's kept checkpoints, newest first (written ones only)."""
    run_dir = RunDir(results_dir)
    names: List[str] = []
    for step in reversed(finished_steps(run_dir.checkpoints)):
        name = (read_counters(run_dir.checkpoints, step) or {}).get("replay_checkpoint")
        if name and name not in names and (run_dir.replay_checkpoints / name / "DONE").exists():
            names.append(str(name))
    return names


class ServiceClient:
    """A worker's handle on the replay service's control requests."""

    def __init__(self, client: Any, timeout_s: float):
        self._client = client
        self.timeout_s = float(timeout_s)

    def checkpoint(self, name: str, keep: Sequence[str], items: int = 0) -> Dict[str, Any]:
        """Has the service write its tables to replay checkpoint `name` and delete those not in `keep`; its reply.

        `items`: about how many the replay table holds; writing them takes time, which the wait allows for.
        """
        return self.request(checkpoint_request(name, keep), self.checkpoint_timeout_s(items))

    def checkpoint_timeout_s(self, items: int) -> float:
        """How long a checkpoint of a table of about `items` items may take."""
        return self.timeout_s + CHECKPOINT_S_PER_ITEM * max(0, items)

    def send(self, message: Dict[str, Any]) -> str:
        """Sends one request without waiting; its id, for `poll`."""
        from actorq_jax.replay.messages import send_message

        request_id = uuid.uuid4().hex
        send_message(self._client, REQUESTS_TABLE, {**message, "id": request_id},
                     self.timeout_s)
        return request_id

    def poll(self, request_id: str, op: str) -> Optional[Dict[str, Any]]:
        """The reply to request `request_id` if it has come (one look), else None; ServiceError on a refusal."""
        import reverb

        from actorq_jax.replay.messages import take_messages

        try:
            replies = take_messages(self._client, REPLIES_TABLE)
        except reverb.DeadlineExceededError:
            # The server did not answer the look within its few seconds: it may be busy (writing a large
            # checkpoint) or gone; the request's own deadline decides, not one look.
            return None
        # Replies to requests of an earlier learner process (killed while waiting) are skipped.
        for reply in replies:
            if reply.get("id") == request_id:
                if reply.get("error"):
                    raise ServiceError(f"replay service refused {op!r}: {reply['error']}")
                return reply
        return None

    def request(self, message: Dict[str, Any], timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Sends one request and waits for its reply (up to `timeout_s`, default the client's timeout);
        ServiceError on a refusal or past the timeout."""
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        op = str(message.get("op"))
        request_id = self.send(message)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.poll(request_id, op)
            if reply is not None:
                return reply
            time.sleep(POLL_S)
        raise ServiceError(f"replay service did not answer {op!r} within {timeout_s:g} s")


def checkpoint_request(name: str, keep: Sequence[str]) -> Dict[str, Any]:
    """The request that has the service write replay checkpoint `name` and delete those not in `keep`."""
    return {"op": "checkpoint", "name": name, "keep": [k for k in keep if k]}


class ReplayService:
    """The Reverb server of a run and the loop that answers its control requests."""

    def __init__(self, builder: Any, run: Any, results_dir: Path, config_json: str, resume: bool,
                 replay: Any = None):
        from actorq_jax.launch.actor_rows import ACTOR_ROWS_TABLE, ROWS_WRITTEN_TABLE, RowDrain
        from actorq_jax.replay import ReplayServer
        from actorq_jax.replay.server import UNREADABLE_SUFFIX, ReplayCheckpointUnreadable

        self.run = run
        self.results_dir = Path(results_dir)
        self.replay_table = builder.replay_config().name
        # What other machines use to reach this server. A local run's processes all share this machine, so
        # it advertises the loopback (a remote actor is given --server by hand); under Ray the host of the
        # service sets advertise_host to its node's IP.
        host = run.advertise_host or LOOPBACK
        checkpoints = RunDir(self.results_dir).replay_checkpoints
        unreadable: List[str] = []
        # The newest replay checkpoint pairs with the learner's newest; one that does not load is set aside for
        # the one before it, and with none left the table starts empty (the learner's state is its own).
        for restore in [*(restore_points(self.results_dir) if resume else []), None]:
            try:
                self.server = ReplayServer(runtime.service_tables(builder, replay) + control_tables() + lease_tables(),
                                           port=run.port or None, advertised_host=host, checkpoint_dir=checkpoints,
                                           restore=restore)
                break
            except ReplayCheckpointUnreadable as error:
                log.warning("%s; kept as %s%s", error, restore, UNREADABLE_SUFFIX)
                aside = checkpoints / f"{restore}{UNREADABLE_SUFFIX}"
                shutil.rmtree(aside, ignore_errors=True)
                (checkpoints / str(restore)).rename(aside)
                unreadable.append(str(restore))
        self.client = self.server.client()
        # Rows and requests a restored table holds were answered before the crash (each checkpoint drains
        # the rows first, and a request is answered after its checkpoint is written).
        # Leases are learned again from the actors' next renewals.
        # Acknowledgements are rebuilt from the rows in actors/ (RowDrain reads them back).
        # The policies are the checkpoint's, older than what the learner has published since: actors would step
        # back to them and the evaluator would evaluate them again. The learner publishes both when it starts
        # (a restart, a --resume) and a live one within its publication periods; until then actors keep theirs.
        for table in (ACTOR_ROWS_TABLE, ROWS_WRITTEN_TABLE, REQUESTS_TABLE, REPLIES_TABLE, LEASE_REQUESTS, LEASES_TABLE,
                      runtime.VARIABLES_TABLE, runtime.EVAL_VARIABLES_TABLE):
            self.client.reset(table)
        runtime.publish_config(self.client, config_json)
        # Status reports: files locally, this server's status tables under Ray.
        self.channel = make_channel(run, self.results_dir, f"{LOOPBACK}:{self.server.port}")
        # Remote actors' episode rows, into actors/ as the launcher's actors write theirs. Under Ray the
        # launcher's process drains them (every actor sends its rows then), into the real results directory.
        self.rows = None if run.launcher == "ray" else RowDrain(self.client, RunDir(self.results_dir).actors,
                                                                 run.num_actors)
        self.leases = LeaseBook(self.client)
        self.restored = {"checkpoint": restore, "items": self.items(), "unreadable": unreadable}
        # Tells this service apart from the one it replaced on the same port (whose unanswered requests are gone).
        self.incarnation = uuid.uuid4().hex
        self._stopped = False
        # Restored from a checkpoint, the insert count goes back to the checkpoint's; the run's env-step count
        # goes on from this service's last report instead (the steps since were taken, though their items are lost).
        last = self.channel.read("replay").get("env_steps", 0) if resume else 0
        self._env_steps_offset = max(0, int(last) - self._inserts())
        self.checkpoints = 0
        self.beats = 0

    def items(self) -> int:
        """Items in the replay table now."""
        return int(self.client.server_info(timeout=30)[self.replay_table].current_size)

    def _inserts(self) -> int:
        return int(self.client.server_info(timeout=5)[self.replay_table].rate_limiter_info.insert_stats.completed)

    def env_steps(self) -> int:
        """Env steps of the run: transitions inserted into replay, going on across this service's restarts."""
        return self._inserts() + self._env_steps_offset

    def answer_requests(self) -> int:
        """Answers every waiting control request; how many."""
        from actorq_jax.replay.messages import send_message, take_messages

        answered = 0
        for request in take_messages(self.client, REQUESTS_TABLE):
            send_message(self.client, REPLIES_TABLE, self._answer(request), timeout_s=30.0)
            answered += 1
        return answered

    def _answer(self, request: Dict[str, Any]) -> Dict[str, Any]:
        from actorq_jax.replay.server import prune_checkpoints

        reply: Dict[str, Any] = {"id": request.get("id")}
        if request.get("op") != "checkpoint":
            return {**reply, "error": f"unknown request {request.get('op')!r}"}
        # Rows in a checkpoint are reset on restore: write the waiting ones first.
        self.drain_rows()
        # The write holds this loop, and so its reports, for as long as the table takes: the launcher's
        # watch of this service allows for it.
        self.report("checkpointing")
        try:
            name = self.server.checkpoint(str(request.get("name")))
        except (ValueError, OSError) as error:
            return {**reply, "error": str(error)}
        prune_checkpoints(self.server.checkpoint_dir, [name, *request.get("keep", [])])
        self.checkpoints += 1
        return {**reply, "name": name, "items": self.items()}

    def drain_rows(self) -> None:
        """Writes the remote actors' waiting rows into actors/ (under Ray the launcher's process does)."""
        if self.rows is not None:
            self.rows.drain()

    def serve_once(self) -> None:
        """Answers the waiting control requests and lease requests."""
        self.answer_requests()
        self.leases.handle()

    def serve_in_thread(self, stop: threading.Event) -> threading.Thread:
        """Serves (requests, leases, actor rows) from a started background thread until `stop`."""
        def loop() -> None:
            last_drain = 0.0
            while not stop.is_set():
                self.serve_once()
                if time.monotonic() - last_drain >= REPORT_EVERY_S:
                    self.drain_rows()
                    last_drain = time.monotonic()
                stop.wait(POLL_S)

        thread = threading.Thread(target=loop, name="ReplayService", daemon=True)
        thread.start()
        return thread

    def report(self, phase: str) -> None:
        """Reports to the launcher through the run's channel (address, counters, the restore)."""
        self.beats += 1
        self.channel.report("replay", {
            "phase": phase,
            "beat": self.beats,  # the launcher tells a live service from a stopped or hung one by it
            "pid": os.getpid(),
            "address": self.server.address,
            "local_address": f"{LOOPBACK}:{self.server.port}",
            "env_steps": self.env_steps(),
            "items": self.items(),
            "checkpoints": self.checkpoints,
            "restored": self.restored,
            "incarnation": self.incarnation,
        })

    def stop(self) -> None:
        """Writes the last waiting actor rows and stops the server (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.drain_rows()
        finally:
            if self.rows is not None:
                self.rows.close()
            self.server.stop()


def run_replay_service(run: Any, agent_config: Any, config_json: str, stop: threading.Event,
                       resume: bool = False, launcher_alive: Callable[[], bool] = lambda: True) -> None:
    """Serves the run's tables and answers control requests until `stop`."""
    import reverb

    from actorq_jax.environments import environment_spec, make_environment

    spec = environment_spec(make_environment(run.task, seed=run.seed))
    service = ReplayService(runtime.make_builder(run.agent, agent_config, spec), run, Path(run.results_dir),
                            config_json, resume=resume or run.resume)
    log.info("replay service on %s (restored: %s)", service.server.address, service.restored)
    last_report = 0.0
    try:
        while not stop.is_set():
            try:
                service.serve_once()
                if time.monotonic() - last_report >= REPORT_EVERY_S:
                    service.drain_rows()
                    service.report("running")
                    last_report = time.monotonic()
            except reverb.DeadlineExceededError:
                # Its own server is starved of CPU: answer on the next pass.
                log.warning("the replay server was slow to answer its own service loop")
            stop.wait(POLL_S)
        _serve_until_learner_done(service, LEARNER_FINAL_GRACE_S if launcher_alive() else ORPHAN_LEARNER_GRACE_S)
        service.report("done")
    finally:
        service.stop()


def _learner_running(channel: RunChannel) -> bool:
    """Whether this run's learner is still at work (its last report is not final, and its process lives)."""
    import psutil

    report = channel.read("learner")
    if not report or report.get("phase") == "done":
        return False
    # Only meaningful on the learner's own machine; elsewhere the grace period bounds the wait.
    return bool(report.get("pid")) and psutil.pid_exists(int(report["pid"]))


def _serve_until_learner_done(service: ReplayService, grace_s: float) -> None:
    """Answers requests until the learner has written its final checkpoint, or `grace_s` passes."""
    deadline = time.monotonic() + grace_s
    while _learner_running(service.channel) and time.monotonic() < deadline:
        service.answer_requests()
        time.sleep(POLL_S)
