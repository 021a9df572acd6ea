"""The docs' recipes in each form the docs offer them in.

A new user runs a recipe on one device first, then on a mesh with Explicit
axes or with Auto axes (``jax.make_mesh(..., axis_types=...)`` under
``jax.set_mesh``), with ``axis_name`` or without, as the next page suggests.
Each form either gives the full batch's result or is refused by an error of
ours that names the argument; none ends inside JAX. The recipes are the
README's (its tour and its DDP ``no_sync`` loop) and
``docs/coupled_losses.md``'s, with the same loss functions.
"""

import contextlib

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4  # micro-batches (or micro-steps, one jit call each) per update.
ROWS = 32  # per batch: 4 per device of 8, 1 per device per micro-batch.

# (mesh axis type or None for one device, axis_name).
FORMS = {
    "one device": (None, None),
    "explicit": (AxisType.Explicit, None),
    "explicit, axis_name": (AxisType.Explicit, "data"),
    "auto": (AxisType.Auto, None),
    "auto, axis_name": (AxisType.Auto, "data"),
}


def loss_fn(params, mb):  # the README's: mean over the unmasked rows.
  err = mb["mask"][:, None] * (mb["x"] @ params["w"] - mb["y"]) ** 2
  return err.sum() / jnp.maximum(mb["mask"].sum(), 1)


def num_tokens(mb):
  return mb["mask"].sum()


def _batch(seed=0, rows=ROWS):
  rng = np.random.default_rng(seed)
  mask = (rng.random(rows) < 0.6).astype(np.float32)
  mask[: rows // 8] = 0.0  # the first device's rows hold no token.
  return {"x": jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32),
          "mask": jnp.asarray(mask)}


def _params():
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}


@contextlib.contextmanager
def _form(axis_type, shape=(8,)):
  """Yields ``put(tree, spec)``: device_put under the form's mesh."""
  if axis_type is None:
    yield lambda tree, spec: tree
    return
  mesh = jax.make_mesh(shape, ("data",), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    yield jax.device_put


@pytest.mark.parametrize("form", FORMS)
def test_the_readme_tour_value_and_grad(form):
  axis_type, axis_name = FORMS[form]
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=K,
                              num_tokens_fn=num_tokens, axis_name=axis_name)
  batch = _batch()
  with _form(axis_type) as put:
    loss, grads = jax.jit(grad_fn)(put(_params(), P()), put(batch, P("data")))
  full_loss, full_grads = jax.value_and_grad(loss_fn)(_params(), batch)
  helpers.assert_trees_close((loss, grads), (full_loss, full_grads),
                             rtol=1e-5, atol=1e-6)


def encode(w, mb):  # docs/coupled_losses.md's.
  return {"a": jnp.tanh(mb["a"] @ w), "b": jnp.tanh(mb["b"] @ w)}


def info_nce(w, reps, batch):
  del w, batch
  logits = reps["a"] @ reps["b"].T
  return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=1)))


@pytest.mark.parametrize("form", [
    f if "axis_name" in f or f == "one device"
    else pytest.param(f, marks=pytest.mark.slow) for f in FORMS])
def test_the_coupled_losses_recipe(form):
  """On jax 0.9.1 the typed form gave D x the gradient of a parameter that
  encode_fn uses twice (a plain carry add of unreduced sums)."""
  axis_type, axis_name = FORMS[form]
  views = {"a": jax.random.normal(jax.random.key(0), (ROWS, 4))}
  views["b"] = views["a"] + 0.1 * jax.random.normal(jax.random.key(1),
                                                    (ROWS, 4))
  coupled = oa.coupled_value_and_grad(encode, info_nce, num_microbatches=K,
                                      axis_name=axis_name)
  with _form(axis_type) as put:
    loss, grads = jax.jit(coupled)(put(jnp.eye(4), P()),
                                   put(views, P("data")))
  full = jax.value_and_grad(
      lambda w: info_nce(w, encode(w, views), views))(jnp.eye(4))
  helpers.assert_trees_close((loss, grads), full, rtol=1e-5, atol=1e-6)


def _no_sync_update(accumulate_axis_name, batches, put):
  """The README's DDP ``no_sync`` loop, as written there: the params after
  one update of ``len(batches)`` jit calls."""
  tx = oa.accumulate(optax.sgd(0.5), every_k=len(batches),
                     axis_name=accumulate_axis_name)
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1,
                              num_tokens_fn=num_tokens,
                              gradient_sync="deferred")

  @jax.jit
  def micro_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=num_tokens(batch))
    return optax.apply_updates(params, updates), opt_state, loss

  params = put(_params(), P())
  opt_state = tx.init(params)
  for batch in batches:
    params, opt_state, _ = micro_step(params, opt_state, put(batch, P("data")))
  assert bool(oa.has_updated(opt_state))
  return params


def _full_batch_sgd(batches):
  whole = jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)
  grads = jax.grad(loss_fn)(_params(), whole)
  return jax.tree.map(lambda p, g: p - 0.5 * g, _params(), grads)


# accumulate's axis_name: the README gives none; docs/distributed.md gave one.
@pytest.mark.parametrize("form, accumulate_axis_name", [
    ("one device", None),  # Failed before: "deferred ... this call has none".
    ("explicit", None),
    ("explicit", "data"),
])
def test_the_readme_no_sync_loop(form, accumulate_axis_name):
  axis_type, _ = FORMS[form]
  batches = [_batch(seed) for seed in range(K)]
  with _form(axis_type) as put:
    params = _no_sync_update(accumulate_axis_name, batches, put)
  helpers.assert_trees_close(params, _full_batch_sgd(batches), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.slow
def test_the_readme_no_sync_loop_on_a_one_device_mesh():
  """Failed before: refused, though a data axis of size 1 has nothing to
  defer (a laptop's jax.make_mesh((1,), ...))."""
  batches = [_batch(seed) for seed in range(2)]
  with _form(AxisType.Explicit, shape=(1,)) as put:
    params = _no_sync_update(None, batches, put)
  helpers.assert_trees_close(params, _full_batch_sgd(batches), rtol=1e-5,
                             atol=1e-6)


def test_the_readme_no_sync_loop_is_refused_on_auto_axes_by_name():
  """Auto axes cannot carry ``unreduced``: README and SPEC 8 say so."""
  with _form(AxisType.Auto) as put:
    with pytest.raises(ValueError, match="gradient_sync='deferred'"):
      _no_sync_update(None, [_batch()], put)


def test_deferred_with_an_unsharded_batch_on_a_mesh_is_still_refused():
  """Eight devices each computing the whole batch's gradient: nothing to
  defer, and most likely a batch the user forgot to shard."""
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1,
                              num_tokens_fn=num_tokens,
                              gradient_sync="deferred")
  with _form(AxisType.Explicit) as put:
    with pytest.raises(ValueError, match=r"deferred.*has none.*Shard"):
      jax.jit(grad_fn)(put(_params(), P()), put(_batch(), P()))


def _activation_loss(params, mb, activation):
  """A loss that takes a non-array through ``*args`` (as an Equinox model's
  static part, ``loss_fn(diff, batch, static)`` in docs/equinox.md)."""
  err = mb["mask"][:, None] * (activation(mb["x"] @ params["w"]) - mb["y"])
  return (err**2).sum() / jnp.maximum(mb["mask"].sum(), 1)


@pytest.mark.parametrize("form", [
    "explicit", "explicit, axis_name", "auto", "auto, axis_name"])
def test_a_non_array_in_args_reaches_loss_fn(form):
  axis_type, axis_name = FORMS[form]
  grad_fn = oa.value_and_grad(_activation_loss, num_microbatches=K,
                              num_tokens_fn=num_tokens, axis_name=axis_name)
  batch = _batch()
  with _form(axis_type) as put:
    step = jax.jit(lambda p, b: grad_fn(p, b, jax.nn.relu))
    loss, grads = step(put(_params(), P()), put(batch, P("data")))
  full = jax.value_and_grad(_activation_loss)(_params(), batch, jax.nn.relu)
  helpers.assert_trees_close((loss, grads), full, rtol=1e-5, atol=1e-6)


def _embed_loss(params, mb, graphdef):
  """An nnx.Embed read with the out_sharding that Explicit axes ask for
  (docs/getting_started.md), naming the data axis."""
  embed = nnx.merge(graphdef, params)
  return jnp.mean(embed(mb["ids"], out_sharding=P("data", None)) ** 2)


def test_an_annotation_naming_an_auto_data_axis_gets_our_hint():
  """SPEC 10: with Auto axes and axis_name, loss_fn naming a data axis gets
  an error from optax_accum that says to use Explicit axes."""
  fn = oa.value_and_grad(_embed_loss, num_microbatches=K, equal_weights=True,
                         axis_name="data")
  graphdef, params = nnx.split(nnx.Embed(16, 4, rngs=nnx.Rngs(0)))
  batch = {"ids": jnp.arange(ROWS, dtype=jnp.int32) % 16}
  with _form(AxisType.Auto) as put:
    with pytest.raises(Exception) as info:
      jax.jit(fn, static_argnums=2)(put(params, P()), put(batch, P("data")),
                                    graphdef)
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert "AxisType.Explicit" in notes, (type(info.value), info.value, notes)
