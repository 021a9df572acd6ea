"""oa.scan_layers: a layer stack reduced inside the last backward loop.

Each step is checked against the full batch's gradient (uneven tokens, an
empty micro-batch), and its compiled program is read: the stacked leaf's
reduction sits in a loop, one layer's slice at a time, and no second
reduction of it follows. The negative control is the same model through
``lax.scan``: its stacked leaf is reduced after the loop, whole.
"""

from flax import linen as nn
from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.compiled import hlo_text
from optax_accum._src.microbatch import layer_sums

# Older JAX (0.9) runs lax.scan there: its compiler kept a second reduction.
ON = layer_sums.REDUCES_IN_LOOP

LAYERS, DIM, VOCAB, ROWS, K = 4, 16, 32, 64, 4


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  draw = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, dtype)
  return {"embed": draw(VOCAB, DIM), "layers": draw(LAYERS, DIM, DIM),
          "unembed": draw(DIM, VOCAB)}


def _batch(mask=None):
  rng = np.random.default_rng(1)
  if mask is None:
    mask = (rng.random(ROWS) < 0.6).astype(np.float32)
  return {"ids": jnp.asarray(rng.integers(0, VOCAB, ROWS), jnp.int32),
          "y": jnp.asarray(rng.normal(size=(ROWS, VOCAB)), jnp.float32),
          "mask": jnp.asarray(mask, jnp.float32)}


def _embed(table, ids):
  """``table[ids]``, typed where ``ids`` is sharded over Explicit axes."""
  spec = jax.typeof(ids).sharding.spec
  if not any(spec):  # inside shard_map, or replicated.
    return table[ids]
  return table.at[ids].get(out_sharding=P(*spec, None))


def _loss(scan, penalty=None, loss_dtype=None):
  def loss(params, batch):
    h = _embed(params["embed"], batch["ids"])
    h, _ = scan(lambda c, w: (jnp.tanh(c @ w), None), h, params["layers"])
    err = ((h @ params["unembed"]).astype(jnp.float32) - batch["y"]) ** 2
    mask = batch["mask"]
    out = (err.sum(-1) * mask).sum() / mask.sum()
    if penalty:  # a second use of the stacked leaf, outside the scan.
      out = out + penalty * (params["layers"].astype(jnp.float32) ** 2).sum()
    return out if loss_dtype is None else out.astype(loss_dtype)
  return loss


def _count(batch):
  return batch["mask"].sum()


def _mesh(kind=AxisType.Explicit):
  return jax.make_mesh((8,), ("data",), axis_types=(kind,))


def _step(loss, form="shard_map", **kwargs):
  grad_fn = oa.value_and_grad(loss, num_microbatches=K, num_tokens_fn=_count,
                              axis_name="data", **kwargs)
  if form == "shard_map":
    mesh = _mesh()
    fn = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=P()))
  else:  # Auto axes: the runner makes them manual for the call.
    mesh = _mesh(AxisType.Auto)
    fn = jax.jit(grad_fn)

  def run(params, batch):
    with jax.set_mesh(mesh):
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      params = jax.device_put(params, NamedSharding(mesh, P()))
      return fn(params, batch), fn.lower(params, batch).compile().as_text()

  return run


def _reductions(text):
  """``(computation is the entry, result shapes)`` of each all-reduce."""
  entry, computations = hlo_text.parse(text)
  return [(name == entry, [(t, tuple(d)) for t, d in
                          hlo_text.result_shapes(line)])
          for name, body in computations.items()
          for opcode, _, line in body
          if opcode in ("all-reduce", "all-reduce-start")]


def _reduced_in_loop(text):
  """Whether one layer's slice is all-reduced in a loop body, and whether
  the stacked leaf is all-reduced whole."""
  found = _reductions(text)
  layer = ("f32", (DIM, DIM))
  stack = ("f32", (LAYERS, DIM, DIM))
  in_loop = any(not at_entry and layer in shapes for at_entry, shapes in found)
  whole = any(stack in shapes for _, shapes in found)
  return in_loop, whole


def _full(params, batch, **kwargs):
  return jax.value_and_grad(_loss(lax.scan, **kwargs))(params, batch)


def _assert_exact_and_reduced_in_loop(loss, params, batch):
  """``loss(scan)``'s step matches its full batch through ``lax.scan``, and
  the stack's layers are reduced in the loop."""
  got, text = _step(loss(oa.scan_layers), overlap_reduction=True)(
      params, batch)
  want = jax.value_and_grad(loss(lax.scan))(params, batch)
  helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (ON, not ON)


@pytest.mark.parametrize("form", ["shard_map", "auto"])
def test_exact_and_each_layer_reduced_in_the_backward_loop(form):
  params, batch = _params(), _batch()
  (loss, grads), text = _step(_loss(oa.scan_layers), form,
                              overlap_reduction=True)(params, batch)
  want_loss, want = _full(params, batch)
  helpers.assert_trees_close((loss, grads), (want_loss, want),
                                 rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (ON, not ON)
  # One reduction per leaf: the stack's slices, the rest in one after it.
  entry = [shapes for at_entry, shapes in _reductions(text) if at_entry]
  assert len(entry) == 1 and ("f32", (VOCAB, DIM)) in entry[0]
  assert ON or ("f32", (LAYERS, DIM, DIM)) in entry[0]
  # oa.check_train_step counts the layer loop's slices once per trip: every
  # leaf reduced once per update, no more.
  check = oa.check_train_step(text, num_microbatches=K, data_axes="data",
                              mesh=_mesh(), params=params)
  assert check.reduced_elements == check.gradient_elements


def test_negative_control_lax_scan_reduces_the_stack_after_the_loop():
  params, batch = _params(), _batch()
  _, text = _step(_loss(lax.scan), overlap_reduction=True)(params, batch)
  assert _reduced_in_loop(text) == (False, True)


def test_without_overlap_reduction_it_is_lax_scan():
  params, batch = _params(), _batch()
  (loss, grads), text = _step(_loss(oa.scan_layers))(params, batch)
  helpers.assert_trees_close((loss, grads), _full(params, batch),
                                 rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (False, True)


def test_a_second_use_of_the_stack_keeps_its_gradient():
  params, batch = _params(), _batch()
  (loss, grads), text = _step(_loss(oa.scan_layers, penalty=0.1),
                              overlap_reduction=True)(params, batch)
  helpers.assert_trees_close(
      (loss, grads), _full(params, batch, penalty=0.1), rtol=1e-5, atol=1e-6)
  in_loop, whole = _reduced_in_loop(text)
  assert in_loop == ON and whole  # the penalty's part reduced after the loop.


def test_an_empty_last_microbatch_adds_nothing():
  # Device 3's last micro-batch (rows 30, 31 of its 8) has no tokens.
  mask = np.ones(ROWS, np.float32)
  mask[30:32] = 0.0
  params, batch = _params(), _batch(mask)
  (loss, grads), _ = _step(_loss(oa.scan_layers),
                           overlap_reduction=True)(params, batch)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  helpers.assert_trees_close((loss, grads), _full(params, batch),
                                 rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_dtype", [None, jnp.bfloat16])
def test_bf16_params_summed_in_float32_match_lax_scan(loss_dtype):
  """Half-precision parameters with a float32 accumulator: the in-loop sum
  is in the accumulator's dtype. A bfloat16 loss cannot carry the token
  weight as its seed exactly: then the stack is reduced after the loop."""
  params, batch = _params(jnp.bfloat16), _batch()
  kwargs = dict(overlap_reduction=True, accumulator_dtype=jnp.float32)
  got, text = _step(_loss(oa.scan_layers, loss_dtype=loss_dtype),
                    **kwargs)(params, batch)
  want, _ = _step(_loss(lax.scan, loss_dtype=loss_dtype), **kwargs)(
      params, batch)
  helpers.assert_trees_close(
      jax.tree.map(lambda x: x.astype(jnp.float32), got),
      jax.tree.map(lambda x: x.astype(jnp.float32), want), rtol=2e-2,
      atol=2e-2)
  seeded = loss_dtype is None and ON
  assert _reduced_in_loop(text) == (seeded, not seeded)


@pytest.mark.parametrize("kwargs", [
    dict(equal_weights=True),
    dict(loss_reduction="sum", num_tokens_fn=lambda b: jnp.float32(8.0)),
])
def test_counts_the_same_on_every_device(kwargs):
  """A weight that does not vary by device seeds a loss that does."""
  params, batch = _params(), _batch()

  def step(scan):
    grad_fn = oa.value_and_grad(_loss(scan), num_microbatches=K,
                                axis_name="data", overlap_reduction=True,
                                **kwargs)
    mesh = _mesh()
    fn = jax.jit(jax.shard_map(grad_fn, mesh=mesh,
                               in_specs=(P(), P("data")), out_specs=P()))
    with jax.set_mesh(mesh):
      b = jax.device_put(batch, NamedSharding(mesh, P("data")))
      return fn(params, b), fn.lower(params, b).compile().as_text()

  got, text = step(oa.scan_layers)
  helpers.assert_trees_close(got, step(lax.scan)[0], rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (ON, not ON)


def test_the_typed_form_runs_lax_scan():
  """Explicit data axes under jax.jit: exact, the stack reduced after."""
  params, batch = _params(), _batch()
  mesh = _mesh()
  fn = jax.jit(oa.value_and_grad(_loss(oa.scan_layers), num_microbatches=K,
                                 num_tokens_fn=_count,
                                 overlap_reduction=True))
  with jax.set_mesh(mesh):
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    got, text = fn(p, b), fn.lower(p, b).compile().as_text()
  helpers.assert_trees_close(got, _full(params, batch), rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (False, True)


def test_closed_over_weights_ys_and_reverse():
  """The layer reads a weight it closes over and returns a per-layer output
  the loss uses; the scan runs in reverse."""

  def loss(scan):
    def fn(params, batch):
      h = _embed(params["embed"], batch["ids"])

      def layer(c, w):
        c = jnp.tanh(c @ w + c @ params["shared"])
        return c, (c ** 2).mean(-1)  # one per row.

      h, ys = scan(layer, h, params["layers"], reverse=True)
      err = ((h @ params["unembed"] - batch["y"]) ** 2).sum(-1)
      mask = batch["mask"]
      per_row = err + (ys * jnp.arange(LAYERS)[:, None]).sum(0)
      return (per_row * mask).sum() / mask.sum()
    return fn

  params = {**_params(), "shared": _params()["layers"][0] * 0.5}
  batch = _batch()
  _assert_exact_and_reduced_in_loop(loss, params, batch)


def test_outside_value_and_grad_it_is_lax_scan():
  xs = {"w": jnp.stack([jnp.eye(3) * i for i in range(1, 4)]),
        "b": jnp.ones((3, 3))}
  f = lambda c, x: (jnp.sin(c @ x["w"] + x["b"]), c.sum())
  init = jnp.arange(6.0).reshape(2, 3)
  for reverse in (False, True):
    got = oa.scan_layers(f, init, xs, reverse=reverse)
    want = lax.scan(f, init, xs, reverse=reverse)
    helpers.assert_trees_close(got, want)
    g = jax.grad(lambda xs: oa.scan_layers(f, init, xs)[0].sum())(xs)
    helpers.assert_trees_close(
        g, jax.grad(lambda xs: lax.scan(f, init, xs)[0].sum())(xs))


def test_an_integer_carry_falls_back_to_lax_scan():
  def loss(params, batch):
    h = _embed(params["embed"], batch["ids"])

    def layer(carry, w):
      c, n = carry
      return (jnp.tanh(c @ w), n + 1), None

    (h, _), _ = oa.scan_layers(layer, (h, jnp.int32(0)), params["layers"])
    err = ((h @ params["unembed"] - batch["y"]) ** 2).sum(-1)
    return (err * batch["mask"]).sum() / batch["mask"].sum()

  params, batch = _params(), _batch()
  (value, grads), text = _step(loss, overlap_reduction=True)(params, batch)
  helpers.assert_trees_close((value, grads), _full(params, batch),
                                 rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (False, True)


def test_a_stack_of_zero_layers_is_lax_scan_s():
  """No layer to run: as lax.scan, where x[0] raised IndexError."""
  params, batch = _params(), _batch()
  params["layers"] = jnp.zeros((0, DIM, DIM))
  (value, grads), _ = _step(_loss(oa.scan_layers), overlap_reduction=True)(
      params, batch)
  helpers.assert_trees_close((value, grads), _full(params, batch),
                             rtol=1e-5, atol=1e-6)
  assert grads["layers"].shape == (0, DIM, DIM)


def test_a_stack_given_twice_is_summed_once():
  """The same stacked leaf twice in ``xs`` (and a second scan over it): its
  running sum is added once; the other uses' gradient is reduced after."""

  def loss(scan):
    def fn(params, batch):
      h = _embed(params["embed"], batch["ids"])
      w = params["layers"]
      h, _ = scan(lambda c, ws: (jnp.tanh(c @ ws[0] + c @ ws[1]), None), h,
                  (w, w))
      h, _ = scan(lambda c, w: (jnp.tanh(c @ w), None), h, w)
      err = ((h @ params["unembed"] - batch["y"]) ** 2).sum(-1)
      return (err * batch["mask"]).sum() / batch["mask"].sum()
    return fn

  params, batch = _params(), _batch()
  got, text = _step(loss(oa.scan_layers), overlap_reduction=True)(
      params, batch)
  want = jax.value_and_grad(loss(lax.scan))(params, batch)
  helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  assert _reduced_in_loop(text) == (ON, True)


def _flax_loss(api):
  """``_loss``'s model as a Flax module (NNX or linen) whose parameters the
  train step splits out and merges back in ``loss_fn``: the stacked leaf
  still reaches ``scan_layers`` as the array the loop differentiates."""
  def forward(embed, layers, unembed, batch, scan):
    h, _ = scan(lambda c, w: (jnp.tanh(c @ w), None), embed[batch["ids"]],
                layers)
    err = ((h @ unembed - batch["y"]) ** 2).sum(-1)
    return (err * batch["mask"]).sum() / batch["mask"].sum()

  if api == "nnx":
    class Model(nnx.Module):
      def __init__(self, params):
        for name, value in params.items():
          setattr(self, name, nnx.Param(value))

      def __call__(self, batch, scan):
        return forward(self.embed[...], self.layers[...], self.unembed[...],
                       batch, scan)

    graphdef, state = nnx.split(Model(_params()), nnx.Param)
    return state, lambda scan: (
        lambda s, batch: nnx.merge(graphdef, s)(batch, scan))

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, batch, scan):
      got = {k: self.param(k, lambda _, v=v: v) for k, v in _params().items()}
      return forward(got["embed"], got["layers"], got["unembed"], batch, scan)

  params = Linen().init(jax.random.key(0), _batch(), lax.scan)["params"]
  return params, lambda scan: (
      lambda p, batch: Linen().apply({"params": p}, batch, scan))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_flax_model_s_stack_is_reduced_in_the_loop(api):
  params, loss = _flax_loss(api)
  batch = _batch()
  _assert_exact_and_reduced_in_loop(loss, params, batch)


def _wrapped_loss(how):
  """``_loss``'s model under a transformation of the loss's own: a
  ``jax.grad`` penalty through it first, ``jax.vmap`` over its rows,
  ``jax.checkpoint`` around it, or around each layer."""

  def loss(scan):
    def fn(params, batch):
      h0 = _embed(params["embed"], batch["ids"])
      layer = lambda c, w: (jnp.tanh(c @ w), None)
      if how == "remat_layer":
        layer = jax.checkpoint(layer)
      model = lambda h: scan(layer, h, params["layers"])[0]
      per_row = 0.0
      if how == "grad_penalty":
        per_row = 0.1 * (jax.grad(lambda h: model(h).sum())(h0) ** 2).sum(-1)
      if how == "vmap":
        h = jax.vmap(model)(h0[:, None])[:, 0]
      elif how == "checkpoint":
        h = jax.checkpoint(model)(h0)
      else:
        h = model(h0)
      per_row = per_row + ((h @ params["unembed"] - batch["y"]) ** 2).sum(-1)
      return (per_row * batch["mask"]).sum() / batch["mask"].sum()
    return fn

  return loss


@pytest.mark.parametrize("how, in_loop", [
    ("grad_penalty", ON),  # the penalty's own scan is lax.scan's.
    ("vmap", False),
    ("checkpoint", False),
    ("remat_layer", ON),
])
def test_inside_the_loss_s_own_transformations_it_is_lax_scan(how, in_loop):
  """Inside a transformation ``loss_fn`` applies itself, the backward is
  not the one the running sums reach: there it is ``lax.scan``, exactly
  (before, a nested ``jax.grad`` crashed and ``jax.vmap`` lost the earlier
  micro-batches' sum of the stack). The loss's own use of the stack is
  still reduced in the loop; remat inside the layer keeps it too."""
  params, batch = _params(), _batch()
  loss = _wrapped_loss(how)
  got, text = _step(loss(oa.scan_layers), overlap_reduction=True)(
      params, batch)
  want = jax.value_and_grad(loss(lax.scan))(params, batch)
  helpers.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  in_loop_seen, whole = _reduced_in_loop(text)
  assert in_loop_seen == in_loop
  # The penalty's stack gradient is reduced after the loop.
  assert whole == (how == "grad_penalty" or not in_loop)


def _squares(tree):
  return sum((x.astype(jnp.float32) ** 2).sum() for x in jax.tree.leaves(tree))


def _meta(grad_of, mode):
  """A derivative of a gradient: of its squared norm (a gradient penalty,
  reverse over reverse), or along all-ones (a Hessian-vector product)."""

  def fn(params, batch):
    if mode == "grad_of_grad":
      return jax.grad(lambda p: _squares(grad_of(p, batch)))(params)
    ones = jax.tree.map(jnp.ones_like, params)
    return jax.jvp(lambda p: grad_of(p, batch), (params,), (ones,))[1]

  return fn


@pytest.mark.parametrize("form", ["shard_map", "auto"])
@pytest.mark.parametrize("mode", ["grad_of_grad", "hvp"])
def test_a_derivative_of_the_step_s_gradient_is_exact(form, mode):
  """Differentiated in turn, with device 0's last micro-batch empty, the
  step's gradient has the full batch's derivative. Before, a gradient
  penalty through it was NaN under shard_map: the empty micro-batch's 0/0
  met the zero cotangent of the select that drops it."""
  mask = np.ones(ROWS, np.float32)
  mask[6:8] = 0.0  # device 0's last micro-batch (its rows 6 and 7).
  params, batch = _params(), _batch(mask)
  grad_fn = oa.value_and_grad(_loss(oa.scan_layers), num_microbatches=K,
                              num_tokens_fn=_count, axis_name="data",
                              overlap_reduction=True)
  fn = _meta(lambda p, b: grad_fn(p, b)[1], mode)
  if form == "shard_map":
    mesh = _mesh()
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                       out_specs=P())
  else:
    mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    got = jax.jit(fn)(jax.device_put(params, NamedSharding(mesh, P())),
                      jax.device_put(batch, NamedSharding(mesh, P("data"))))
  want = _meta(jax.grad(_loss(lax.scan)), mode)(params, batch)
  helpers.assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
