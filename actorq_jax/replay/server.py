"""The Reverb server of a learner, and a bounded way for clients to reach one."""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import reverb

from actorq_jax.net import LOOPBACK, PortTaken, port_in_use
from actorq_jax.replay.packing import ItemLayout, spec_label

# One server_info probe waits at most this long (Reverb's deadline is whole seconds).
_PROBE_S = 1


def parse_address(address: str) -> Tuple[str, int]:
    """Splits "host:port" (or "[v6]:port") into (host, port); ValueError naming it if malformed."""
    if not isinstance(address, str):
        raise ValueError(f"server address must be a 'host:port' string, got {address!r}")
    host, sep, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"server address must look like 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port_text)


class StopRequested(Exception):
    """A stop was requested while waiting for a server (the waiter gives up without an error of its own)."""


def wait_for_server(address: str, timeout_s: float = 30.0, stop: Optional[Any] = None) -> reverb.Client:
    """A client of the Reverb server at address, once it answers; TimeoutError if none within timeout_s.

    Reverb's deadlines are whole seconds, so a dead address fails after at most timeout_s + 1 s. `stop`
    (anything with `is_set()`, e.g. a threading.Event) ends the wait early with StopRequested.
    """
    parse_address(address)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got timeout_s={timeout_s!r}")
    client = reverb.Client(address)
    deadline = time.monotonic() + timeout_s
    last_error: Optional[BaseException] = None
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested(f"stop requested while waiting for the Reverb server at {address}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            # Reverb's client would otherwise wait forever on a dead address.
            client.server_info(timeout=max(1, min(_PROBE_S, math.ceil(remaining))))
            return client
        except (reverb.DeadlineExceededError, RuntimeError) as error:
            last_error = error
            # A refused connection fails fast; do not spin on it.
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    raise TimeoutError(
        f"no Reverb server answered at {address} within {timeout_s:g} s "
        f"(is the run's replay service up, and is the host:port right?); last error: {last_error}")


def table_layout(client: reverb.Client, table: str, fields: Sequence[str], timeout_s: float) -> ItemLayout:
    """The packed layout of `table`'s items, read from the server's signature; ValueError unless they hold `fields`."""
    try:
        infos = client.server_info(timeout=max(1, math.ceil(timeout_s)))
    except reverb.DeadlineExceededError as error:
        raise TimeoutError(
            f"no Reverb server answered at {client.server_address} within {timeout_s:g} s") from error
    if table not in infos:
        raise ValueError(f"table {table!r} not found on {client.server_address}; tables: {sorted(infos)}")
    return ItemLayout.from_table(infos[table].signature, table, fields)


# A replay checkpoint that could not be loaded is renamed with this suffix: kept for a look, never loaded or pruned.
UNREADABLE_SUFFIX = ".unreadable"


class ReplayCheckpointUnreadable(ValueError):
    """A replay checkpoint Reverb cannot load (a damaged or missing file)."""


def prune_checkpoints(directory: Path, keep: Iterable[str]) -> None:
    """Deletes the replay checkpoints in `directory` whose names are not in `keep` (unreadable ones set aside stay)."""
    keep = {Path(name).name for name in keep if name} | {_WORK_DIR}
    for path in Path(directory).glob("*"):
        if path.is_dir() and path.name not in keep and not path.name.endswith(UNREADABLE_SUFFIX):
            shutil.rmtree(path, ignore_errors=True)


# Reverb writes a checkpoint under this subdirectory and deletes its previous one there, so each
# checkpoint is moved out of it at once, under the name the caller gives it.
_WORK_DIR = "reverb"


def checkpoint_items(directory: Path, name: str, table: str) -> Dict[int, float]:
    """{key: priority} of the items of `table` in the replay checkpoint `name` in `directory` (read from its files)."""
    import tensorflow as tf
    from reverb.cc import schema_pb2

    items = Path(directory) / Path(name).name / "items.tfrecord"
    if not items.exists():
        raise FileNotFoundError(f"no Reverb checkpoint {name!r} in {directory}")
    out = {}
    for record in tf.data.TFRecordDataset(str(items), compression_type="ZLIB"):
        item = schema_pb2.PrioritizedItem.FromString(record.numpy())
        if item.table == table:
            out[int(item.key)] = float(item.priority)
    return out


def checkpoint_table_size(directory: Path, name: str, table: str) -> int:
    """Items of `table` held by the replay checkpoint `name` in `directory`."""
    return len(checkpoint_items(directory, name, table))


def _signature_summary(signature: Any) -> Optional[Dict[str, Tuple[Tuple[int, ...], str, Optional[str]]]]:
    """column -> (shape, dtype, spec name) of a table signature (None for a table without one)."""
    if not signature:
        return None
    return {str(column): (tuple(spec.shape), spec.dtype.name, spec_label(spec) or None)
            for column, spec in signature.items()}


class CheckpointMismatch(ValueError):
    """A replay checkpoint holds a table whose items this version cannot read (another layout or task)."""


def _check_restored_signatures(tables: Sequence[reverb.Table], client: reverb.Client, restore: str) -> None:
    """Raises CheckpointMismatch when a checkpoint replaced a table by one whose items have another signature."""
    infos = client.server_info(timeout=30)
    for table in tables:
        want = _signature_summary(table.info.signature)
        got = _signature_summary(infos[table.name].signature) if table.name in infos else want
        if got != want:
            raise CheckpointMismatch(
                f"replay checkpoint {restore!r} holds table {table.name!r} with item signature {got}, but this "
                f"version builds it as {want}: the checkpoint was written by another version (or another task), "
                f"so its items cannot be read; start a new run, or resume with the version that wrote it")


def checkpoint_table_sizes(directory: Path, name: str) -> Dict[str, int]:
    """{table: items it held} by the counts the replay checkpoint `name` in `directory` recorded (inserts - deletes)."""
    import tensorflow as tf
    from reverb.cc.checkpointing import checkpoint_pb2

    sizes = {}
    for record in tf.data.TFRecordDataset(str(Path(directory) / Path(name).name / "tables.tfrecord"),
                                          compression_type="ZLIB"):
        table = checkpoint_pb2.PriorityTableCheckpoint.FromString(record.numpy())
        sizes[table.table_name] = int(table.rate_limiter.insert_count - table.rate_limiter.delete_count)
    return sizes


def check_checkpoint_files(directory: Path, name: str) -> None:
    """Raises ReplayCheckpointUnreadable unless replay checkpoint `name`'s files read through and hold, table by
    table, the items its counts record.

    Checked before Reverb loads it: a damaged file found by Reverb's own load fails the server half way
    through building it.
    """
    import tensorflow as tf
    from google.protobuf.message import DecodeError
    from reverb.cc import schema_pb2

    folder = Path(directory) / Path(name).name
    held: Dict[str, int] = {}
    try:
        recorded = checkpoint_table_sizes(directory, name)
        for record in tf.data.TFRecordDataset(str(folder / "items.tfrecord"), compression_type="ZLIB"):
            table = schema_pb2.PrioritizedItem.FromString(record.numpy()).table
            held[table] = held.get(table, 0) + 1
        for _ in tf.data.TFRecordDataset(str(folder / "chunks.tfrecord"), compression_type="ZLIB"):
            pass  # reading each record checks its length and checksum
    except (tf.errors.OpError, DecodeError, OSError) as error:
        text = str(getattr(error, "message", "") or error).strip()
        # TensorFlow wraps its reason in the op's name: "{{function_node ...}} reason [Op:IteratorGetNext] name:".
        text = re.sub(r"\s*\[Op:\w+\].*$", "", re.sub(r"^\{\{.*?\}\}\s*", "", text, flags=re.S), flags=re.S)
        first = text.splitlines()[0] if text else type(error).__name__
        raise ReplayCheckpointUnreadable(f"replay checkpoint {name!r} in {directory} cannot be read: {first}") from None
    for table, size in recorded.items():
        if held.get(table, 0) != size:
            raise ReplayCheckpointUnreadable(
                f"replay checkpoint {name!r} in {directory} cannot be read: table {table!r} has {held.get(table, 0)} "
                f"items in its items file where its counts record {size} (a damaged or cut file)")


def _check_restored_sizes(client: reverb.Client, restore: str, checkpoint_dir: Path) -> None:
    """Raises ReplayCheckpointUnreadable when a table read back fewer items than its checkpoint's counts record.

    Reverb reads a cut items file as a shorter one; the table's rate limiter would then let a sampler at an
    empty table, which aborts the process.
    """
    infos = client.server_info(timeout=30)
    for name, recorded in checkpoint_table_sizes(checkpoint_dir, restore).items():
        if name in infos and infos[name].current_size != recorded:
            raise ReplayCheckpointUnreadable(
                f"replay checkpoint {restore!r} in {checkpoint_dir} cannot be read: table {name!r} read back "
                f"{infos[name].current_size} items where its counts record {recorded} (a damaged or cut file)")


class ReplayServer:
    """A Reverb server hosting the given tables; `.address` is what clients connect to.

    The server listens on every interface; `advertised_host` is only the host part
    of `.address` (pass this machine's name so actors elsewhere can join).

    With `checkpoint_dir`, `checkpoint(name)` writes every table (items,
    priorities, rate-limiter counts) to `checkpoint_dir/name`, and the server
    starts from the checkpoint named `restore` when given (empty otherwise).
    Checkpoints stay until `prune_checkpoints` removes them.
    """

    def __init__(self, tables: Sequence[reverb.Table], port: Optional[int] = None,
                 advertised_host: str = LOOPBACK, checkpoint_dir: Optional[Path] = None,
                 restore: Optional[str] = None):
        if not tables:
            raise ValueError("ReplayServer needs at least one table, got none")
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port must be an int in 1..65535 or None, got port={port!r}")
        checkpointer = None
        fallback = None
        self._scratch: Optional[str] = None  # a checkpoint directory of this server's own, removed with it
        if checkpoint_dir is not None:
            checkpoint_dir = Path(checkpoint_dir).absolute()
            if restore:
                fallback = checkpoint_dir / Path(restore).name
                if not (fallback / "DONE").exists():
                    raise FileNotFoundError(f"replay checkpoint {restore!r} is not in {checkpoint_dir}")
                check_checkpoint_files(checkpoint_dir, restore)
            work = checkpoint_dir / _WORK_DIR
            # Reverb loads the newest checkpoint in its directory, and the fallback only when that is empty.
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            checkpointer = reverb.checkpointers.DefaultCheckpointer(
                str(work), fallback_checkpoint_path=None if fallback is None else str(fallback))
        elif restore:
            raise ValueError(f"restore={restore!r} needs a checkpoint_dir")
        else:
            # Reverb's own default would be a temporary directory that nothing removes: one left in the
            # temp folder by every server without checkpoints. This one goes with the server.
            self._scratch = tempfile.mkdtemp(prefix="actorq-replay-")
            checkpointer = reverb.checkpointers.DefaultCheckpointer(self._scratch)
        self.checkpoint_dir = checkpoint_dir
        self._server: Optional[reverb.Server] = None
        try:
            self._server = reverb.Server(
                tables=list(tables), port=port, checkpointer=checkpointer)
        except (RuntimeError, ValueError) as error:  # Reverb says only that gRPC did not start: say why if it is the port
            if port is not None and port_in_use(port):
                raise PortTaken(f"port {port} is taken by another process; the replay server cannot bind it") from error
            if fallback is not None:
                # The server loads the checkpoint before it binds: with the port free, the checkpoint is why.
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ReplayCheckpointUnreadable(
                    f"replay checkpoint {Path(restore).name!r} in {checkpoint_dir} cannot be read: {first}") from error
            raise
        finally:
            if self._server is None:
                self._remove_scratch()
        self._port = self._server.port
        self._host = advertised_host
        self.table_names = tuple(table.name for table in tables)
        if restore:
            try:
                _check_restored_signatures(tables, self.client(), restore)
                _check_restored_sizes(self.client(), restore, checkpoint_dir)
            except (CheckpointMismatch, ReplayCheckpointUnreadable):
                self.stop()
                raise

    def checkpoint(self, name: str) -> str:
        """Writes every table to checkpoint_dir/name (replacing one of that name); returns name."""
        if self.checkpoint_dir is None:
            raise ValueError("this ReplayServer has no checkpoint_dir")
        if not name or Path(name).name != name or name == _WORK_DIR:
            raise ValueError(f"checkpoint name must be a plain directory name other than {_WORK_DIR!r}, got {name!r}")
        written = Path(reverb.Client(self.local_address).checkpoint())
        target = self.checkpoint_dir / name
        shutil.rmtree(target, ignore_errors=True)
        written.rename(target)
        return name

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._port

    @property
    def address(self) -> str:
        """"host:port" for clients."""
        return f"{self._host}:{self._port}"

    @property
    def local_address(self) -> str:
        """"127.0.0.1:port", how this machine reaches the server."""
        return f"{LOOPBACK}:{self._port}"

    def client(self) -> reverb.Client:
        """A client of this server from this machine."""
        # The loopback, not the advertised host: that is other machines' way in, and this one may not reach
        # it (a NAT's public address, a name only the cluster resolves).
        return reverb.Client(self.local_address)

    def stop(self) -> None:
        """Stops the server (idempotent)."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> "ReplayServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
