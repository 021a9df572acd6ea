"""Meshes that mix axis types: every entry point exact, or refused by name.

On ``jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(Explicit,
Auto))`` with the batch sharded over ``data``, XLA miscompiles the typed
form's ``unreduced`` gradients (the weights' gradient came back multiplied by
the size of ``data``, silently), so ``forms.refuse_mixed_axis_types`` refuses
it at trace time. The other mixes run exact: Auto data axes with Explicit
model axes (``(Auto, Explicit)``), size-1 axes of either type. The model is
Equinox's ``Linear`` written in plain JAX (a matrix-vector product under
``vmap``, then a bias), which is what showed the miscompile.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import forms

E, A = AxisType.Explicit, AxisType.Auto
ROWS, DIM, HIDDEN, OUT = 16, 4, 6, 3
REFUSED = r"The mesh mixes axis types, \{'data': 'Explicit', 'tensor': 'Auto'\}"


def _params():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) / 2)
  return {"w1": f(HIDDEN, DIM), "b1": f(HIDDEN), "w2": f(OUT, HIDDEN),
          "b2": f(OUT)}


def _batch():
  rng = np.random.default_rng(1)
  return {"x": jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(ROWS, OUT)), jnp.float32)}


def _linear(w, b, x):
  """Equinox's Linear on one example: ``w @ x + b``."""
  return w @ x + b


def _encode(params, mb):
  def one(x):
    h = jnp.tanh(_linear(params["w1"], params["b1"], x))
    return _linear(params["w2"], params["b2"], h)
  return jax.vmap(one)(mb["x"])


def _loss(params, mb):
  return jnp.mean((_encode(params, mb) - mb["y"]) ** 2)


def _coupled_loss(params, reps, batch):
  del params, batch
  # Couples the batch: a batch-wide mean subtracted from every example.
  return jnp.mean((reps - jnp.mean(reps, axis=0)) ** 2)


def _mesh(shape, types):
  return jax.make_mesh(shape, ("data", "tensor"), axis_types=types)


def _full_batch(entry):
  params, batch = _params(), _batch()
  if entry == "coupled":
    return jax.grad(
        lambda p: _coupled_loss(p, _encode(p, batch), batch))(params)
  return jax.grad(_loss)(params, batch)


def _grads(entry, axis_name):
  """The entry point's gradient on the current mesh, reduced."""
  if entry == "coupled":
    fn = oa.coupled_value_and_grad(_encode, _coupled_loss,
                                   num_microbatches=2, axis_name=axis_name)
  elif entry == "deferred":
    fn = oa.value_and_grad(_loss, num_microbatches=1, equal_weights=True,
                           axis_name=axis_name, gradient_sync="deferred")
  else:
    fn = oa.value_and_grad(_loss, num_microbatches=2, equal_weights=True,
                           axis_name=axis_name)

  @jax.jit
  def step(params, batch):
    return jax.tree.map(lambda g: jax.sharding.reshard(g, P()),
                        fn(params, batch)[1])

  params = jax.device_put(_params(), P())
  return step(params, jax.device_put(_batch(), P("data")))


ENTRIES = ["value_and_grad", "coupled", "deferred"]


@pytest.mark.parametrize("shape", [(4, 2), (8, 1)])
@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_explicit_data_next_to_an_auto_axis_is_refused(shape, axis_name,
                                                       entry):
  """Failed before: the weights' gradient x4 on (4, 2), x8 on (8, 1)."""
  with jax.set_mesh(_mesh(shape, (E, A))):
    with pytest.raises(ValueError, match=REFUSED) as refused:
      _grads(entry, axis_name)
  message = str(refused.value)
  assert "AxisType.Explicit" in message and "axis_name='data'" in message


def test_plan_microbatches_is_refused_the_same():
  with jax.set_mesh(_mesh((4, 2), (E, A))):
    batch = jax.device_put(_batch(), P("data"))
    with pytest.raises(ValueError, match=REFUSED):
      oa.plan_microbatches(_loss, jax.device_put(_params(), P()), batch,
                           memory_budget=2**30, equal_weights=True)


@pytest.mark.parametrize("shape", [
    (4, 2), pytest.param((8, 1), marks=pytest.mark.slow)])
@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.parametrize("entry", ["value_and_grad", "coupled"])
def test_auto_data_next_to_an_explicit_axis_is_exact(shape, axis_name,
                                                     entry):
  with jax.set_mesh(_mesh(shape, (A, E))):
    grads = _grads(entry, axis_name)
  helpers.assert_trees_close(grads, _full_batch(entry), rtol=1e-5,
                             atol=1e-6)


def test_deferred_on_auto_data_axes_is_refused_by_name():
  with jax.set_mesh(_mesh((4, 2), (A, E))):
    with pytest.raises(ValueError, match="gradient_sync='deferred'"):
      _grads("deferred", "data")


@pytest.mark.parametrize("shape", [
    (4, 2), pytest.param((8, 1), marks=pytest.mark.slow), (1, 8)])
@pytest.mark.parametrize("entry", ENTRIES)
def test_all_explicit_is_exact_with_size_one_axes(shape, entry):
  """The control: the same model, every axis Explicit (typed form).

  On (1, 8) the coupled entry failed before: batching.merge_rows reshaped
  reps typed over the size-1 'data' axis without out_sharding (JAX: 'This
  reshape is not supported'); the deferred one was refused.
  """
  with jax.set_mesh(_mesh(shape, (E, E))):
    grads = _grads(entry, None)
  helpers.assert_trees_close(grads, _full_batch(entry), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.slow
def test_a_size_one_explicit_data_axis_next_to_auto_is_single_and_exact():
  """Data of size 1: nothing to reduce over, no typed form, exact."""
  with jax.set_mesh(_mesh((1, 8), (E, A))):
    grads = _grads("value_and_grad", None)
  helpers.assert_trees_close(grads, _full_batch("value_and_grad"),
                             rtol=1e-5, atol=1e-6)


def test_explicit_data_inside_a_shard_map_over_another_axis_is_refused():
  """Failed before: XLA aborted the process ("Only one of unreduced and
  manual axes can be present")."""
  fn = oa.value_and_grad(_loss, num_microbatches=2, equal_weights=True)
  with jax.set_mesh(_mesh((4, 2), (E, E))):
    batch = jax.device_put(_batch(), P("data"))
    per_tensor = jax.shard_map(
        lambda p, b: fn(p, b)[1], in_specs=(P(), P()), out_specs=P(),
        axis_names={"tensor"})
    with pytest.raises(ValueError, match=r"'tensor': 'Manual'.*manual too"):
      jax.jit(per_tensor)(_params(), batch)


def test_xla_still_double_counts(monkeypatch):
  """Why the refusal: without it the typed form counts the weights'
  gradient once per device of ``data``. When this fails, XLA compiles it
  right: retire ``forms.refuse_mixed_axis_types``."""
  monkeypatch.setattr(forms, "refuse_mixed_axis_types",
                      lambda *args, **kwargs: None)
  try:
    with jax.set_mesh(_mesh((4, 2), (E, A))):
      grads = _grads("value_and_grad", None)
  except Exception:  # JAX's own failure (jax 0.10.2: a bare
    return  # AssertionError in a unreduced rule) is a refusal too.
  expected = _full_batch("value_and_grad")
  # Counted more than once (x4 once; x16 on jax 0.9.1 since the layout
  # refactor): wrong either way, which is what the refusal guards.
  assert not np.allclose(grads["w1"], expected["w1"], rtol=1e-3)
  # b2 is right, to float32 rounding: a sum over devices against one
  # device's sum, in another order (1.1e-5 apart on one machine, jax
  # 0.9.1), where a factor of 4 or 16 is 300% or more.
  np.testing.assert_allclose(grads["b2"], expected["b2"], rtol=1e-4,
                             atol=1e-6)


@pytest.mark.slow
def test_accumulate_of_jax_grad_on_a_mixed_mesh_is_exact():
  """The loop of one jit call per micro-batch, gradients reduced by JAX."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=2)
  batch = _batch()
  halves = helpers.split(batch, 2)

  @jax.jit
  def micro_step(params, state, mb):
    grads = jax.grad(_loss)(params, mb)
    return tx.update(grads, state, params, num_tokens=1.0)

  with jax.set_mesh(_mesh((4, 2), (E, A))):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    for mb in halves:
      updates, state = micro_step(params, state,
                                  jax.device_put(mb, P("data")))
    assert bool(oa.has_updated(state))
  expected = jax.tree.map(jnp.negative, _full_batch("value_and_grad"))
  helpers.assert_trees_close(updates, expected, rtol=1e-5, atol=1e-6)
