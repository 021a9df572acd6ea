"""Unit tests of empty_safe: derivatives through the loop's select path.

Where borrowing does not apply (a stacked aux, a model state, k = 1,
shard_map), the loop drops an empty micro-batch with a select. Its value and
gradient are exact; a derivative of them (``jax.grad`` of the loss that
``oa.value_and_grad`` returns, a meta-gradient through its gradient) must be
the full batch's too, not the 0/0 of the empty micro-batch's loss as NaN.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import empty_safe
import ragged
from ragged import mean_loss

DIM = ragged.DIM
LENGTHS = [0, 0, 3, 5, 1, 0, 2, 4]  # micro-batches 0 and 2 (of 4) empty.


def _with_stacked_aux(params, batch):  # a stacked aux keeps the select.
  return mean_loss(params, batch), mean_loss(params, batch)


def _with_state(params, state, batch):  # a model state keeps it too.
  return mean_loss(params, batch), state + params["w"].sum()


FORMS = {
    "stacked aux": (lambda k: oa.value_and_grad(
        _with_stacked_aux, num_microbatches=k, has_aux=True,
        num_tokens_fn=helpers.num_tokens),
                    lambda fn, p, b: fn(p, b)[0][0]),
    "model state": (lambda k: oa.value_and_grad(
        _with_state, num_microbatches=k, has_state=True,
        num_tokens_fn=helpers.num_tokens),
                    lambda fn, p, b: fn(p, jnp.float32(0), b)[0][0]),
}


def _loss_of(form, k):
  make, call = FORMS[form]
  fn = make(k)
  return lambda p, b: call(fn, p, b)


def _zeros():
  return jax.tree.map(jnp.zeros_like, ragged.params())


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("lengths", [LENGTHS, [0] * 8])
def test_the_gradient_of_the_loss_is_the_full_batch_s(form, k, lengths):
  """jax.grad of the returned loss: the full batch's gradient, or zeros
  when no micro-batch has tokens."""
  loss = _loss_of(form, k)
  batch = ragged.batch(lengths)
  got = jax.jit(jax.grad(loss))(ragged.params(), batch)
  if not any(lengths):
    helpers.assert_trees_equal(got, _zeros())
    return
  expected = jax.grad(mean_loss)(ragged.params(), batch)
  helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_meta_gradient_through_the_gradient_is_the_full_batch_s():
  """Second order: d/dw of the sum of the returned gradient of w."""
  fn = oa.value_and_grad(_with_stacked_aux, num_microbatches=4,
                         has_aux=True, num_tokens_fn=helpers.num_tokens)
  batch = ragged.batch(LENGTHS)

  def through(w):
    return fn({**ragged.params(), "w": w}, batch)[1]["w"].sum()

  def full(w):
    return jax.grad(mean_loss)({**ragged.params(), "w": w}, batch)["w"].sum()

  w = ragged.params()["w"]
  np.testing.assert_allclose(jax.grad(through)(w), jax.grad(full)(w),
                             rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_under_shard_map_each_device_s_empty_micro_batches_drop_out():
  """Two rows per device, k = 2: several devices hold an empty micro-batch,
  one holds only empty ones."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  fn = oa.value_and_grad(mean_loss, num_microbatches=2, axis_name="data",
                         num_tokens_fn=helpers.num_tokens)

  def loss(params, batch):
    return jax.shard_map(lambda p, b: fn(p, b)[0], mesh=mesh,
                         in_specs=(P(), P("data")), out_specs=P())(
                             params, batch)

  batch = ragged.batch(LENGTHS * 2)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss))(ragged.params(),
                                  jax.device_put(batch, P("data")))
  expected = jax.grad(mean_loss)(ragged.params(), batch)
  helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-7)


def _select_loop(params, batch, k=4):
  """The negative control: the select without empty_safe."""
  split = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

  def body(total, mb):
    n = helpers.num_tokens(mb)
    value = mean_loss(params, mb)
    return total + jnp.where(n > 0, n * value, 0.0), None

  total, _ = lax.scan(body, jnp.float32(0), split)
  return total / helpers.num_tokens(batch)


def test_the_plain_select_differentiates_into_nan():
  """Why this module exists: jax.grad of the select loop is NaN."""
  got = jax.grad(_select_loop)(ragged.params(), ragged.batch(LENGTHS))
  assert not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))


def _primitives(jaxpr):
  found = set()
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found |= _primitives(sub)
  return found


def test_the_program_runs_no_conditional_until_differentiated():
  """The primal is jax.value_and_grad's program: no cond; jax.grad of it
  has the cond that drops an empty micro-batch's derivative."""
  loss = _loss_of("stacked aux", 4)
  batch = ragged.batch(LENGTHS)
  assert "cond" not in _primitives(
      jax.make_jaxpr(loss)(ragged.params(), batch).jaxpr)
  assert "cond" in _primitives(
      jax.make_jaxpr(jax.grad(loss))(ragged.params(), batch).jaxpr)


@pytest.mark.slow
def test_an_integer_aux_and_the_model_state_keep_their_derivatives():
  """empty_safe.value_and_grad directly: an integer leaf (no derivative),
  and the model state's derivative kept where the micro-batch is dropped."""
  def loss(p, state, mb):
    value = mean_loss(p, mb)
    return value, (state * p["w"].sum(), (jnp.int32(3), value))

  def state_of(p, keep):
    (_, (state, _)), _ = empty_safe.value_and_grad(
        loss, keep, p, jnp.float32(2), ragged.batch([0, 0]))
    return state

  for keep in (True, False):
    got = jax.grad(state_of)(ragged.params(), jnp.bool_(keep))
    np.testing.assert_allclose(got["w"], 2.0 * np.ones(DIM))
    np.testing.assert_array_equal(got["embed"], 0.0)


@pytest.mark.slow
def test_a_function_among_the_arguments_stays_a_python_value():
  """Extra arguments that are not arrays (an activation, a graphdef) reach
  loss_fn as they were given, under jax.grad too."""
  def loss(params, batch, act):
    h = act(params["embed"][batch["ids"]] @ params["w"])
    return ((batch["mask"] * (h - batch["y"]) ** 2).sum()
            / helpers.num_tokens(batch)), h.sum()

  fn = oa.value_and_grad(loss, num_microbatches=4, has_aux=True,
                         num_tokens_fn=helpers.num_tokens)
  batch = ragged.batch(LENGTHS)
  got = jax.jit(jax.grad(lambda p: fn(p, batch, jnp.tanh)[0][0]))(
      ragged.params())
  expected = jax.grad(mean_loss)(ragged.params(), batch)
  helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_vmapped_over_batches_the_derivative_stays_finite():
  """Batched, the cond is a select of its branches' results: the empty
  micro-batch's NaN branch is dropped, not multiplied by zero."""
  loss = _loss_of("stacked aux", 4)
  batches = [ragged.batch(LENGTHS), ragged.batch([1, 2, 3, 5, 1, 4, 2, 4])]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  got = jax.vmap(jax.grad(loss), in_axes=(None, 0))(ragged.params(), stacked)
  for i, batch in enumerate(batches):
    helpers.assert_trees_close(
        jax.tree.map(lambda g, i=i: g[i], got),
        jax.grad(mean_loss)(ragged.params(), batch), rtol=1e-5, atol=1e-7)
