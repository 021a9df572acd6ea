"""``batching``: splitting a batch into micro-batches, and back."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from optax_accum._src.microbatch import batching

K = 4


def _rows(split, index):
  return np.asarray(batching.take(split, index)["x"][:, 0])


def test_an_unsharded_batch_splits_into_contiguous_blocks():
  batch = {"x": jnp.arange(16.0).reshape(8, 2)}
  split = batching.split(batch, 0, K)
  assert not split.strided and split.rows == 2
  np.testing.assert_array_equal(_rows(split, 1), [4.0, 6.0])  # rows 2, 3


def test_a_sharded_batch_splits_by_device_blocks_without_resharding():
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    batch = {"x": jax.device_put(jnp.arange(16.0).reshape(8, 2), P("data"))}
    split = batching.split(batch, 0, 2)
    assert split.blocks == 2 and not split.strided
    # Micro-batch 1 holds rows 2, 3 of device 0's shard and 6, 7 of device
    # 1's: the second block of each, as on one device and under shard_map.
    np.testing.assert_array_equal(_rows(split, 1), [4.0, 6.0, 12.0, 14.0])
    assert jax.typeof(batching.take(split, 1)["x"]).sharding.spec[0] == (
        "data")


def test_an_auto_mesh_without_axis_name_splits_strided():
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    split = batching.split({"x": jnp.arange(16.0).reshape(8, 2)}, 0, K)
    assert split.strided and split.blocks == 1
    np.testing.assert_array_equal(_rows(split, 1), [2.0, 10.0])  # rows 1, 5


@pytest.mark.parametrize("layout", ["contiguous", "strided", "blocks"])
def test_merge_rows_undoes_the_split_of_rows(layout):
  x = jnp.arange(24.0).reshape(12, 2)
  split = batching.Split([x.reshape(3, 4, 2)], [0], None,
                         layout == "strided", 4, 2 if layout == "blocks" else 1)
  per_microbatch = batching.split_rows(x, split)
  assert per_microbatch.shape == (3, 4, 2)
  np.testing.assert_array_equal(batching.merge_rows(per_microbatch, split), x)


def test_split_rows_matches_what_take_gives():
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), P("data"))
    split = batching.split({"x": x}, 0, 2)
    rows = batching.split_rows(x, split)
    for i in range(2):
      np.testing.assert_array_equal(rows[i], batching.take(split, i)["x"])


def test_a_leaf_with_batch_axis_none_is_passed_whole():
  batch = {"x": jnp.ones((8, 3)), "table": jnp.arange(5.0)}
  split = batching.split(batch, {"x": 0, "table": None}, K)
  np.testing.assert_array_equal(batching.take(split, 2)["table"],
                                batch["table"])


def test_bad_splits_name_the_sizes():
  with pytest.raises(ValueError, match="divisible by num_microbatches=3"):
    batching.split({"x": jnp.ones((8, 2))}, 0, 3)
  with pytest.raises(ValueError, match="share the size of their batch axis"):
    batching.split({"x": jnp.ones((8, 2)), "y": jnp.ones(4)}, 0, 2)
  with pytest.raises(ValueError, match="splits no leaf"):
    batching.split({"x": jnp.ones((8, 2))}, None, 2)


def test_a_stacked_batch_over_devices_names_the_fix():
  """A ``(k, micro, ...)`` batch sharded over the data axis cannot split
  into k micro-batches per device: the error says how to pass it."""
  hint = r"already stacked as \(k, micro, \.\.\.\), pass it unstacked"
  with pytest.raises(ValueError, match=hint):
    batching.check_divisible(K, K, devices=2)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    stacked = {"x": jax.device_put(jnp.ones((K, 8, 2)), P("data"))}
    with pytest.raises(ValueError, match=hint):
      batching.split(stacked, 0, K)
  with pytest.raises(ValueError) as info:  # an unrelated size: no hint.
    batching.check_divisible(6, K, devices=2)
  assert "stacked" not in str(info.value)
