"""Replay items packed into one column per dtype: the layout, a round trip, and the errors."""

import numpy as np
import pytest
import tensorflow as tf

from actorq_jax.replay import ItemLayout, packed_signature, transition_signature


def _signature():
    return {**transition_signature(np.zeros((2, 3), np.float32), np.zeros((), np.int32)),
            "step_index": tf.TensorSpec([], tf.int32)}


def test_a_transition_with_an_int_action_packs_into_one_float_and_one_int_column():
    signature = packed_signature(_signature())
    assert {name: (spec.dtype, tuple(spec.shape)) for name, spec in signature.items()} == {
        "packed_float32": (tf.float32, (6 + 1 + 1 + 6,)), "packed_int32": (tf.int32, (2,))}
    assert signature["packed_float32"].name == "observation:2x3,reward:,discount:,next_observation:2x3"


def test_pack_then_unpack_gives_every_field_back_with_leading_batch_axes():
    layout = ItemLayout.from_table(packed_signature(_signature()))
    rng = np.random.default_rng(0)
    items = [{"observation": rng.normal(size=(2, 3)).astype(np.float32), "action": np.int32(k),
              "reward": np.float32(rng.normal()), "discount": np.float32(0.99 ** k),
              "next_observation": rng.normal(size=(2, 3)).astype(np.float32), "step_index": np.int32(100 + k)}
             for k in range(4)]
    rows = [layout.pack(item) for item in items]
    batch = layout.unpack({column: np.stack([row[column] for row in rows]) for column in layout.columns})
    assert set(batch) == set(items[0])
    for name in items[0]:
        want = np.stack([item[name] for item in items])
        assert batch[name].dtype == want.dtype and batch[name].shape == want.shape
        np.testing.assert_array_equal(batch[name], want)


def test_the_layout_read_from_a_path_prefixed_spec_name_is_the_same():
    signature = packed_signature(_signature())
    prefixed = {column: tf.TensorSpec(spec.shape, spec.dtype, name=f"{column}/{spec.name}")
                for column, spec in signature.items()}
    assert ItemLayout.from_table(prefixed).slots == ItemLayout.from_table(signature).slots


@pytest.mark.parametrize("name", ["a:b", "a,b", "a/b", ""])
def test_a_field_name_the_layout_cannot_encode_is_refused_by_name(name):
    with pytest.raises(ValueError, match="field names"):
        packed_signature({name: tf.TensorSpec([1], tf.float32)})


def test_a_table_of_unpacked_items_is_refused_with_the_table_named():
    with pytest.raises(ValueError, match="'old' does not hold packed items"):
        ItemLayout.from_table(transition_signature(np.zeros(3, np.float32), np.zeros(1, np.float32)), "old")


def test_a_string_field_cannot_be_packed():
    with pytest.raises(ValueError, match="'text' has dtype"):
        packed_signature({"text": tf.TensorSpec([], tf.string)})
