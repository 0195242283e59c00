"""Replay items packed into one flat column per dtype, and unpacked again on the learner's side.

Reverb's per-sample work, on the server and in the learner's sampler, grows with the number of
columns an item references, not with their size. So a replay table stores an item as one vector per
dtype, e.g.

    packed_float32: [observation (5) | reward | discount | next_observation (5)]   # 12 floats
    packed_int32:   [action]

The layout travels with the table: each packed column's TensorSpec is named after the fields it holds,
in order, with their shapes ("observation:5,reward:,discount:,next_observation:5"), so the adder
and the dataset read it from the server's signature and cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

PACKED_PREFIX = "packed_"


@dataclasses.dataclass(frozen=True)
class FieldSlot:
    """Where one field sits: its packed column, its range there, its shape and dtype."""

    name: str
    column: str
    start: int
    stop: int
    shape: Tuple[int, ...]
    dtype: np.dtype


def _encode_shape(shape: Tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _decode_shape(text: str) -> Tuple[int, ...]:
    return tuple(int(d) for d in text.split("x")) if text else ()


def spec_label(spec: Any) -> str:
    """A column spec's name as written, without the column path some Reverb versions prefix ("packed_float32/...")."""
    return (spec.name or "").rpartition("/")[2]


class ItemLayout:
    """The packed columns of an item type: `pack` one item into them, `unpack` (batches of) them to fields."""

    def __init__(self, slots: Tuple[FieldSlot, ...]):
        self.slots = slots
        self.fields = tuple(slot.name for slot in slots)
        self._by_name = {slot.name: slot for slot in slots}
        widths: Dict[str, int] = {}
        dtypes: Dict[str, np.dtype] = {}
        for slot in slots:
            widths[slot.column] = max(widths.get(slot.column, 0), slot.stop)
            dtypes[slot.column] = slot.dtype
        self.columns = tuple(widths)
        self._widths = widths
        self._dtypes = dtypes

    @classmethod
    def from_fields(cls, signature: Mapping[str, Any]) -> "ItemLayout":
        """The layout of an item signature (field -> tf.TensorSpec), fields kept in the signature's order."""
        slots = []
        offsets: Dict[str, int] = {}
        for name, spec in signature.items():
            if not isinstance(name, str) or not name or any(c in name for c in ":,/"):
                raise ValueError(f"item field names must be non-empty and free of ':', ',' and '/', got {name!r}")
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise ValueError(f"field {name!r} needs a tf.TensorSpec of fixed shape, got {spec!r}")
            dtype = np.dtype(spec.dtype.as_numpy_dtype)
            if dtype.kind not in "biuf":
                raise ValueError(f"field {name!r} has dtype {dtype}; only numeric fields can be packed")
            column = PACKED_PREFIX + dtype.name
            shape = tuple(int(d) for d in spec.shape)
            start = offsets.get(column, 0)
            offsets[column] = start + math.prod(shape)
            slots.append(FieldSlot(name, column, start, offsets[column], shape, dtype))
        if not slots:
            raise ValueError("an item signature needs at least one field")
        return cls(tuple(slots))

    @classmethod
    def from_table(cls, signature: Mapping[str, Any], table: str = "",
                   fields: Optional[Sequence[str]] = None) -> "ItemLayout":
        """The layout a table's packed signature (from table_signature, as the server reports it) names;
        ValueError unless its fields are `fields` (in any order) when given."""
        if not signature or not all(str(column).startswith(PACKED_PREFIX) for column in signature):
            raise ValueError(
                f"table {table!r} does not hold packed items (signature {signature!r}); "
                f"build it with make_replay_table, or make_item_table for another item type")
        slots = []
        for column, spec in signature.items():
            dtype = np.dtype(spec.dtype.as_numpy_dtype)
            start = 0
            for entry in spec_label(spec).split(","):
                name, _, shape_text = entry.partition(":")
                shape = _decode_shape(shape_text)
                stop = start + math.prod(shape)
                slots.append(FieldSlot(name, column, start, stop, shape, dtype))
                start = stop
            if start != int(spec.shape[0]):
                raise ValueError(f"table {table!r}: column {column!r} names {start} values but holds {spec.shape}")
        layout = cls(tuple(slots))
        if fields is not None and set(layout.fields) != set(fields):
            raise ValueError(
                f"table {table!r} holds items of fields {list(layout.fields)}, not {list(fields)}; build it with "
                f"make_replay_table, or make_item_table for another item type")
        return layout

    def table_signature(self) -> Dict[str, tf.TensorSpec]:
        """The packed columns' signature for a Reverb table (each spec named after its fields)."""
        signature = {}
        for column in self.columns:
            name = ",".join(f"{s.name}:{_encode_shape(s.shape)}" for s in self.slots if s.column == column)
            signature[column] = tf.TensorSpec([self._widths[column]], tf.as_dtype(self._dtypes[column]), name=name)
        return signature

    def spec(self, field: str) -> Tuple[np.dtype, Tuple[int, ...]]:
        """(dtype, shape) of one field."""
        slot = self._by_name[field]
        return slot.dtype, slot.shape

    def pack(self, values: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """One item's fields (each already of its dtype and shape) -> its packed column vectors."""
        rows = {column: np.empty(self._widths[column], self._dtypes[column]) for column in self.columns}
        for slot in self.slots:
            rows[slot.column][slot.start:slot.stop] = np.ravel(values[slot.name])
        return rows

    def unpack(self, columns: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Packed columns with any leading (batch) axes -> each field with those axes first (views, no copy)."""
        fields = {}
        for slot in self.slots:
            data = columns[slot.column]
            fields[slot.name] = data[..., slot.start:slot.stop].reshape(data.shape[:-1] + slot.shape)
        return fields


def packed_signature(signature: Mapping[str, Any]) -> Dict[str, tf.TensorSpec]:
    """A replay table's signature for items of `signature` (field -> tf.TensorSpec), packed per dtype."""
    return ItemLayout.from_fields(signature).table_signature()
