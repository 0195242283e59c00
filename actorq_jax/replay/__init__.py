"""Reverb data plane of ActorQ: replay tables, n-step adder, learner dataset, variables.

    from actorq_jax.replay import (Transition, ReplayTableConfig, make_replay_table,
        make_variables_table, ReplayServer, NStepAdder, ReplayDataset, ReplayBatch,
        update_priorities, VariablePublisher, VariableClient, wait_for_server)

Learner process: ReplayServer([make_replay_table(cfg, obs, act), make_variables_table()]);
ReplayDataset(server.address, cfg.name, batch_size) for batches; VariablePublisher to
publish quantized weights. Actor process (any machine): wait_for_server(address),
NStepAdder(client, cfg.name, n, gamma) to write, VariableClient(address, ...) to read.
Replay items are stored packed, one flat column per dtype (packing.ItemLayout).
"""

from actorq_jax.replay.adder import NStepAdder, WriteTimeout
from actorq_jax.replay.dataset import ReplayBatch, ReplayDataset, update_priorities
from actorq_jax.replay.packing import ItemLayout, packed_signature
from actorq_jax.replay.server import ReplayServer, parse_address, wait_for_server
from actorq_jax.replay.tables import (
    ReplayTableConfig,
    make_item_table,
    make_replay_table,
    make_variables_table,
    transition_signature,
)
from actorq_jax.replay.types import Transition
from actorq_jax.replay.variables import (
    PayloadRejected,
    PublishStats,
    RefreshTiming,
    VariableClient,
    VariablePublisher,
)

__all__ = [
    "ItemLayout", "NStepAdder", "PayloadRejected", "PublishStats", "RefreshTiming", "ReplayBatch", "ReplayDataset",
    "ReplayServer", "ReplayTableConfig", "Transition", "VariableClient", "VariablePublisher", "make_item_table",
    "make_replay_table", "make_variables_table", "packed_signature", "parse_address", "transition_signature", "update_priorities",
    "wait_for_server", "WriteTimeout",
]
