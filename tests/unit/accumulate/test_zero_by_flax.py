"""ZeRO by Flax: ZeRO-1 on an ``inner`` state that came sharded.

At update, the layout is found where a state leaf shaped like the sums
(adam's moments) shards one over the axes its gradient is unreduced over,
with that leaf's spec as the shard (not ``zero_specs``'); nothing is found
without unreduced types or sharded state. At init, Flax Variables carrying
``optimizer_sharding`` pick it, and their sums are laid out unreduced, as an
update leaves them.
"""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import accumulate_parts
from accumulate_parts import N
import helpers
from optax_accum._src import names
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import update_call
from optax_accum._src.accumulate import zero_sums

pytestmark = accumulate_parts.needs_unreduced_types

PARTS = {"w": np.arange(N * 2 * N, dtype=np.float32).reshape(N, 2, N),
         "odd": np.arange(N * 3, dtype=np.float32).reshape(N, 3)}


def _partials():
  """Typed unreduced over "data": device i's part is PARTS' row i."""
  return {k: accumulate_parts.unreduced_from_slots(
      jax.device_put(v, P("data"))) for k, v in PARTS.items()}


def _adam_state(specs):
  """adam's state with its moments laid out by ``specs``."""
  params = {"w": jnp.zeros((2, N)), "odd": jnp.zeros(3)}
  return optax.adam(1.0).init(jax.tree.map(jax.sharding.reshard, params,
                                           specs))


def test_the_moments_shards_are_the_emits_targets():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    partials = _partials()
    # w's moments are sharded on their second dimension: zero_specs would
    # pick the first, which 8 does not divide.
    state = _adam_state({"w": P(None, "data"), "odd": P()})
    layout = zero_sums.sharded_by_inner(state, partials, partials)
    assert layout == zero_sums.ZeroSums(
        ("data",), names.ONCE, typed_sums.TypedSums(),
        shards={"w": P(None, "data"), "odd": P(None)}, by_inner=True)
    cycle = sum_layout.Cycle(partials, jnp.float32(1.0), None, None)
    reduced = jax.jit(layout.reduced, static_argnums=1)(cycle, None)
    assert jax.typeof(reduced.grad_sum["w"]).sharding.spec == P(None, "data")
    assert not jax.typeof(reduced.grad_sum["odd"]).sharding.spec.unreduced
  helpers.assert_trees_equal(reduced.grad_sum, jax.tree.map(
      lambda x: x.sum(0), PARTS))


def test_nothing_is_found_without_sharded_state_or_unreduced_types():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    partials = _partials()
    whole = jax.tree.map(jnp.zeros_like, {"w": jnp.zeros((2, N)),
                                          "odd": jnp.zeros(3)})
    replicated = _adam_state({"w": P(), "odd": P()})
    sharded = _adam_state({"w": P(None, "data"), "odd": P()})
    assert zero_sums.sharded_by_inner(replicated, partials, partials) is None
    assert zero_sums.sharded_by_inner(sharded, whole, whole) is None
    assert zero_sums.sharded_by_inner((), partials, partials) is None


def test_init_sums_of_optimizer_sharding_variables_are_unreduced():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = nnx.State({
        "w": nnx.Param(jnp.ones((N, 2)), optimizer_sharding=P("data", None)),
        "odd": nnx.Param(jnp.ones(3))})
    sums = sum_layout.unreduced_where_flax_shards(
        jax.tree.map(jnp.zeros_like, params), params)
    plain = {"w": jnp.zeros((N, 2))}
    assert sum_layout.unreduced_where_flax_shards(plain, plain) is plain
  assert {k: str(jax.typeof(v)) for k, v in sums.items()} == {
      "w": "float32[8,2]{U:data}", "odd": "float32[3]{U:data}"}
  assert not any(isinstance(v, nnx.Variable) for v in sums.values())


def test_init_picks_zero_by_flax_and_lays_its_sums_out_unreduced():
  """The chooser's ``init`` form for such Variables: ZeRO-1 on the shards
  Flax lays out (``inner`` initialised on the parameters as they are)."""
  settings = accumulate_parts.SETTINGS
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = nnx.State({
        "w": nnx.Param(jnp.ones((N, 2)), optimizer_sharding=P("data", None)),
        "odd": nnx.Param(jnp.ones(3))})
    layout = update_call.layout_for(settings, params)
    assert layout == zero_sums.ZeroSums(("data",), names.ONCE,
                                        typed_sums.TypedSums(), by_inner=True)
    start = layout.init(optax.sgd(1.0), params, settings)
    assert update_call.layout_for(settings, {"w": jnp.ones(2)}) == (
        local_sums.SingleSums())
  assert str(jax.typeof(start.cycle.grad_sum["w"])) == "float32[8,2]{U:data}"


def test_slots_of_optimizer_sharding_variables_are_plain_arrays():
  """With axis_name the slots stay as they are laid out, as plain arrays:
  a Variable would be resharded by its optimizer_sharding, slot axis and
  all."""
  settings = accumulate_parts.SETTINGS._replace(axis_name="data")
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = nnx.State({
        "w": nnx.Param(jnp.ones((N, 2)), optimizer_sharding=P("data", None))})
    start = update_call.layout_for(settings, params).init(
        optax.sgd(1.0), params, settings)
  assert not isinstance(start.cycle.grad_sum["w"], nnx.Variable)
  assert str(jax.typeof(start.cycle.grad_sum["w"])) == "float32[8@data,8,2]"
