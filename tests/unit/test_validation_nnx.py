"""``validation``'s checks of Flax NNX trees: mistakes named, with the fix.

- ``nnx.Optimizer.update(model, nnx.as_pure(grads))`` said the gradients
  lack ``['bias'], ['kernel']`` although they hold them (flax's ``wrt``
  filter drops plain arrays); now it says why and what to pass.
- ``accumulate(axis_name=...)`` in an ``nnx.Optimizer`` on a sharded model
  failed inside Flax (``Sharding spec ('model',) implies that array axis 0
  is partitioned 4 times ...``), or, where the sizes divide, sharded the
  state's slot axis over "model"; now ``tx.init`` refuses it, naming
  ``axis_name``.
"""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax
import pytest

import optax_accum as oa


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
# (4, 2): the slots were silently sharded over "model".
@pytest.mark.parametrize("data, model_size", [(2, 4), (4, 2)])
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
