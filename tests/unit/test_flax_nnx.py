"""``flax_nnx``: the mistakes Flax NNX trees allow, named, with the fix.

- ``nnx.Optimizer.update(model, nnx.as_pure(grads))`` said the gradients
  lack ``['bias'], ['kernel']`` although they hold them (flax's ``wrt``
  filter drops plain arrays); now it says why and what to pass.
- ``accumulate(axis_name=...)`` in an ``nnx.Optimizer`` on a sharded model
  failed inside Flax (``Sharding spec ('model',) implies that array axis 0
  is partitioned 4 times ...``), or, where the sizes divide, sharded the
  state's slot axis over "model"; now ``tx.init`` refuses it, naming
  ``axis_name``.

Where flax is not loaded, nothing is checked (optax_accum does not need it).
"""

import sys
import types

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax
import pytest

import optax_accum as oa
from optax_accum._src import flax_nnx


def _loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch():
  return {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}


def _optimizer(model):
  return nnx.Optimizer(model, oa.accumulate(optax.adamw(1e-3), every_k=2),
                       wrt=nnx.Param)


_NEEDS_AS_PURE = pytest.mark.skipif(
    not hasattr(nnx, "as_pure"), reason="this flax has no nnx.as_pure")


@_NEEDS_AS_PURE
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_pure_grads_in_nnx_optimizer_update_name_the_fix(jit):
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = _optimizer(model)

  def step(model, optimizer, batch):
    grads = nnx.grad(_loss)(model, batch)
    optimizer.update(model, nnx.as_pure(grads), num_tokens=4)

  step = nnx.jit(step) if jit else step
  with pytest.raises(ValueError) as info:
    step(model, optimizer, _batch())
  message = str(info.value)
  assert "updates arrived as an nnx.State with 0 of the 2" in message, message
  assert "nnx.as_pure(grads)" in message and "wrt filter" in message, message
  assert "Pass grads as nnx.grad returned them" in message, message


def test_grads_as_nnx_grad_returned_them_are_accepted():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = _optimizer(model)
  grads = nnx.grad(_loss)(model, _batch())
  optimizer.update(model, grads, num_tokens=4)
  assert int(oa.find_accumulate_state(optimizer.opt_state).micro_step) == 1


@_NEEDS_AS_PURE
def test_variables_against_plain_arrays_are_named_either_way():
  """``tx.update`` called directly, one tree of Variables, one of arrays."""
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = oa.accumulate(optax.sgd(0.1), every_k=2)
  params = nnx.state(model, nnx.Param)
  grads = nnx.grad(_loss)(model, _batch())
  pure = nnx.as_pure(params)
  with pytest.raises(ValueError, match=r"updates holds nnx\.Variables, .*"
                     r"pass nnx\.as_pure\(updates\)"):
    tx.update(grads, tx.init(pure), pure, num_tokens=4)
  with pytest.raises(ValueError, match=r"updates holds plain arrays, .*"
                     r"nnx\.Variables: build the state from plain arrays"):
    tx.update(nnx.as_pure(grads), tx.init(params), pure, num_tokens=4)


def test_a_plain_tree_gets_no_nnx_hint():
  tx = oa.accumulate(optax.sgd(0.1), every_k=2)
  params = {"w": jnp.ones(2), "b": jnp.ones(())}
  with pytest.raises(ValueError, match=r"it lacks \['w'\]\.$"):
    tx.update({"b": jnp.ones(())}, tx.init(params), params)


def _sharded_linear(rngs):
  return nnx.Linear(
      4, 8, rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                        (None, "model")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                      ("model",)))


def _mesh(data, model):
  return jax.make_mesh((data, model), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:data * model])


# (2, 4): flax failed ("partitioned 4 times ... dimension size 2");
# (4, 2): the slots were silently sharded over "model". tx.init refuses
# by the names alone, before any size is read: (4, 2) in every run.
@pytest.mark.parametrize("data, model_size", [
    pytest.param(2, 4, marks=pytest.mark.slow), (4, 2)])
def test_axis_name_on_a_sharded_nnx_model_is_refused_at_construction(
    data, model_size):
  with jax.set_mesh(_mesh(data, model_size)):
    model = _sharded_linear(nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
      nnx.Optimizer(model, oa.accumulate(optax.adamw(1e-3), every_k=2,
                                         axis_name="data"), wrt=nnx.Param)
  message = str(info.value)
  assert "accumulate(axis_name='data')" in message, message
  assert "params['bias'] is an nnx.Variable sharded ('model',)" in message
  assert "Under jax.jit leave axis_name out" in message, message
  assert "jax.shard_map" in message, message


def test_the_fix_without_axis_name_trains_the_sharded_model():
  with jax.set_mesh(_mesh(2, 4)):
    model = _sharded_linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, oa.accumulate(optax.adamw(1e-3), every_k=2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      optimizer.update(model, nnx.grad(_loss)(model, batch), num_tokens=8)

    batch = {"x": jax.device_put(jnp.ones((8, 4)), P("data")),
             "y": jax.device_put(jnp.zeros((8, 8)), P("data"))}
    step(model, optimizer, batch)
  state = oa.find_accumulate_state(optimizer.opt_state)
  assert int(state.micro_step) == 1


@_NEEDS_AS_PURE
def test_axis_name_stays_accepted_for_unsharded_variables_and_arrays():
  """No false alarm: Variables without sharding, or plain arrays."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, axis_name="data")
  nnx.Optimizer(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
  with jax.set_mesh(_mesh(2, 4)):
    model = _sharded_linear(nnx.Rngs(0))
    tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))


def _sharded_params():
  with jax.set_mesh(_mesh(2, 4)):
    return nnx.state(_sharded_linear(nnx.Rngs(0)), nnx.Param)


def test_without_flax_loaded_there_is_no_hint_and_no_check(monkeypatch):
  """Looked up, not imported: with flax.nnx unloaded, nothing is said."""
  params = _sharded_params()
  fewer = nnx.State({"bias": params["bias"]})
  assert "wrt filter" in flax_nnx.structure_hint("updates", fewer, params,
                                                 "params")
  with pytest.raises(ValueError, match="axis_name"):
    flax_nnx.check_slots_fit_params("data", params)
  monkeypatch.delitem(sys.modules, "flax.nnx")
  assert flax_nnx.structure_hint("updates", fewer, params, "params") == ""
  flax_nnx.check_slots_fit_params("data", params)  # no error.


def test_plain_trees_of_the_same_kind_get_no_hint():
  tree, expected = {"w": jnp.ones(2)}, {"w": jnp.ones(2), "b": jnp.ones(())}
  assert flax_nnx.structure_hint("updates", tree, expected, "params") == ""
  # A State with all the expected arrays: not what the wrt filter does.
  state = nnx.State({"w": jnp.ones(2), "b": jnp.ones(()), "c": jnp.ones(())})
  assert flax_nnx.structure_hint("updates", state, expected, "params") == ""


@pytest.mark.parametrize("sharding, names", [
    (("model",), True), ((None, "model"), True), ([None, None], False),
    ((), False), (P("model"), True), (P(), False), (P(None, "model"), True),
])
def test_a_sharding_names_an_axis_where_an_entry_is_not_none(sharding, names):
  assert flax_nnx._names_an_axis(sharding) is names


def test_a_partition_spec_of_nones_names_no_axis():
  # A PartitionSpec is no tuple in every jax, and P(None, None) is true.
  assert not flax_nnx._names_an_axis(P(None, None))
  assert not flax_nnx._names_an_axis(P(None, (), None))
  assert flax_nnx._names_an_axis(P(None, ("data", "model")))


def test_a_named_sharding_is_read_through_its_spec():
  mesh = _mesh(2, 4)
  assert flax_nnx._names_an_axis(jax.NamedSharding(mesh, P(None, "model")))
  assert not flax_nnx._names_an_axis(jax.NamedSharding(mesh, P()))


def _variable(**metadata):
  return types.SimpleNamespace(get_metadata=lambda: metadata)


def test_the_state_gets_optimizer_sharding_before_the_variables_own():
  """As nnx.Optimizer copies it; older flax: sharding_names, sharding."""
  assert flax_nnx._variable_sharding(_variable(
      out_sharding=("model",), optimizer_sharding=(None,))) == (None,)
  assert flax_nnx._variable_sharding(_variable(
      out_sharding=("model",), optimizer_sharding=None)) == ("model",)
  assert flax_nnx._variable_sharding(_variable(
      sharding_names=("model",))) == ("model",)
  assert flax_nnx._variable_sharding(_variable(sharding=("data",))) == (
      "data",)
  assert flax_nnx._variable_sharding(_variable(other=1)) is None


def test_without_axis_name_sharded_variables_are_accepted():
  flax_nnx.check_slots_fit_params(None, _sharded_params())


def test_optimizer_sharding_axes_are_read_per_array_leaf():
  """The axes ``optimizer_sharding`` names, for a spec, a tuple of names or
  a NamedSharding; none for a plain array or a Variable without one."""
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  params = nnx.State({
      "a": nnx.Param(jnp.zeros((4, 2)),
                     optimizer_sharding=P(("data", "model"), None)),
      "b": nnx.Param(jnp.zeros(4), optimizer_sharding=("data",)),
      "c": nnx.Param(jnp.zeros(4), optimizer_sharding=jax.NamedSharding(
          mesh, P(None))),
      "d": nnx.Param(jnp.zeros(4)),
      "e": jnp.zeros(4)})
  assert flax_nnx.optimizer_sharding_axes(params) == [
      ("data", "model"), ("data",), (), (), ()]
