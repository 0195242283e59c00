"""One id, one actor: leases on actor ids at a real Reverb server (in this process)."""

import threading
import time

import pytest
import reverb

from actorq_jax.launch.leases import IdLease, IdTaken, LeaseBook, lease_tables, read_leases

pytestmark = pytest.mark.process


@pytest.fixture
def service():
    """A server with the lease tables and a thread applying requests, as the replay service's loop does."""
    from actorq_jax.replay import ReplayServer

    server = ReplayServer(lease_tables())
    book = LeaseBook(server.client())
    done = threading.Event()

    def serve():
        while not done.is_set():
            book.handle()
            time.sleep(0.02)

    thread = threading.Thread(target=serve)
    thread.start()
    yield f"127.0.0.1:{server.port}"
    done.set()
    thread.join()
    server.stop()


def _held_until_it_expires(service, actor_id):
    """Another actor is refused `actor_id` while its 1 s lease lives, and gets it once the lease has expired."""
    with pytest.raises(IdTaken):
        IdLease(service, actor_id).acquire(timeout_s=10)
    time.sleep(1.5)  # past its time to live, unrenewed
    back = IdLease(service, actor_id)
    back.acquire(timeout_s=10)
    back.release()


@pytest.mark.timeout(60)
def test_a_second_actor_asking_for_a_held_id_is_refused_naming_the_holder(service):
    first = IdLease(service, 7)
    first.acquire(timeout_s=10)
    try:
        second = IdLease(service, 7)
        second.holder = "otherhost:42"
        with pytest.raises(IdTaken, match=r"--actor_id 7 is held by another actor \(.*:\d+\)"):
            second.acquire(timeout_s=10)
        # Another id is free.
        other = IdLease(service, 8)
        other.acquire(timeout_s=10)
        other.release()
    finally:
        first.release()
    # Released: the id is free again at once.
    third = IdLease(service, 7)
    third.acquire(timeout_s=10)
    third.release()


@pytest.mark.timeout(60)
def test_a_restarted_launcher_actor_takes_its_slot_over_and_a_dead_holders_lease_expires(service):
    dead = IdLease(service, 3, ttl_s=1.0)
    dead.acquire(timeout_s=10)
    dead._stop.set()  # it stops renewing, as a killed process would, and never releases
    restarted = IdLease(service, 3, takeover=True)
    restarted.acquire(timeout_s=10)
    assert read_leases(reverb.Client(service))["leases"][3]["token"] == restarted.token
    restarted.release()

    gone = IdLease(service, 5, ttl_s=1.0)
    gone.acquire(timeout_s=10)
    gone._stop.set()
    _held_until_it_expires(service, 5)


@pytest.mark.timeout(60)
def test_a_lease_released_without_telling_the_server_stays_held_until_it_expires(service):
    quiet = IdLease(service, 4, ttl_s=1.0)
    quiet.acquire(timeout_s=10)
    quiet.release(tell_server=False)  # as an actor whose service is gone: no message to wait out
    _held_until_it_expires(service, 4)


@pytest.mark.timeout(60)
def test_a_lease_whose_main_loop_stops_beating_is_given_back_and_its_holder_told(service):
    stuck = []
    lease = IdLease(service, 11, hang_s=1.0, on_hang=stuck.append)
    lease.acquire(timeout_s=10)
    # Beating for longer than hang_s: the lease is renewed and held.
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        lease.beat()
        time.sleep(0.1)
    assert stuck == []
    assert read_leases(reverb.Client(service))["leases"][11]["token"] == lease.token
    # The beats stop: within hang_s and a wake-up (hang_s / 2) the holder is told how long its loop was quiet.
    quiet_from = time.monotonic()
    while not stuck and time.monotonic() - quiet_from < 10:
        time.sleep(0.05)
    assert len(stuck) == 1 and 1.0 < stuck[0] < 3.0, stuck
    # Given back, not left to expire (its time to live is LEASE_TTL_S, 10 s): another actor gets the id at once.
    other = IdLease(service, 11)
    other.acquire(timeout_s=5)
    assert time.monotonic() - quiet_from < 6.0
    other.release()
    lease.release()


# An actor's main loop waiting on its stdin (a call that releases the GIL, as a blocked Reverb write does).
_WAITING_ACTOR = """
import sys
from actorq_jax.launch.leases import IdLease
lease = IdLease(sys.argv[1], 12, ttl_s=3.0, hang_s=4.0)
lease.acquire(timeout_s=10)
print("held", flush=True)
for said in ("beat", "done"):
    sys.stdin.readline()
    lease.beat()
    print(said, flush=True)
lease.release()
"""


def test_a_process_stopped_and_continued_whole_is_not_taken_for_a_hung_one(service):
    import signal
    import subprocess
    import sys

    from launch_support import ENV, ROOT

    proc = subprocess.Popen([sys.executable, "-c", _WAITING_ACTOR, service], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        # Ctrl-Z for twice hang_s, then fg: the renewal thread stopped with the main loop, whose silence is not a hang.
        proc.send_signal(signal.SIGSTOP)
        time.sleep(8.0)
        proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)  # two renewal periods: a hang would have been called by now
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        for said in ("beat", "done"):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == said
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
