"""Remote actors' episode rows travel over the replay service into the run's actors/ directory, each exactly once.

Real Reverb servers on free loopback ports; the end-to-end form (a hand-started remote actor
beside a launcher run) is in test_launch.py.
"""

import time

import numpy as np
import pytest

from actorq_jax.launch.actor_rows import (
    ACTOR_ROWS_TABLE,
    RowDrain,
    RowForwarder,
    check_remote_actor_id,
    decode_row,
    encode_row,
    make_actor_rows_tables,
)
from actorq_jax.launch.runtime import free_port
from actorq_jax.replay import ReplayServer
from actorq_jax.telemetry import ACTOR_FIELDS, read_csv


def _row(actor_id: int, episode: int, incarnation: str = "a1") -> dict:
    row = {field: 0.25 for field in ACTOR_FIELDS}
    row.update(actor_id=actor_id, incarnation=incarnation, episode=episode, env_index=0, env_steps=1000 * (episode + 1),
               episode_return=float(episode) + 0.5, episode_length=1000, params_version=3, rejected_payloads=0)
    return row


def test_a_row_survives_encoding():
    row = _row(7, 2)
    assert decode_row(encode_row(row)) == row


@pytest.mark.parametrize("data, named", [
    (np.frombuffer(b"not json", np.uint8), "not JSON"),
    (np.frombuffer(b"[1, 2]", np.uint8), "not a JSON object"),
    (encode_row({"actor_id": 7, "colour": "red"}), "unknown columns ['colour']"),
    (encode_row({"actor_id": -1}), "actor_id must be an int >= 0, got -1"),
    (encode_row({"actor_id": "7"}), "actor_id must be an int >= 0, got '7'"),
    (encode_row({"actor_id": 7, "episode_return": float("inf")}), "episode_return"),
    (encode_row({"actor_id": 7, "episode": [1]}), "episode"),
    (np.zeros((2, 3), np.uint8), "not an encoded row"),
    (np.zeros(4, np.float32), "not an encoded row"),
])
def test_malformed_rows_are_refused_saying_why(data, named):
    with pytest.raises(ValueError) as error:
        decode_row(data)
    assert named in str(error.value)


def test_remote_actor_ids_must_not_be_a_launcher_actors():
    assert check_remote_actor_id(2, 2) is None and check_remote_actor_id(100, 2) is None
    assert "--actor_id 1 is one of the run's 2 launcher actors (ids 0-1); pick an id >= 2" == check_remote_actor_id(1, 2)
    assert "--actor_id must be >= 0, got -3" == check_remote_actor_id(-3, 2)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_forwarded_rows_are_drained_into_their_actors_csv_and_acknowledged(tmp_path):
    server = ReplayServer(make_actor_rows_tables())
    try:
        drain = RowDrain(server.client(), tmp_path / "actors", num_local_actors=2)
        assert drain.drain() == 0  # an empty table: nothing written, no wait
        seven, nine = RowForwarder(server.address, 5.0), RowForwarder(server.address, 5.0)
        for episode in range(1, 4):
            seven.send(_row(7, episode))
        nine.send(_row(9, 1, "b2"))
        # A row with a launcher actor's id, and bytes that are no row: counted, never written.
        RowForwarder(server.address, 5.0).send(_row(1, 1))
        server.client().insert([np.frombuffer(b"\x00garbage", np.uint8)], {ACTOR_ROWS_TABLE: 1.0})
        # Sent, and kept in the outbox until the service says it wrote them.
        assert (seven.sent, seven.unsent, nine.sent) == (3, 3, 1)
        assert drain.drain() == 4 and drain.rejected == 2
        assert drain.drain() == 0  # each row is read once
        assert seven.flush() and nine.flush() and (seven.unsent, nine.unsent) == (0, 0)
        seven.send(_row(7, 4))
        assert drain.drain() == 1
        drain.close()
        assert read_csv(tmp_path / "actors" / "actor_7.csv") == [_row(7, e) for e in range(1, 5)]
        assert read_csv(tmp_path / "actors" / "actor_9.csv") == [_row(9, 1, "b2")]
        assert sorted(p.name for p in (tmp_path / "actors").iterdir()) == ["actor_7.csv", "actor_9.csv"]
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.timeout(90)
def test_rows_lost_with_a_killed_service_are_sent_again_and_written_exactly_once(tmp_path, monkeypatch):
    from actorq_jax.launch import actor_rows

    monkeypatch.setattr(actor_rows, "RESEND_S", 0.5)
    port = free_port()
    server = ReplayServer(make_actor_rows_tables(), port=port)
    forwarder = RowForwarder(server.address, 2.0)
    drain = RowDrain(server.client(), tmp_path, num_local_actors=1)
    forwarder.send(_row(7, 1))
    assert drain.drain() == 1
    forwarder.send(_row(7, 2))  # sent; the service dies before its next drain
    server.stop()
    drain.close()
    start = time.monotonic()
    forwarder.send(_row(7, 3))
    forwarder.send(_row(7, 4))
    assert time.monotonic() - start < 15  # bounded: one failed try per send, not a hang
    # Row 1 was acknowledged and left the outbox; row 2 was sent but not written, rows 3 and 4 not sent.
    assert (forwarder.sent, forwarder.unsent) == (2, 3)
    server = ReplayServer(make_actor_rows_tables(), port=port)  # the restarted service, same address, empty tables
    try:
        # The restarted service reads back what actors/ holds, so it acknowledges row 1 again.
        drain = RowDrain(server.client(), tmp_path, num_local_actors=1)
        time.sleep(0.6)  # row 2's first copy is now due again
        assert forwarder.flush()
        assert drain.drain() == 3  # rows 2, 3, 4; none twice
        # An acknowledgement the sender never saw: the row comes again and is not written again.
        forwarder._outbox[(7, "a1", 4)] = (actor_rows.encode_row(_row(7, 4)), None)
        forwarder._insert(actor_rows.encode_row(_row(7, 4)))
        assert drain.drain() == 0 and drain.duplicates == 1
        assert forwarder.wait_acknowledged(5.0) and forwarder.unsent == 0
        drain.close()
        assert [r["episode"] for r in read_csv(tmp_path / "actor_7.csv")] == [1, 2, 3, 4]  # in order, once each
    finally:
        server.stop()
