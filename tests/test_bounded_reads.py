"""Every read of a run's small tables gives up at its deadline.

A reader checks a table's size, then samples. When the server behind the address restarts in between, the
table it samples from is the new server's, empty, and Reverb's sampler would wait there for ever (an actor, the
launcher or the learner stuck with no trace). Here each table reports an item that its rate limiter never hands
out, which is what such a reader meets.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import reverb

from actorq_jax.launch import runtime
from actorq_jax.launch.actor import fetch_config
from actorq_jax.launch.actor_rows import ACTOR_ROWS_TABLE, ROWS_WRITTEN_TABLE, RowDrain, read_written
from actorq_jax.launch.channel import ROLES, ServiceChannel, status_table
from actorq_jax.launch.leases import LEASE_REQUESTS, LEASES_TABLE, IdLease, read_leases
from actorq_jax.replay import ReplayServer, make_variables_table
from actorq_jax.replay.messages import make_message_table
from actorq_jax.replay.variables import VariableClient

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def stuck_table(name: str) -> reverb.Table:
    """A table that shows one item and never hands it out (sampling waits for a second)."""
    return reverb.Table(name=name, sampler=reverb.selectors.Fifo(), remover=reverb.selectors.Fifo(), max_size=10,
                        rate_limiter=reverb.rate_limiters.MinSize(2))


def put_one(client: reverb.Client, table: str) -> None:
    client.insert([np.frombuffer(b"{}", np.uint8)], {table: 1.0})


@pytest.fixture
def stuck_server():
    names = [runtime.VARIABLES_TABLE, runtime.CONFIG_TABLE, LEASES_TABLE, ROWS_WRITTEN_TABLE,
             *(status_table(role) for role in ROLES)]
    with ReplayServer([stuck_table(name) for name in names] + [make_message_table(LEASE_REQUESTS)]) as server:
        client = server.client()
        for name in names:
            put_one(client, name)
        assert all(client.server_info(timeout=5)[name].current_size == 1 for name in names)
        yield server


def within(seconds: float):
    """Asserts the block it guards ends within `seconds`."""
    class Clock:
        def __enter__(self):
            self.start = time.monotonic()

        def __exit__(self, *exc_info):
            took = time.monotonic() - self.start
            assert took < seconds, f"took {took:.1f} s"
    return Clock()


def test_a_status_read_returns_nothing_rather_than_waiting(stuck_server):
    channel = ServiceChannel(stuck_server.local_address)
    with within(10):
        assert channel.read("learner") == {}


def test_a_policy_refresh_fails_as_unreachable_rather_than_waiting(stuck_server):
    with VariableClient(stuck_server.local_address, table=runtime.VARIABLES_TABLE, rpc_timeout_s=1) as variables:
        with within(10), pytest.raises(RuntimeError, match="no policy came from table 'variables'"):
            variables.refresh(timeout_s=20)
        assert variables.errors == 1 and variables.params is None


def test_lease_acknowledgement_and_configuration_reads_give_up(stuck_server):
    client = stuck_server.client()
    with within(10), pytest.raises(reverb.DeadlineExceededError, match="table 'leases'"):
        read_leases(client, timeout_s=1)
    with within(10), pytest.raises(reverb.DeadlineExceededError, match="table 'actor_rows_written'"):
        read_written(client, timeout_s=1)
    with within(10), pytest.raises(TimeoutError, match="did not hand out its configuration within 1 s"):
        fetch_config(stuck_server.local_address, timeout_s=1)


def test_an_actor_id_lease_gives_up_at_its_deadline(stuck_server):
    lease = IdLease(stuck_server.local_address, actor_id=0)
    with within(15), pytest.raises(TimeoutError, match="did not answer the lease on actor id 0 within 3 s"):
        lease.acquire(timeout_s=3)
    # The request was sent, and sent again after each read that gave up (a restarted service lost it).
    assert stuck_server.client().server_info(timeout=5)[LEASE_REQUESTS].current_size >= 2


def test_a_rows_drain_gives_up_and_writes_nothing(tmp_path):
    with ReplayServer([stuck_table(ACTOR_ROWS_TABLE), make_variables_table(ROWS_WRITTEN_TABLE)]) as server:
        client = server.client()
        put_one(client, ACTOR_ROWS_TABLE)
        drain = RowDrain(client, tmp_path, num_local_actors=0)
        with within(10), pytest.raises(reverb.DeadlineExceededError, match="table 'actor_rows'"):
            drain.drain(timeout_s=1)
        drain.close()
        assert list(tmp_path.iterdir()) == []


def test_an_actor_id_lease_on_a_service_that_does_not_answer_is_a_timeout():
    import portpicker

    lease = IdLease(f"127.0.0.1:{portpicker.pick_unused_port()}", actor_id=3)
    with within(15), pytest.raises(TimeoutError, match="did not answer within 1 s, before the lease on actor id 3"):
        lease.acquire(timeout_s=1)


def test_a_publication_the_server_does_not_confirm_gives_up_at_its_deadline():
    from actorq_jax.quantization import QuantConfig
    from actorq_jax.replay.variables import VariablePublisher

    # A queue of one holds the second insert until the first is taken: a server that never confirms it.
    with ReplayServer([reverb.Table.queue(runtime.VARIABLES_TABLE, max_size=1)]) as server:
        publisher = VariablePublisher(server.client(), runtime.VARIABLES_TABLE, QuantConfig(bits=8), timeout_s=1)
        params = {"dense": {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)}}
        publisher.publish(params, 1)
        with within(10), pytest.raises(reverb.DeadlineExceededError):
            publisher.publish(params, 2)
        assert publisher.published == 1
    with pytest.raises(ValueError, match="timeout_s must be > 0, got timeout_s=0"):
        VariablePublisher(None, runtime.VARIABLES_TABLE, timeout_s=0)
