"""Equinox models in both entry points (docs/equinox.md runs here).

The model split with ``eqx.partition(model, eqx.is_inexact_array)``: exact
against the full batch with uneven token counts, ``None`` leaves kept where
the static part is, the static part reaching ``loss_fn`` as given; on an
Explicit data mesh with the embedding lookup written for it. The mistakes
(the whole module as params, Equinox's ``loss(diff, static, batch)`` order)
get our errors, naming ``loss_fn``'s signature.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4
ROWS, DIM = 16, 3


def _model():
  return eqx.nn.MLP(DIM, 1, width_size=8, depth=1, activation=jax.nn.tanh,
                    key=jax.random.key(0))


def _batch():
  rng = np.random.default_rng(1)
  lengths = np.repeat([1, 4, 2, 3], ROWS // 4)  # uneven micro-batches
  return {"x": rng.normal(size=(ROWS, 4, DIM)).astype(np.float32),
          "y": rng.normal(size=(ROWS, 4)).astype(np.float32),
          "mask": (np.arange(4) < lengths[:, None]).astype(np.float32)}


def _loss(model, batch):
  pred = jax.vmap(jax.vmap(model))(batch["x"])[..., 0]
  err = batch["mask"] * (pred - batch["y"]) ** 2
  return err.sum() / batch["mask"].sum()


def _tokens(mb):
  return mb["mask"].sum()


def _full(model, batch):
  loss, grads = eqx.filter_value_and_grad(_loss)(model, batch)
  return loss, eqx.filter(grads, eqx.is_inexact_array)


def _nones(tree):
  """The paths of ``tree``'s None leaves."""
  return [p for p, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None)[0] if x is None]


@pytest.mark.slow
def test_value_and_grad_is_the_full_batchs_and_keeps_none_and_static():
  model, batch = _model(), _batch()
  diff, static = eqx.partition(model, eqx.is_inexact_array)
  seen = []

  def loss_fn(diff, mb, static):
    seen.append(static)
    return _loss(eqx.combine(diff, static), mb)

  fn = eqx.filter_jit(oa.value_and_grad(loss_fn, num_microbatches=K,
                                        num_tokens_fn=_tokens))
  loss, grads = fn(diff, batch, static)
  full_loss, full_grads = _full(model, batch)
  helpers.assert_trees_close((loss, grads), (full_loss, full_grads),
                             rtol=1e-5, atol=1e-6)
  # The negative control: the plain mean of the micro-batches' means.
  rows = ROWS // K
  mbs = [jax.tree.map(lambda x, i=i: x[i * rows:(i + 1) * rows], batch)
         for i in range(K)]
  plain = np.mean([_loss(model, mb) for mb in mbs])
  assert not np.isclose(plain, full_loss, rtol=1e-4)
  # None where diff has None (the activation functions), as Equinox has.
  assert _nones(grads) == _nones(diff) and _nones(diff)
  assert grads.activation is None and grads.layers[0].bias is not None
  # The static part reached loss_fn as given, its functions unchanged.
  assert all(s.activation is jax.nn.tanh for s in seen), seen
  assert eqx.tree_equal(eqx.combine(grads, static).activation, jax.nn.tanh)


@pytest.mark.slow
def test_accumulate_updates_as_the_full_batch_does():
  model, batch = _model(), _batch()
  params = eqx.filter(model, eqx.is_inexact_array)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  optim = oa.accumulate(inner, every_k=K)
  opt_state = optim.init(params)

  @eqx.filter_jit
  def micro_step(model, opt_state, mb):
    grads = eqx.filter_grad(_loss)(model, mb)
    updates, opt_state = optim.update(
        grads, opt_state, eqx.filter(model, eqx.is_inexact_array),
        num_tokens=_tokens(mb))
    return eqx.apply_updates(model, updates), opt_state, updates

  rows = ROWS // K
  for i in range(K):
    mb = jax.tree.map(lambda x, i=i: x[i * rows:(i + 1) * rows], batch)
    model, opt_state, updates = micro_step(model, opt_state, mb)
  assert _nones(updates) == _nones(params)
  full_updates, _ = inner.update(_full(_model(), batch)[1],
                                 inner.init(params), params)
  expected = eqx.apply_updates(_model(), full_updates)
  helpers.assert_trees_close(eqx.filter(model, eqx.is_inexact_array),
                             eqx.filter(expected, eqx.is_inexact_array),
                             rtol=1e-5, atol=1e-6)
  assert int(oa.find_accumulate_state(opt_state).count) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_the_whole_module_as_params_names_partition(jit):
  """Was JAX's "... of type custom_jvp is not a valid JAX type"."""
  fn = oa.value_and_grad(_loss, num_microbatches=K, num_tokens_fn=_tokens)
  fn = eqx.filter_jit(fn) if jit else fn
  with pytest.raises(TypeError, match=(
      r"params\.activation is a .*not an array.*eqx\.partition\(model,"
      r" eqx\.is_inexact_array\).*loss_fn\(diff, batch, static\).*params"
      r" first.*the batch second")):
    fn(_model(), _batch())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_equinoxs_usual_order_names_the_signature(jit):
  """loss(diff, static, batch): was "pass batch_axes=None for it"."""
  def loss_fn(diff, static, mb):
    return _loss(eqx.combine(diff, static), mb)

  diff, static = eqx.partition(_model(), eqx.is_inexact_array)
  fn = oa.value_and_grad(loss_fn, num_microbatches=K, num_tokens_fn=_tokens)
  fn = eqx.filter_jit(fn) if jit else fn
  with pytest.raises(TypeError, match=(
      r"batch\.activation is a .*not an array to split into micro-batches\."
      r" Is the batch loss_fn's second argument\?.*params first.*the batch"
      r" second.*not Equinox's usual loss\(diff, static, batch\)")):
    fn(diff, static, _batch())


@pytest.mark.slow
def test_the_guide_runs_and_is_exact_on_the_mesh(capsys):
  """docs/equinox.md: each entry point, and an Explicit data mesh."""
  ns = helpers.run_markdown_snippets("docs/equinox.md", min_blocks=4)
  printed = capsys.readouterr().out.splitlines()
  assert printed == ["True True", "True", "1", "True"], printed
  # The mesh's gradient (ns["grads"], of ns["model"] on the sharded batch)
  # is the unsharded full batch's.
  _, full_grads = eqx.filter_value_and_grad(ns["loss_fn"])(
      ns["model"], ns["batch"])
  helpers.assert_trees_close(
      jax.device_get(ns["grads"]),
      eqx.filter(full_grads, eqx.is_inexact_array), rtol=1e-5, atol=1e-6)
  assert ns["grads"].mlp.activation is None


def test_eqx_embedding_under_vmap_fails_on_an_explicit_mesh():
  """What the guide says of ``jax.vmap(eqx.nn.Embedding)``, full batch."""
  embed = eqx.nn.Embedding(16, 4, key=jax.random.key(0))
  ids = jnp.arange(32).reshape(8, 4) % 16
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    ids = jax.device_put(ids, P("data"))
    with pytest.raises(Exception, match=r"out_sharding"):
      jax.jit(jax.vmap(jax.vmap(embed)))(ids)


def test_accumulate_init_on_the_whole_module_names_the_fix():
  """Failed before: optax's init failed deep inside on a function leaf."""
  model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
  tx = oa.accumulate(optax.sgd(0.1), every_k=2)
  with pytest.raises(TypeError, match=r"params.*not an array.*eqx.filter"):
    tx.init(model)
  tx.init(eqx.filter(model, eqx.is_inexact_array))  # the fix works.


def test_coupled_value_and_grad_names_an_unfiltered_module():
  model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
  fn = oa.coupled_value_and_grad(
      lambda m, mb: mb, lambda m, reps, batch: jnp.sum(reps),
      num_microbatches=2)
  with pytest.raises(TypeError, match=r"params.*not an array"):
    fn(model, jnp.ones((4, 2)))
