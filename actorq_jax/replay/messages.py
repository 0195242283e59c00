"""Small JSON messages carried by Reverb queue tables (no pickle on the wire).

A message table is a FIFO that hands each item out once: a sender inserts a
JSON object as uint8 bytes, the one reader takes every waiting message in
order. The replay service's control requests and their replies travel this
way, so a worker on another machine reaches the service by the same road as
its replay writes.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Dict, List, Mapping

import numpy as np
import reverb

# A message is a few hundred bytes; anything far larger is not one of ours.
MAX_MESSAGE_BYTES = 65_536


def make_message_table(name: str, max_size: int = 1_000) -> reverb.Table:
    """A FIFO table whose items are read once, in order, by one reader."""
    return reverb.Table(
        name=name,
        sampler=reverb.selectors.Fifo(),
        remover=reverb.selectors.Fifo(),
        max_size=max_size,
        max_times_sampled=1,
        rate_limiter=reverb.rate_limiters.MinSize(1))


def encode_message(message: Mapping[str, Any]) -> np.ndarray:
    """A JSON object as the uint8 array it travels as."""
    return np.frombuffer(json.dumps(dict(message), allow_nan=True).encode(), np.uint8)


def decode_message(data: Any, what: str = "message", max_bytes: int = MAX_MESSAGE_BYTES) -> Dict[str, Any]:
    """The JSON object in `data` (uint8 bytes); ValueError saying what is wrong with it."""
    array = np.asarray(data)
    if array.dtype != np.uint8 or array.ndim != 1 or array.size > max_bytes:
        raise ValueError(f"not an encoded {what} (dtype {array.dtype}, shape {array.shape})")
    try:
        message = json.loads(array.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not JSON text ({error})") from None
    if not isinstance(message, dict):
        raise ValueError(f"not a JSON object but {type(message).__name__}")
    return message


def send_message(client: reverb.Client, table: str, message: Mapping[str, Any], timeout_s: float) -> None:
    """Inserts one message, waiting at most `timeout_s` for the server to confirm it."""
    writer = client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
    try:
        writer.append([encode_message(message)])
        writer.create_item(table, 1.0, [writer.history[0][-1]])
        writer.end_episode(timeout_ms=max(1, int(timeout_s * 1000)))
    finally:
        writer.close()


class _Take:
    """A sampler of `count` items in a thread of its own, and the items it has received so far."""

    def __init__(self, client: reverb.Client, table: str, count: int):
        self.samples: List[Any] = []
        self.handed_over = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._take, args=(client, table, count), name=f"take {table}",
                                       daemon=True)
        self.thread.start()

    def _take(self, client: reverb.Client, table: str, count: int) -> None:
        try:
            for sample in client.sample(table, num_samples=count, emit_timesteps=False):
                self.samples.append(sample)  # one at a time: what came is handed over even if the rest never does
        except BaseException as error:  # noqa: BLE001  (handed to the reader's thread)
            self.error = error

    def hand_over(self) -> List[Any]:
        """The samples received since the last hand-over."""
        new = self.samples[self.handed_over:]
        self.handed_over += len(new)
        return new


def sample_within(client: reverb.Client, table: str, num_samples: int, timeout_s: float) -> List[Any]:
    """`num_samples` items of `table`; reverb.DeadlineExceededError when they have not come within `timeout_s`.

    Reverb's sampler has no deadline: one that starts as the server behind the address restarts waits on the
    new server's empty table for ever, out of reach of signal handlers. It runs in a thread of its own here
    (Reverb lets go of the GIL while it waits), which is left behind on a timeout.
    """
    take = _Take(client, table, num_samples)
    take.thread.join(timeout_s)
    if take.thread.is_alive():
        raise reverb.DeadlineExceededError(f"{num_samples} item(s) of table {table!r} did not come within {timeout_s:g} s")
    if take.error is not None:
        raise take.error
    return take.samples


def sample_one(client: reverb.Client, table: str, timeout_s: float) -> Any:
    """One item of `table` (a ReplaySample); reverb.DeadlineExceededError when none has come within `timeout_s`."""
    return sample_within(client, table, 1, timeout_s)[0]


# A take that timed out leaves its sampler waiting (Reverb's cannot be cancelled), and the next messages to
# arrive go to it rather than to a new one. It is kept per client and table so the next take hands them over.
_LEFT_BEHIND: "weakref.WeakKeyDictionary[reverb.Client, Dict[str, _Take]]" = weakref.WeakKeyDictionary()
_LEFT_BEHIND_LOCK = threading.Lock()


def take_messages(client: reverb.Client, table: str, timeout_s: int = 5) -> List[Dict[str, Any]]:
    """Every message waiting in `table`, oldest first, each decoded (undecodable ones raise ValueError).

    reverb.DeadlineExceededError when they have not come within `timeout_s` (a busy server, or one restarted
    since it counted them); the ones that come later are not lost: a later take by this client returns them.
    """
    with _LEFT_BEHIND_LOCK:
        take = _LEFT_BEHIND.get(client, {}).pop(table, None)
    if take is None:
        size = int(client.server_info(timeout=timeout_s)[table].current_size)
        if size == 0:
            return []
        # Only this reader removes messages, so `size` are there to read, unless the server restarted since.
        take = _Take(client, table, size)
        take.thread.join(timeout_s)
        fresh = True
    else:
        fresh = False
    alive = take.thread.is_alive()  # before the hand-over: what it receives after that is handed over next time
    samples = take.hand_over()
    if alive:
        with _LEFT_BEHIND_LOCK:
            _LEFT_BEHIND.setdefault(client, {})[table] = take
        if fresh and not samples:
            raise reverb.DeadlineExceededError(f"messages of table {table!r} did not come within {timeout_s:g} s")
    elif take.error is not None and not samples:
        raise take.error
    return [decode_message(sample.data[0]) for sample in samples]
