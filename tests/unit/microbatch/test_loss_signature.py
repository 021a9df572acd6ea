"""How oa.value_and_grad calls loss_fn: mistakes named at trace time.

- ``has_aux=False`` with a loss that returns ``(loss, aux)`` names
  ``has_aux`` (it used to end in a TracerArrayConversionError from our own
  scalar check).
- A loss that needs ``rng``, called without ``rng=`` or with the key passed
  positionally, names ``rng=`` (it used to be a plain Python TypeError, or,
  for a positional ``rng`` parameter, one key silently shared by every
  micro-batch).
- Losses that take their key in other ways get no false alarm.
"""

import functools
import re

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import optax_accum as oa

K = 2


def _batch():
  return {"x": jnp.arange(8.0).reshape(4, 2)}


def _mse(w, mb):
  return jnp.mean((mb["x"] @ w) ** 2)


def _dropout(w, mb, rng):
  keep = jax.random.bernoulli(rng, 0.5, mb["x"].shape)
  return _mse(w, {"x": jnp.where(keep, mb["x"], 0.0)})


def _fn(loss_fn, **kwargs):
  return jax.jit(oa.value_and_grad(loss_fn, num_microbatches=K,
                                   equal_weights=True, **kwargs))


# --------------------------------------------------------------------------
# has_aux


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_loss_returning_loss_and_aux_without_has_aux_names_has_aux(jit):
  def loss_and_aux(w, mb):
    return _mse(w, mb), {"norm": jnp.sum(w ** 2)}

  fn = oa.value_and_grad(loss_and_aux, num_microbatches=K,
                         equal_weights=True)
  fn = jax.jit(fn) if jit else fn
  with pytest.raises(TypeError, match=r"returned a tuple of 2 but"
                     r" has_aux=False.*has_aux=True"):
    fn(jnp.ones(2), _batch())
  (_, aux), _ = _fn(loss_and_aux, has_aux=True)(jnp.ones(2), _batch())
  assert aux["norm"].shape == (K,)


def test_loss_returning_a_dict_names_the_scalar_loss():
  fn = _fn(lambda w, mb: {"loss": _mse(w, mb)})
  with pytest.raises(TypeError, match=r"must return a scalar loss.*dict"):
    fn(jnp.ones(2), _batch())


def _one(with_aux, with_state):
  """A loss_fn returning the Python float 1.0 (and aux, state as asked)."""
  def loss_fn(w, *rest):
    del w
    aux = {"n": 2.0}
    if with_state:
      return 1.0, ((rest[0], aux) if with_aux else rest[0])
    return (1.0, aux) if with_aux else 1.0
  return loss_fn


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("has_aux,has_state,overlap", [
    (False, False, False), (True, False, False), (False, True, False),
    (True, True, False), (False, False, True)],
    ids=["plain", "aux", "state", "aux_state", "overlap_shard_map"])
def test_a_python_float_loss_has_zero_gradients_as_in_jax(
    jit, has_aux, has_state, overlap):
  """As jax.value_and_grad; it was "'float' object has no attribute
  'dtype'" from the loop."""
  fn = oa.value_and_grad(
      _one(has_aux, has_state), num_microbatches=K, equal_weights=True,
      has_aux=has_aux, has_state=has_state, overlap_reduction=overlap,
      axis_name="data" if overlap else None)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
  if overlap:
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                       out_specs=P())
  fn = jax.jit(fn) if jit else fn
  state = (jnp.zeros(3),) if has_state else ()
  with jax.set_mesh(mesh):
    batch = jax.device_put(_batch(), P("data")) if overlap else _batch()
    value, grads = fn(jnp.ones(2), *state, batch)
  loss = value[0] if has_aux or has_state else value
  np.testing.assert_array_equal(loss, 1.0)
  np.testing.assert_array_equal(grads, jnp.zeros(2))

@pytest.mark.parametrize("k", [1, 2])
def test_an_integer_loss_is_named_not_differentiated_to_zeros(k):
  """An integer loss (a count of correct answers) has no gradient: named,
  where jax.vjp (each micro-batch seeded with its count) gave zeros."""
  fn = oa.value_and_grad(
      lambda w, mb: jnp.sum(mb["x"] @ w > 0).astype(jnp.int32),
      num_microbatches=k, num_tokens_fn=lambda mb: jnp.float32(2))
  with pytest.raises(TypeError, match=r"real floating-point loss, got dtype"
                     r" int32"):
    jax.jit(fn)(jnp.ones(2), _batch())


def test_an_integer_parameter_is_named_by_its_path():
  fn = _fn(lambda p, mb: _mse(p["w"], mb))
  with pytest.raises(TypeError, match=r"params\['step'\] has dtype int32.*"
                     r"no gradient"):
    fn({"w": jnp.ones(2), "step": jnp.int32(3)}, _batch())


@pytest.mark.parametrize("aux_reduction", ["stack", "mean"])
def test_an_aux_leaf_that_is_not_an_array_is_named(aux_reduction):
  fn = _fn(lambda w, mb: (_mse(w, mb), {"tag": "run-1"}), has_aux=True,
           aux_reduction=aux_reduction)
  with pytest.raises(TypeError, match=r"aux\['tag'\] is a str"):
    fn(jnp.ones(2), _batch())


@pytest.mark.parametrize("new_state, match", [
    (lambda s: {"c": jnp.zeros(3)}, r"new_model_state\['c'\] is float32\[3\]"
     r" where the model_state given holds float32\[\]"),
    (lambda s: {"c": s["c"].astype(jnp.int32)},
     r"new_model_state\['c'\] is int32\[\]"),
    (lambda s: {"d": s["c"]}, r"structure of the model_state"),
], ids=["shape", "dtype", "structure"])
def test_a_model_state_that_changes_type_is_named(new_state, match):
  """Not jax's 'scan body function carry' error: the new model state is
  named, with the leaf and what it was given."""
  fn = _fn(lambda w, s, mb: (_mse(w, mb), new_state(s)), has_state=True)
  with pytest.raises(TypeError, match=match):
    fn(jnp.ones(2), {"c": jnp.zeros(())}, _batch())


def test_coupled_value_and_grad_names_an_integer_loss():
  def encode(p, mb):
    return {"a": mb["x"] @ p}

  fn = oa.coupled_value_and_grad(
      encode, lambda p, reps, mb: jnp.int32(1), num_microbatches=K)
  with pytest.raises(TypeError, match=r"real floating-point loss"):
    fn(jnp.ones(2), _batch())


# --------------------------------------------------------------------------
# rng


def _keyword_only(w, mb, *, rng):
  return _dropout(w, mb, rng)


@pytest.mark.parametrize("loss_fn", [_keyword_only, _dropout],
                         ids=["keyword_only", "positional"])
def test_loss_needing_rng_called_without_it_names_rng(loss_fn):
  with pytest.raises(TypeError, match=r"parameter rng has no default.*"
                     r"without rng=.*fn\(params, batch, \*args, rng=key\)"):
    _fn(loss_fn)(jnp.ones(2), _batch())


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)],
                         ids=["typed", "raw"])
def test_key_passed_positionally_names_rng(key):
  with pytest.raises(TypeError, match=r"positional argument 0 after the"
                     r" batch is a PRNG key.*rng=key"):
    _fn(_keyword_only)(jnp.ones(2), _batch(), key)
  # A positional rng parameter would take it, one key for every
  # micro-batch: the same dropout mask everywhere, silently. Refused too.
  with pytest.raises(TypeError, match=r"the same key for every"
                     r" micro-batch.*rng=key"):
    _fn(_dropout)(jnp.ones(2), _batch(), key)


def test_rng_given_to_a_loss_without_rng_names_rng():
  with pytest.raises(TypeError, match=r"called with rng=.*takes no rng"
                     r" parameter"):
    _fn(_mse)(jnp.ones(2), _batch(), rng=jax.random.key(0))


@pytest.mark.slow
def test_losses_that_take_their_key_otherwise_raise_nothing():
  key, w, batch = jax.random.key(0), jnp.ones(2), _batch()

  def star_args(*args, **kwargs):
    return _keyword_only(*args, **kwargs)

  def star_positional(*args):  # a wrapper: nothing to tell from its *args.
    return _dropout(*args)

  def var_kwargs(w, mb, **kwargs):
    return _keyword_only(w, mb, rng=kwargs["rng"])

  def optional(w, mb, *, rng=None):
    return _mse(w, mb) if rng is None else _keyword_only(w, mb, rng=rng)

  def other_key(w, mb, noise_key):  # a key, not named rng: the user's own.
    return _dropout(w, mb, noise_key)

  class Model(nnx.Module):
    def __call__(self, w, mb, *, rng):
      return _keyword_only(w, mb, rng=rng)

  for loss_fn, args, kwargs in [
      (_keyword_only, (), {"rng": key}),
      (_dropout, (), {"rng": key}),  # positional, passed by keyword: fine.
      (star_args, (), {"rng": key}),
      (star_positional, (key,), {}),
      (var_kwargs, (), {"rng": key}),
      (optional, (), {}),
      (optional, (), {"rng": key}),
      (functools.partial(_keyword_only, rng=key), (), {}),
      (functools.partial(_dropout, rng=key), (), {}),
      (other_key, (key,), {}),
      (jax.jit(_keyword_only), (), {"rng": key}),
      (Model(), (), {"rng": key}),
  ]:
    loss, _ = _fn(loss_fn)(w, batch, *args, **kwargs)
    assert jnp.isfinite(loss), loss_fn


def test_other_call_mistakes_keep_their_own_error():
  def needs_scale(w, mb, scale):
    return scale * _mse(w, mb)

  with pytest.raises(TypeError, match=r"missing 1 required positional"
                     r" argument: 'scale'"):
    _fn(needs_scale)(jnp.ones(2), _batch())


# --------------------------------------------------------------------------
# The order of fn's arguments: params, the batch, the rest.

_ORDER = r"params first.*the batch second.*\*args or a closure"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_function_among_the_params_names_the_leaf_and_partition(jit):
  """Was JAX's "... is not a valid JAX type" (an unfiltered Equinox model)."""
  fn = oa.value_and_grad(lambda p, mb: _mse(p["w"], mb), num_microbatches=K,
                         equal_weights=True)
  call = lambda mb: fn({"w": jnp.ones(2), "act": jax.nn.relu}, mb)
  with pytest.raises(TypeError, match=r"params\['act'\] is a .*not an array"
                     r".*eqx.partition\(model, eqx.is_inexact_array\).*"
                     + _ORDER):
    jax.jit(call)(_batch()) if jit else call(_batch())


@pytest.mark.parametrize("static, error, message", [
    ({"act": jax.nn.relu}, TypeError, r"batch\['act'\] is a .*not an array"),
    ({"act": None}, ValueError, r"at least one array, got \{'act': None\}"),
    ({"n": 3, "bias": jnp.float32(1)}, ValueError, r"all are scalars"),
])
def test_a_batch_that_is_not_the_second_argument_names_the_order(
    static, error, message):
  """Equinox's loss(diff, static, batch): the static part taken as the batch.

  Was "pass batch_axes=None for it", or "at least one array" alone.
  """
  def eqx_order(w, static, mb):
    return _mse(w, mb)

  fn = oa.value_and_grad(eqx_order, num_microbatches=K, equal_weights=True)
  with pytest.raises(error, match=message + r".*second argument\?.*"
                     + _ORDER):
    fn(jnp.ones(2), static, _batch())
  loss, _ = oa.value_and_grad(lambda w, mb, static: eqx_order(w, static, mb),
                              num_microbatches=K, equal_weights=True)(
                                  jnp.ones(2), _batch(), static)
  assert jnp.isfinite(loss)


def _tutorial(w, x, y):  # only x is split: y reaches the loss whole.
  return jnp.mean((x @ w - y) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_later_argument_of_the_batchs_size_gets_a_note(jit):
  """``loss(params, x, y)``: JAX's broadcasting error, with our note."""
  x = _batch()["x"]
  fn = oa.value_and_grad(_tutorial, num_microbatches=K, equal_weights=True)
  fn = jax.jit(fn) if jit else fn
  with pytest.raises(TypeError, match="incompatible shapes") as info:
    fn(jnp.ones(2), x, jnp.ones(4))
  notes = [n for n in getattr(info.value, "__notes__", ())
           if n.startswith("optax_accum")]
  assert len(notes) == 1, info.value
  assert re.search(r"only the batch.* is split into micro-batches \(of 2"
                   r" rows here\): fn's \*args\[0\] \(leading size 4\)"
                   r".*fn\(params, \(x, y\)\)", notes[0]), notes[0]
  # The fix: both in the batch.
  fixed = oa.value_and_grad(lambda w, b: _tutorial(w, *b),
                            num_microbatches=K, equal_weights=True)
  loss, _ = fixed(jnp.ones(2), (x, jnp.ones(4)))
  np.testing.assert_allclose(loss, _tutorial(jnp.ones(2), x, jnp.ones(4)),
                             rtol=1e-5)


def test_a_keyword_argument_of_the_batchs_size_gets_the_note_too():
  fn = oa.value_and_grad(lambda w, x, *, y: _tutorial(w, x, y),
                         num_microbatches=K, equal_weights=True)
  with pytest.raises(TypeError, match="incompatible shapes") as info:
    fn(jnp.ones(2), _batch()["x"], y=jnp.ones(4))
  assert any(n.startswith("optax_accum") and "y= (leading size 4)" in n
             for n in getattr(info.value, "__notes__", ())), info.value


def test_no_note_where_no_later_argument_has_the_batchs_size():
  fn = oa.value_and_grad(_tutorial, num_microbatches=K, equal_weights=True)
  with pytest.raises(TypeError, match="incompatible shapes") as info:
    fn(jnp.ones(2), _batch()["x"], jnp.ones(3))
  assert not any(n.startswith("optax_accum")
                 for n in getattr(info.value, "__notes__", ()))


@pytest.mark.skipif(not hasattr(P(), "unreduced"),
                    reason="the typed form needs jax's unreduced types")
def test_the_note_on_an_explicit_mesh():
  """The typed form re-raises loss_fn's own error, with the note."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  fn = jax.jit(oa.value_and_grad(_tutorial, num_microbatches=K,
                                 equal_weights=True))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((16, 2)), P("data"))
    y = jax.device_put(jnp.ones(16), P("data"))
    with pytest.raises(TypeError, match="incompatible shapes") as info:
      fn(jnp.ones(2), x, y)
  assert any(n.startswith("optax_accum") and "*args[0] (leading size 16)" in n
             for n in getattr(info.value, "__notes__", ())), info.value


def _stacked_loss(w, mb):  # docs/flax.md's masked mean over (rows, ...).
  err = mb["mask"][:, None] * (mb["x"] @ w - mb["y"]) ** 2
  return err.sum() / jnp.maximum(mb["mask"].sum(), 1.0)


def _stacked_batch(k, micro):
  rng = np.random.default_rng(0)
  return {"x": jnp.asarray(rng.normal(size=(k, micro, 3)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(k, micro, 2)), jnp.float32),
          "mask": jnp.ones((k, micro), jnp.float32)}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_batch_stacked_as_k_micro_gets_a_note(jit):
  """A batch the user already stacked as ``(k, micro, ...)``: split again,
  each micro-batch is ``(1, micro, ...)``, and the loss fails to broadcast.
  JAX's error stays, with our note naming the fix."""
  k, micro, w = 4, 8, jnp.ones((3, 2))
  fn = oa.value_and_grad(_stacked_loss, num_microbatches=k,
                         num_tokens_fn=lambda mb: mb["mask"].sum())
  fn = jax.jit(fn) if jit else fn
  stacked = _stacked_batch(k, micro)
  with pytest.raises(TypeError, match="incompatible shapes") as info:
    fn(w, stacked)
  notes = [n for n in getattr(info.value, "__notes__", ())
           if n.startswith("optax_accum")]
  assert len(notes) == 1, info.value
  assert re.search(r"num_microbatches=4 micro-batches holds one row.*"
                   r"shape \(4, 8\), its micro-batches \(1, 8\).*already"
                   r" stacked as \(k, micro, \.\.\.\).*unstacked, as"
                   r" \(k \* micro, \.\.\.\)", notes[0]), notes[0]
  # The fix, as the note writes it: the same loss as on the whole batch.
  unstacked = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), stacked)
  loss, grads = fn(w, unstacked)
  full = jax.value_and_grad(_stacked_loss)(w, unstacked)
  np.testing.assert_allclose(loss, full[0], rtol=1e-5)
  np.testing.assert_allclose(grads, full[1], rtol=1e-5, atol=1e-6)


def test_no_stacked_note_where_micro_batches_hold_several_rows():
  def bad_loss(w, mb):  # fails on any batch: (rows, 1, 3) @ (2, 3).
    return jnp.sum(mb["x"][:, None] @ w.T)
  fn = oa.value_and_grad(bad_loss, num_microbatches=2, equal_weights=True)
  with pytest.raises(TypeError) as info:
    fn(jnp.ones((3, 2)), {"x": jnp.ones((8, 4, 3))})
  assert not any("already stacked" in n
                 for n in getattr(info.value, "__notes__", ())), info.value
