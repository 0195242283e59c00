"""One id, one actor: leases on actor ids, held at the replay service.

Two hand-started actors given the same `--actor_id` would interleave their rows in
one results file. So an actor asks the service for a lease on its id before it
acts: a JSON request into the LEASE_REQUESTS table (holder = host:pid, a random
token, a time to live). The service grants it when the id is free, expired, already
this token's, or when the request takes the slot over (the launcher restarting its
own actor), and publishes every lease in the LEASES_TABLE, a size-1 table all
actors read. The actor renews its lease while it runs and releases it at exit; a
lease not renewed within its time to live expires (its holder died), and a
restarted service learns the leases again from the next renewals.

Renewals come from a thread of their own, which would keep renewing for an actor
whose main loop hangs in a call that never returns (the thread runs whenever the
stuck call releases the GIL). So the actor's main loop beats (`IdLease.beat`) on
every step and in every bounded wait, and a lease whose beats stop for `hang_s`
is given back, and the actor exits with EXIT_HUNG (its launcher restarts it; a
hand-started one frees its id for a replacement).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional

log = logging.getLogger(__name__)

LEASE_REQUESTS = "lease_requests"
LEASES_TABLE = "leases"
LEASE_TTL_S = 10.0
# Renewals per time to live: a lease survives two lost renewals.
RENEWALS_PER_TTL = 3
# How long an actor's main loop may go without a beat by default (--actor_hang_s): far beyond its longest
# legitimate silence (one policy call or environment step on a loaded machine), while every wait of its loop
# beats. Its policy compiles before the lease is taken (Actor.connect), so a compile never counts.
ACTOR_HANG_S = 120.0
REFUSALS_KEPT_S = 60.0
# A wait that overran its period by more than this was a stopped process (Ctrl-Z, SIGSTOP), not a slow one.
PAUSE_SLACK_S = 5.0


class IdTaken(RuntimeError):
    """Another live actor holds the lease on this actor id."""


def lease_tables() -> list:
    """The service's lease tables: requests to it, and the leases it grants (newest state only)."""
    from actorq_jax.replay import make_variables_table
    from actorq_jax.replay.messages import make_message_table

    return [make_message_table(LEASE_REQUESTS), make_variables_table(LEASES_TABLE)]


class LeaseBook:
    """The service's side: grants, renews, releases and expires leases, and publishes them."""

    def __init__(self, client: Any, clock: Any = time.monotonic):
        self._client = client
        self._clock = clock
        self._leases: Dict[int, Dict[str, Any]] = {}
        # Requests refused lately (token -> holder, when): the asker learns why, not only that it waits.
        self._refused: Dict[str, Any] = {}
        self._published: Optional[str] = None

    def handle(self) -> None:
        """Applies every waiting request and publishes the leases when they changed."""
        from actorq_jax.replay.messages import take_messages

        for request in take_messages(self._client, LEASE_REQUESTS):
            try:
                self._apply(request)
            except (KeyError, TypeError, ValueError) as error:
                log.warning("ignored a malformed lease request %r: %s", request, error)
        now = self._clock()
        self._refused = {t: r for t, r in self._refused.items() if now - r[1] < REFUSALS_KEPT_S}
        for actor_id in [i for i, lease in self._leases.items() if lease["expires"] <= now]:
            log.info("lease on actor id %d of %s expired", actor_id, self._leases[actor_id]["holder"])
            del self._leases[actor_id]
        self._publish()

    def _apply(self, request: Dict[str, Any]) -> None:
        actor_id, token = int(request["actor_id"]), str(request["token"])
        held = self._leases.get(actor_id)
        if request.get("release"):
            if held is not None and held["token"] == token:
                del self._leases[actor_id]
            return
        now = self._clock()
        if held is None or held["expires"] <= now or held["token"] == token or request.get("takeover"):
            self._leases[actor_id] = {"holder": str(request["holder"]), "token": token,
                                      "expires": now + float(request["ttl_s"])}
        else:
            self._refused[token] = (held["holder"], now)

    def _publish(self) -> None:
        import numpy as np

        state = json.dumps({
            "leases": {str(i): {"holder": lease["holder"], "token": lease["token"]}
                       for i, lease in sorted(self._leases.items())},
            "refused": {token: holder for token, (holder, _) in sorted(self._refused.items())}})
        if state != self._published:
            self._client.insert([np.frombuffer(state.encode(), np.uint8)], {LEASES_TABLE: 1.0})
            self._published = state


def read_leases(client: Any, timeout_s: int = 5) -> Dict[str, Any]:
    """What the service published: {"leases": {actor_id: {holder, token}}, "refused": {token: holder}}."""
    from actorq_jax.replay.messages import sample_one

    if int(client.server_info(timeout=timeout_s)[LEASES_TABLE].current_size) == 0:
        return {"leases": {}, "refused": {}}
    sample = sample_one(client, LEASES_TABLE, timeout_s)
    state = json.loads(bytes(sample.data[0]).decode())
    return {"leases": {int(k): v for k, v in state["leases"].items()}, "refused": state["refused"]}


class IdLease:
    """An actor's lease on its id: acquire() before acting, renewed in the background, release() at exit."""

    def __init__(self, address: str, actor_id: int, takeover: bool = False, ttl_s: float = LEASE_TTL_S,
                 hang_s: float = ACTOR_HANG_S, on_hang: Optional[Callable[[float], None]] = None):
        self.address = address
        self.actor_id = int(actor_id)
        self.takeover = takeover
        self.ttl_s = float(ttl_s)
        self.hang_s = float(hang_s)
        # Called from the renewal thread with the main loop's silence once it passed hang_s (default: exit).
        self.on_hang = on_hang if on_hang is not None else exit_hung
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._beat_at = time.monotonic()

    def beat(self) -> None:
        """Tells the lease the actor's main loop is making progress (cheap: call it on every step)."""
        self._beat_at = time.monotonic()

    def _send(self, client: Any, release: bool = False) -> None:
        from actorq_jax.replay.messages import send_message

        send_message(client, LEASE_REQUESTS, {
            "actor_id": self.actor_id, "holder": self.holder, "token": self.token, "ttl_s": self.ttl_s,
            "takeover": self.takeover, "release": release}, timeout_s=5.0)

    def acquire(self, timeout_s: float = 30.0) -> None:
        """Takes the lease (then renews it in the background); IdTaken naming the holder when another has it."""
        import reverb

        client = reverb.Client(self.address)
        try:
            tables = client.server_info(timeout=max(1, int(timeout_s)))
        except reverb.DeadlineExceededError:
            raise TimeoutError(f"the replay service at {self.address} did not answer within {timeout_s:g} s, before "
                               f"the lease on actor id {self.actor_id} was asked for") from None
        if LEASE_REQUESTS not in tables:
            # A bare Reverb server (a test's or a benchmark's), not a replay service: there is no one to ask.
            log.warning("the server at %s keeps no actor-id leases; actor id %d goes unguarded",
                        self.address, self.actor_id)
            return
        deadline = time.monotonic() + timeout_s
        sent = False
        while time.monotonic() < deadline:
            try:
                if not sent:
                    self._send(client)
                    sent = True
                state = read_leases(client, timeout_s=max(1, min(5, int(deadline - time.monotonic()))))
            except (reverb.DeadlineExceededError, RuntimeError) as error:
                # The service restarting: the request is sent again to the new one, until the deadline.
                log.debug("the lease request or its answer failed: %s", error)
                client, sent = reverb.Client(self.address), False
                time.sleep(0.2)
                continue
            lease = state["leases"].get(self.actor_id)
            if lease is not None and lease["token"] == self.token:
                self._beat_at = time.monotonic()  # the main loop's silence counts from here
                self._thread = threading.Thread(target=self._renew, name="IdLease", daemon=True)
                self._thread.start()
                return
            if self.token in state["refused"]:
                raise IdTaken(f"--actor_id {self.actor_id} is held by another actor ({state['refused'][self.token]}); "
                              f"pick another id, or wait {self.ttl_s:g} s after that actor is gone")
            time.sleep(0.05)
        raise TimeoutError(f"the replay service at {self.address} did not answer the lease on actor id "
                           f"{self.actor_id} within {timeout_s:g} s")

    def _renew(self) -> None:
        import reverb

        client = reverb.Client(self.address)
        # Woken often enough to notice a hang within half of hang_s, whatever the time to live.
        period = min(self.ttl_s / RENEWALS_PER_TTL, self.hang_s / 2)
        waited_from = time.monotonic()
        while not self._stop.wait(period):
            woke = time.monotonic()
            if woke - waited_from > period + PAUSE_SLACK_S:
                # This thread did not run for that long: the whole process was stopped (Ctrl-Z, SIGSTOP), its
                # main loop with it. That silence is not a hang: it counts from now.
                self._beat_at = max(self._beat_at, woke)
            quiet = woke - self._beat_at
            if quiet > self.hang_s:
                log.error("actor id %d: its main loop has made no progress for %.0f s (--actor_hang_s %g): it is "
                          "hung; giving the id back and exiting", self.actor_id, quiet, self.hang_s)
                try:
                    self._send(client, release=True)
                except (reverb.DeadlineExceededError, RuntimeError) as error:
                    log.debug("lease release failed (it expires instead): %s", error)
                self.on_hang(quiet)
                return
            try:
                self._send(client)
            except (reverb.DeadlineExceededError, RuntimeError) as error:
                # The service is away; the actor's own link decides whether to give up. A fresh client next time.
                log.debug("lease renewal failed: %s", error)
                client = reverb.Client(self.address)
            waited_from = time.monotonic()

    def release(self, tell_server: bool = True) -> None:
        """Stops renewing and gives the id back (best effort: an unreleased lease expires).

        `tell_server=False` when the service is known to be gone: the release message would only wait out its
        timeout, delaying the exit of an actor whose one line already said why it stops.
        """
        import reverb

        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=1.0)
        self._thread = None
        if not tell_server:
            return
        try:
            self._send(reverb.Client(self.address), release=True)
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            log.debug("lease release failed (it expires instead): %s", error)


def exit_hung(quiet_s: float) -> None:
    """Ends this process at once with EXIT_HUNG: its main thread is stuck, so it cannot return to exit."""
    import sys

    from actorq_jax.launch.runtime import EXIT_HUNG

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more to say there
            pass
    os._exit(EXIT_HUNG)
