"""``collectives``: blockwise reduce-scatters, sums into shards."""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np

from optax_accum._src.mesh import collectives


def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)


def test_blockwise_reduce_scatter_of_a_tensor_parallel_operand():
  """jax 0.10 cannot type psum_scatter of such an operand; blockwise can."""
  rng = np.random.default_rng(0)
  parts = rng.normal(size=(4, 8, 4)).astype(np.float32)  # one per device.
  with jax.set_mesh(_mesh()):
    x = jax.device_put(parts.reshape(32, 4), P("data", "model"))

    def body(x):
      return collectives.scatter(x, P("data"))[0]

    out = jax.jit(jax.shard_map(
        body, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}))(x)
  np.testing.assert_allclose(np.asarray(out), parts.sum(0), rtol=1e-5,
                             atol=1e-6)


def test_sum_into_shards_scatters_sharded_leaves_and_sums_the_rest():
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:4])
  tree = {"w": jnp.ones((4, 8)), "b": jnp.ones((4, 2))}
  specs = {"w": P("data"), "b": P()}

  def body(tree):
    tree = jax.tree.map(lambda x: x[0] * (lax.axis_index("data") + 1), tree)
    return collectives.sum_into_shards(tree, specs, jnp.float32(1.0), "data")

  with jax.set_mesh(mesh):
    summed, extra = jax.jit(jax.shard_map(
        body, in_specs=P("data"),
        out_specs=({"w": P("data"), "b": P()}, P())))(tree)
  np.testing.assert_allclose(summed["w"], np.full(8, 10.0))
  np.testing.assert_allclose(summed["b"], np.full(2, 10.0))
  assert float(extra) == 4.0
