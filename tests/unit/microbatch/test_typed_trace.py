"""``typed_trace``: the typed layout, built from one trace of the call.

A model whose every leaf JAX can type reduced costs one trace of
``loss_fn``, evaluated in place; one with a leaf that JAX refuses is traced
again to find it, and only that leaf stays replicated. Shards go to the loss
only on the platforms where XLA reduce-scatters their gradient.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import reduced_fallbacks
from optax_accum._src.microbatch import typed_trace

pytestmark = pytest.mark.skipif(
    not hasattr(P(), "unreduced"), reason="needs jax's unreduced types")

WIDTH = 4


@pytest.mark.parametrize("platform, hands", [
    ("tpu", True), ("gpu", True), ("cuda", True), ("rocm", True),
    ("cpu", False), (None, False),
])
def test_shards_go_to_the_loss_on_tpu_and_gpu_only(platform, hands):
  assert typed_trace.hands_shards_on(platform) is hands


def test_the_one_trace_is_evaluated_in_place():
  """The Python runs once; the values are those of a direct call, the
  leaves that are not arrays kept as they were."""
  calls = []

  def local():
    calls.append(None)
    x = jnp.arange(3.0)
    return layout.Partials(grads={"w": x * 2}, sums=(jnp.sum(x),),
                           maxima=[], minima=[], means=None, rest="static")

  got = typed_trace._traced_once(local)
  assert len(calls) == 1
  assert got.rest == "static" and got.means is None
  np.testing.assert_array_equal(got.grads["w"], [0.0, 2.0, 4.0])
  assert float(got.sums[0]) == 3.0


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _traced(loss):
  """The loss's trace count and the fallback leaves of one traced call."""
  calls = []

  def counted(params, microbatch):
    calls.append(None)
    return loss(params, microbatch)

  fn = oa.value_and_grad(counted, num_microbatches=2, equal_weights=True)
  with jax.set_mesh(_mesh()):
    batch = jax.device_put(jnp.ones((16, WIDTH)), P("data"))
    with reduced_fallbacks.collecting() as reports:
      jax.jit(fn).trace(helpers.dense_params(WIDTH), batch)
  return len(calls), reports[-1].fallback_leaves


def test_a_model_without_fallback_leaves_is_traced_once():
  def matmuls_only(params, mb):
    return jnp.mean(jnp.tanh(mb @ params["w"]) @ params["b"])

  assert _traced(matmuls_only) == (1, ())


@pytest.mark.filterwarnings("ignore:.*cannot be typed")
def test_a_leaf_jax_refuses_is_found_and_only_it_falls_back():
  def bias_added(params, mb):
    return jnp.mean(jnp.tanh(mb @ params["w"] + params["b"]) ** 2)

  calls, fallback = _traced(bias_added)
  assert fallback == ("params['b']",)
  assert calls > 1  # the failed trace, then the search.
