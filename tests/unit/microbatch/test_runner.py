"""``runner``: every form runs the same stages, exactly.

The support matrix (``test_support_matrix.py``) crosses forms, meshes and
layouts; this module checks the runner's own decisions on cases that once
failed: a size-1 data axis next to an Auto FSDP axis (an XLA RET_CHECK),
Explicit inputs without ``jax.set_mesh``, a replicated batch on an Explicit
mesh, tensor-parallel parameters (a reduce-scatter JAX cannot type), and an
Auto-sharded batch outside ``jax.set_mesh`` (resharded every step before).
"""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import forms

DIM, HIDDEN, ROWS = 8, 8, 32


def _loss(params, batch):
  hidden = jnp.tanh(helpers.add_bias(batch["x"] @ params["w1"], params["b1"]))
  # A contraction, not (hidden * w2).sum(-1): JAX types w2 reduced so.
  pred = jnp.einsum("...h,h->...", hidden, params["w2"],
                    out_sharding=readers.explicit_spec(batch["y"]))
  token_losses = batch["mask"] * (pred - batch["y"]) ** 2
  return helpers.safe_mean(token_losses, batch)


def _problem():
  rng = np.random.default_rng(0)
  batch = {
      "x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
      "y": rng.normal(size=(ROWS,)).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.6).astype(np.float32),
  }
  return helpers.mlp_params(DIM, HIDDEN, seed=1), batch


def _expected(params, batch):
  host = jax.tree.map(np.asarray, (params, batch))
  return jax.value_and_grad(_loss)(*host)


def _fn(k=2, **kwargs):
  return oa.value_and_grad(_loss, num_microbatches=k,
                           num_tokens_fn=helpers.num_tokens, **kwargs)


def _assert_exact(out, params, batch):
  loss, grads = jax.tree.map(np.asarray, out)
  expected_loss, expected_grads = _expected(params, batch)
  helpers.assert_trees_close(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_size_one_data_axis_next_to_auto_fsdp_axis():
  """Flax lm1b's default layout: (data=1, fsdp=8), Auto axes."""
  mesh = jax.make_mesh((1, 8), ("data", "fsdp"),
                       axis_types=(AxisType.Auto,) * 2)
  params, batch = _problem()
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, {
        "w1": NamedSharding(mesh, P("fsdp")),
        "b1": NamedSharding(mesh, P("fsdp")), "w2": NamedSharding(mesh, P()),
    })
    out = jax.jit(_fn(axis_name="data"))(
        sharded, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  _assert_exact(out, params, batch)


@pytest.mark.parametrize("axis_name", [None, "data"])
def test_explicit_inputs_without_set_mesh(axis_name):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()
  out = jax.jit(_fn(axis_name=axis_name))(
      jax.device_put(params, NamedSharding(mesh, P())),
      jax.device_put(batch, NamedSharding(mesh, P("data"))))
  _assert_exact(out, params, batch)


def test_replicated_batch_on_an_explicit_mesh_is_sliced_locally():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()
  fn = jax.jit(_fn(axis_name="data"))
  with jax.set_mesh(mesh):
    out = fn(params, batch)
    compiled = fn.lower(params, batch).compile()
  counts = oa.count_collectives(compiled, include_scalars=False)
  _assert_exact(out, params, batch)
  # One reduction after the loop (in it, the loss's and the token count's
  # scalars); the batch is neither gathered nor moved.
  assert set(oa.count_collectives(compiled).total) == {"all-reduce"}, counts
  assert not counts.in_loop, counts


def test_tensor_parallel_and_fsdp_params_on_explicit_axes():
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  params, batch = _problem()
  with jax.set_mesh(mesh):
    sharded = {
        "w1": jax.device_put(params["w1"], P("data", "model")),
        "b1": jax.device_put(params["b1"], P("model")),
        "w2": jax.device_put(params["w2"], P("model")),
    }
    out = jax.jit(_fn(axis_name="data"))(
        sharded, jax.device_put(batch, P("data")))
    assert jax.typeof(out[1]["w1"]).sharding.spec == P("data", "model")
  _assert_exact(out, params, batch)


@pytest.mark.slow
def test_auto_sharded_batch_outside_set_mesh_is_not_resharded():
  """The inputs' Auto mesh is entered, so the batch is split strided."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params, batch = _problem()
  operands = (jax.device_put(params, NamedSharding(mesh, P())),
              jax.device_put(batch, NamedSharding(mesh, P("data"))))
  fn = _fn(k=2)
  counts = oa.count_collectives(jax.jit(fn).lower(*operands).compile())
  assert set(counts.total) == {"all-reduce"}, counts
  _assert_exact(fn(*operands), params, batch)


def test_without_the_inputs_mesh_the_batch_is_gathered(monkeypatch):
  """The negative control of the test above: the old behaviour."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params, batch = _problem()
  operands = (jax.device_put(params, NamedSharding(mesh, P())),
              jax.device_put(batch, NamedSharding(mesh, P("data"))))
  monkeypatch.setattr(forms, "entered",
                      lambda form: forms.nullcontext())
  split = batching.split
  monkeypatch.setattr(batching, "split", lambda *a, **k: split(
      *a, **{**k, "sharded_layout_for_auto": False}))
  counts = oa.count_collectives(jax.jit(_fn(k=2)).lower(*operands).compile())
  assert "all-gather" in counts.total, counts


@pytest.mark.slow
def test_coupled_with_tensor_parallel_reps():
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  params, batch = _problem()
  encode = lambda p, mb: jnp.tanh(mb["x"] @ p["w1"] + p["b1"])

  def loss(p, reps, mb):
    del p, mb
    return jnp.sum(reps**2) / jnp.sum(jnp.abs(reps))

  fn = oa.coupled_value_and_grad(encode, loss, num_microbatches=2,
                                 axis_name="data")
  with jax.set_mesh(mesh):
    sharded = {"w1": jax.device_put(params["w1"], P(None, "model")),
               "b1": jax.device_put(params["b1"], P("model")),
               "w2": jax.device_put(params["w2"], P())}
    value, grads = jax.jit(fn)(sharded, jax.device_put(batch, P("data")))
  host = jax.tree.map(np.asarray, (params, batch))
  expected = jax.value_and_grad(
      lambda p: loss(p, encode(p, host[1]), host[1]))(host[0])
  helpers.assert_trees_close(
      jax.tree.map(np.asarray, (value, grads)), expected, rtol=1e-5,
      atol=1e-6)


@pytest.mark.parametrize("axis_name", [None, "data"])
def test_a_second_call_with_new_values_does_not_retrace(axis_name):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _problem()
  chex.clear_trace_counter()  # counts are kept by function, across tests.
  step = jax.jit(chex.assert_max_traces(_fn(axis_name=axis_name), n=1))
  with jax.set_mesh(mesh):
    step(params, batch)
    out = step(params, jax.tree.map(lambda x: x + 1.0, batch))
  # The other batch has other tokens: its own full-batch gradient.
  _assert_exact(out, params, jax.tree.map(lambda x: x + 1.0, batch))


def test_model_state_that_differs_by_device_comes_back_as_one():
  """A key in the state (NNX's dropout stream), folded by device: no crash.

  Floating leaves are averaged over the devices; a key or an int is the
  first device's. (With Auto axes, where loss_fn sees one device's slice;
  with Explicit ones the state is global: tests/forms/test_typed_form.py.)
  """
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def loss(w, state, mb, *, rng):
    _, seen, scale = state
    return jnp.mean(mb * w), (rng, seen + jnp.int32(mb.shape[0]),
                              scale + jnp.mean(mb))

  fn = oa.value_and_grad(loss, num_microbatches=2, has_state=True,
                         axis_name="data", equal_weights=True)
  state = (jax.random.key(0), jnp.int32(0), jnp.float32(0.0))
  with jax.set_mesh(mesh):
    batch = jax.device_put(jnp.arange(16.0), P("data"))
    (_, (key, seen, scale)), _ = jax.jit(fn)(1.0, state, batch,
                                             rng=jax.random.key(1))
  # The first device's last micro-batch key: device 0, micro-batch 1.
  expected = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), 0), 1)
  np.testing.assert_array_equal(jax.random.key_data(key),
                                jax.random.key_data(expected))
  assert int(seen) == 2  # each device's count: one row per micro-batch.
  # Each device adds its 2 micro-batches' means; the devices' mean of that:
  np.testing.assert_allclose(float(scale), 2 * np.arange(16.0).mean(),
                             rtol=1e-6)
