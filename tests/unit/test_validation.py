"""Bad input is rejected early, with a message naming argument and value."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa


def _loss(params, batch):
  return jnp.mean(batch["x"] * params)


@pytest.mark.parametrize(
    "every_k, error",
    [(0, ValueError), (-3, ValueError), (2.0, TypeError), ("4", TypeError),
     (True, TypeError), ([2], TypeError)],
)
def test_every_k_rejected_at_construction(every_k, error):
  with pytest.raises(error, match=rf"every_k.*{re.escape(repr(every_k))}"):
    oa.accumulate(optax.sgd(0.1), every_k)


def test_numpy_int_every_k_is_accepted():
  import numpy as np  # pylint: disable=g-import-not-at-top
  oa.accumulate(optax.sgd(0.1), np.int64(3))


@pytest.mark.parametrize("loss_reduction", ["avg", "MEAN", None, 1])
def test_loss_reduction_rejected(loss_reduction):
  pattern = rf"loss_reduction.*mean.*got {re.escape(repr(loss_reduction))}"
  with pytest.raises(ValueError, match=pattern):
    oa.accumulate(optax.sgd(0.1), 2, loss_reduction=loss_reduction)
  with pytest.raises(ValueError, match=pattern):
    oa.value_and_grad(_loss, num_microbatches=2, loss_reduction=loss_reduction)


@pytest.mark.parametrize("dtype", [jnp.int32, "bool", "not-a-dtype"])
def test_accumulator_dtype_rejected(dtype):
  with pytest.raises((TypeError, ValueError), match="accumulator_dtype"):
    oa.accumulate(optax.sgd(0.1), 2, accumulator_dtype=dtype)
  with pytest.raises((TypeError, ValueError), match="accumulator_dtype"):
    oa.value_and_grad(_loss, num_microbatches=2, accumulator_dtype=dtype)


@pytest.mark.parametrize("axis_name", [0, ("data", 1), ()])
def test_axis_name_rejected(axis_name):
  pattern = rf"axis_name.*{re.escape(repr(axis_name))}"
  with pytest.raises(TypeError, match=pattern):
    oa.accumulate(optax.sgd(0.1), 2, axis_name=axis_name)
  with pytest.raises(TypeError, match="axis_name"):
    oa.value_and_grad(_loss, num_microbatches=2, axis_name=axis_name)


def test_skip_nonfinite_must_be_bool():
  with pytest.raises(TypeError, match=r"skip_nonfinite.*'yes'"):
    oa.accumulate(optax.sgd(0.1), 2, skip_nonfinite="yes")


def test_inner_must_be_a_gradient_transformation():
  with pytest.raises(TypeError, match=r"inner.*function"):
    oa.accumulate(lambda g: g, 2)


@pytest.mark.parametrize(
    "num_microbatches, error",
    [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError),
     (None, TypeError)],
)
def test_num_microbatches_rejected(num_microbatches, error):
  pattern = rf"num_microbatches.*{re.escape(repr(num_microbatches))}"
  with pytest.raises(error, match=pattern):
    oa.value_and_grad(_loss, num_microbatches=num_microbatches)


def test_loss_fn_and_num_tokens_fn_must_be_callable():
  with pytest.raises(TypeError, match="loss_fn"):
    oa.value_and_grad(3, num_microbatches=2)
  with pytest.raises(TypeError, match="num_tokens_fn"):
    oa.value_and_grad(_loss, num_microbatches=2, num_tokens_fn=3)


def test_batch_must_divide_into_micro_batches():
  fn = oa.value_and_grad(_loss, num_microbatches=4)
  with pytest.raises(ValueError, match=r"batch size 6.*num_microbatches=4"):
    fn(jnp.float32(1.0), {"x": jnp.ones(6)})


def test_batch_leaves_must_share_a_leading_size():
  def loss(params, batch):
    return jnp.mean(batch["x"] * params) + jnp.mean(batch["y"])

  fn = oa.value_and_grad(loss, num_microbatches=2)
  pattern = r"share the size of their batch axis.*'x'.*8.*'y'.*6"
  with pytest.raises(ValueError, match=pattern):
    fn(jnp.float32(1.0), {"x": jnp.ones(8), "y": jnp.ones(6)})


def test_scalar_batch_leaf_rejected():
  fn = oa.value_and_grad(lambda p, b: p * b, num_microbatches=2)
  with pytest.raises(ValueError, match="scalar"):
    fn(jnp.float32(1.0), jnp.float32(2.0))


def test_loss_must_be_scalar_and_aux_a_pair():
  fn = oa.value_and_grad(lambda p, b: b * p, num_microbatches=2)
  with pytest.raises((ValueError, TypeError), match="scalar"):
    fn(jnp.float32(1.0), jnp.ones(4))
  fn = oa.value_and_grad(_loss, num_microbatches=2, has_aux=True)
  with pytest.raises(ValueError, match=r"\(loss, aux\)"):
    fn(jnp.float32(1.0), {"x": jnp.ones(4)})


def test_grads_with_another_structure_than_params_rejected():
  tx = oa.accumulate(optax.sgd(0.1), 2)
  state = tx.init({"w": jnp.zeros(3), "b": jnp.zeros(2)})
  with pytest.raises(ValueError, match=r"updates.*structure"):
    tx.update({"w": jnp.zeros(3)}, state)
  with pytest.raises(ValueError, match=r"updates\['b'\].*\(4,\).*\(2,\)"):
    tx.update({"w": jnp.zeros(3), "b": jnp.zeros(4)}, state)


def test_prefixes_of_the_params_name_their_missing_and_extra_keys():
  """accumulator_dtype, grad_reduction and aux_reduction: one helper."""
  params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
  for kwargs in ({"accumulator_dtype": {"a": jnp.float32}},
                 {"grad_reduction": {"a": "mean"}}):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=(
        rf"{name} must be .* prefix .*; it has no entry for \['b'\]\.")):
      oa.accumulate(optax.sgd(0.1), 2, **kwargs).init(params)
  aux_fn = oa.value_and_grad(
      lambda p, x: (jnp.sum(p["a"]) * x.sum(), {"s": x.sum(), "m": x.max()}),
      num_microbatches=2, has_aux=True, equal_weights=True,
      aux_reduction={"s": "mean", "n": "max"})
  with pytest.raises(ValueError, match=(
      r"aux_reduction .*; its entries at \['n'\] match no leaf; it has no"
      r" entry for \['m'\]\.")):
    aux_fn(params, jnp.ones(4))


def test_structure_errors_name_paths_not_a_model_states_whole_treedef():
  """An NNX state's PyTreeDef runs to thousands of characters (issue 28)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Net(nnx.Module):

    def __init__(self, head: bool):
      rngs = nnx.Rngs(0)
      self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(6)])
      if head:
        self.head = nnx.Linear(4, 2, rngs=rngs)

  params = nnx.state(Net(head=False), nnx.Param)
  grads = nnx.state(Net(head=True), nnx.Param)
  tx = oa.accumulate(optax.sgd(0.1), 2)
  state = tx.init(params)
  with pytest.raises(ValueError) as error:
    tx.update(grads, state, params, num_tokens=1.0)
  assert str(error.value) == (
      "updates must have the structure of the params the state was built"
      " for: it has ['head']['bias'].value, ['head']['kernel'].value, not in"
      " the params the state was built for.")
  with pytest.raises(ValueError, match=r"containers differ \(a dict,"
                     r" expected a State\)") as error:
    tx.update(dict(params), state, params, num_tokens=1.0)
  assert len(str(error.value)) < 300
  with pytest.raises(ValueError, match=r"it has \['head'\]\['bias'\]"
                     r"\.value, \['head'\]\['kernel'\]\.value, not in params"):
    oa.apply_if_updated(params, grads, state)
  with pytest.raises(ValueError, match=(
      r"; its entries at \['head'\] match no leaf; it has no entry for"
      r" \['layers'\]\[0\]\['bias'\]\.value, .* and 9 more\.$")):
    oa.accumulate(optax.sgd(0.1), 2, grad_reduction={"head": "max"}).init(
        params)


def test_num_tokens_must_be_a_scalar():
  tx = oa.accumulate(optax.sgd(0.1), 2)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"num_tokens.*\(3,\)"):
    jax.jit(tx.update)(params, state, params, num_tokens=jnp.ones(3))


def test_every_k_callable_must_return_an_integer_scalar():
  tx = oa.accumulate(optax.sgd(0.1), lambda count: 2.5)
  params = {"w": jnp.zeros(3)}
  with pytest.raises(TypeError, match=r"every_k\(count\).*float"):
    tx.update(params, tx.init(params), params)


def test_value_and_grad_names_loss_fn_when_its_loss_is_not_a_scalar():
  batch = {"x": jnp.ones(8)}
  per_row = oa.value_and_grad(lambda w, mb: mb["x"] * w, num_microbatches=2)
  with pytest.raises(ValueError, match=r"must return a scalar loss.*\(4,\)"):
    per_row(jnp.float32(1.0), batch)
  no_aux = oa.value_and_grad(lambda w, mb: jnp.sum(mb["x"] * w),
                             num_microbatches=2, has_aux=True)
  with pytest.raises(ValueError, match=r"pair \(loss, aux\).*single array"):
    no_aux(jnp.float32(1.0), batch)
