"""``update``'s extra arguments over a window: ``value``, ``grad``,
``value_fn``, in every form of ``accumulate``, against the full batch."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

N = 8


def _probe():
  """An inner optimizer that keeps the ``value`` and ``grad`` it got."""

  def init(params):
    return {"value": jnp.zeros([], jnp.float32),
            "grad": jax.tree.map(jnp.zeros_like, params)}

  def update(updates, state, params=None, *, value, grad=None, **extra):
    del state, params, extra
    grad = updates if grad is None else grad
    return updates, {"value": jnp.asarray(value, jnp.float32), "grad": grad}

  return optax.GradientTransformationExtraArgs(init, update)


def _grads(i):
  return {"w": jnp.full(3, float(i + 1))}


def _got(state):
  return float(state.inner_state["value"])


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_value_is_the_windows_token_weighted_mean(loss_reduction):
  tx = oa.accumulate(_probe(), every_k=4, loss_reduction=loss_reduction,
                     skip_nonfinite=True)
  params = helpers.vector_params()
  state = tx.init(params)
  nan = {"w": jnp.full(3, jnp.nan)}
  # (grads, value, tokens): an empty micro-step (0/0 value) and a dropped
  # one (NaN gradient) add nothing.
  steps = [(_grads(0), 2.0, 3.0), (_grads(1), jnp.nan, 0.0),
           (nan, 100.0, 5.0), (_grads(2), 6.0, 1.0)]
  update = jax.jit(tx.update)
  for g, value, n in steps:
    _, state = update(g, state, params, num_tokens=n,
                      value=jnp.float32(value))
  assert oa.has_updated(state)
  if loss_reduction == "mean":  # values are means over n tokens.
    expected = (3 * 2.0 + 1 * 6.0) / 4
  else:  # values are sums: the window's per-token mean loss.
    expected = (2.0 + 6.0) / 4
  np.testing.assert_allclose(_got(state), expected, rtol=1e-6)


def test_the_emitting_calls_value_alone_is_not_what_inner_gets():
  # Negative control of the test above: the last value is 6.0.
  tx = oa.accumulate(_probe(), every_k=2)
  params = helpers.vector_params()
  state = tx.init(params)
  for g, value, n in [(_grads(0), 2.0, 3.0), (_grads(2), 6.0, 1.0)]:
    _, state = tx.update(g, state, params, num_tokens=n, value=value)
  assert _got(state) == 3.0 != 6.0


def test_grad_is_the_windows_mean_gradient():
  tx = oa.accumulate(_probe(), every_k=2)
  params = helpers.vector_params()
  state = tx.init(params)
  for i, n in [(0, 3.0), (2, 1.0)]:
    _, state = tx.update(_grads(i), state, params, num_tokens=n,
                         value=1.0, grad=_grads(i))
  helpers.assert_trees_close(state.inner_state["grad"],
                             {"w": jnp.full(3, (3 * 1 + 1 * 3) / 4)})


def _plateau_chain():
  return optax.chain(
      optax.sgd(0.1),
      optax.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=0,
                                      accumulation_size=1))


@pytest.mark.slow
def test_reduce_on_plateau_matches_the_full_batch():
  # Each window's full-batch loss falls while its last micro-batch's rises:
  # fed the last micro-batch's loss, the plateau logic would halve the
  # learning rate on every update.
  k, updates = 2, 6
  tx = oa.accumulate(_plateau_chain(), every_k=k)
  full = _plateau_chain()
  params = helpers.vector_params()
  state, full_state, last_state = tx.init(params), full.init(params), (
      full.init(params))
  update = jax.jit(tx.update)
  scales, full_scales, last_scales = [], [], []
  for u in range(updates):
    values, tokens = [10.0 - u, 1.0 + u], [3.0, 1.0]
    grads = [_grads(u), _grads(u + 1)]
    for g, v, n in zip(grads, values, tokens):
      _, state = update(g, state, params, num_tokens=n, value=v)
    mean_grad = jax.tree.map(lambda a, b: (3 * a + b) / 4, *grads)
    mean_value = (3 * values[0] + values[1]) / 4
    _, full_state = full.update(mean_grad, full_state, params,
                                value=mean_value)
    _, last_state = full.update(mean_grad, last_state, params,
                                value=values[-1])
    scales.append(float(optax.tree.get(state, "scale")))
    full_scales.append(float(optax.tree.get(full_state, "scale")))
    last_scales.append(float(optax.tree.get(last_state, "scale")))
  assert scales == full_scales == [1.0] * updates
  assert last_scales[-1] == 0.5 ** (updates - 1)  # the silent failure.


def _least_squares(seed=0, rows=12):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(rows,)), jnp.float32)
  mask = jnp.asarray(rng.integers(0, 2, size=(rows,)), jnp.float32)
  mask = mask.at[0].set(1.0)
  return {"x": x, "y": y, "mask": mask}


def _ls_loss(params, batch):
  err = batch["x"] @ params["w"] - batch["y"]
  return (batch["mask"] * err**2).sum() / jnp.maximum(batch["mask"].sum(), 1)


@pytest.mark.slow
def test_zoom_linesearch_inside_accumulate_matches_the_full_batch():
  batch, k = _least_squares(), 3
  micro = helpers.split(batch, k)
  opt = lambda: optax.chain(optax.sgd(1.0),
                            optax.scale_by_zoom_linesearch(max_linesearch_steps=8))
  tx = oa.accumulate(opt(), every_k=k, value_fn_over_window=True)
  full = opt()
  params = full_params = {"w": jnp.zeros(4)}
  state, full_state = tx.init(params), full.init(full_params)
  value_fn = lambda p: _ls_loss(p, batch)

  def step(tx, params, state, mb, num_tokens):
    value, g = jax.value_and_grad(_ls_loss)(params, mb)
    return tx.update(g, state, params, value=value, grad=g,
                     value_fn=value_fn, **num_tokens)

  micro_step = jax.jit(lambda *a: step(tx, *a, {"num_tokens": a[-1][
      "mask"].sum()}))
  full_step = jax.jit(lambda *a: step(full, *a, {}))
  for _ in range(3):
    for mb in micro:
      updates, state = micro_step(params, state, mb)
    params = optax.apply_updates(params, updates)
    updates, full_state = full_step(full_params, full_state, batch)
    full_params = optax.apply_updates(full_params, updates)
    helpers.assert_trees_close(params, full_params, rtol=1e-5, atol=1e-6)
  assert float(_ls_loss(params, batch)) < float(
      _ls_loss({"w": jnp.zeros(4)}, batch))


def test_value_fn_is_refused_without_value_fn_over_window():
  tx = oa.accumulate(
      optax.chain(optax.sgd(1.0), optax.scale_by_zoom_linesearch(8)), 2)
  params = helpers.vector_params()
  with pytest.raises(ValueError, match="value_fn_over_window=True") as e:
    tx.update(_grads(0), tx.init(params), params, value=1.0,
              grad=_grads(0), value_fn=lambda p: 0.0)
  assert "oa.value_and_grad" in str(e.value)


@pytest.mark.parametrize("value", [jnp.ones(2), "loss", jnp.complex64(1.0)])
def test_value_must_be_a_real_scalar(value):
  tx = oa.accumulate(_probe(), 2)
  params = helpers.vector_params()
  with pytest.raises(TypeError, match="value must be a real scalar"):
    tx.update(_grads(0), tx.init(params), params, value=value)


def test_value_over_devices_inside_shard_map():
  # Each device passes its own micro-batch's mean loss and token count;
  # inner gets the window's mean over every device's tokens.
  tx = oa.accumulate(_probe(), every_k=2, axis_name="data")
  rng = np.random.default_rng(0)
  values = rng.normal(size=(2, N)).astype(np.float32)
  tokens = rng.integers(0, 5, size=(2, N)).astype(np.float32)
  tokens[0, 0] = 0.0
  values[0, 0] = np.nan  # a device with no tokens: its 0/0 is not seen.

  def micro_step(state, g, value, n):
    g = jax.tree.map(lambda x: x[0], g)
    _, state = tx.update(g, state, {"w": jnp.zeros(3)}, num_tokens=n[0],
                         value=value[0])
    return state

  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    state = tx.init(helpers.vector_params())
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(
        micro_step, in_specs=(specs, P("data"), P("data"), P("data")),
        out_specs=specs))
    for i in range(2):
      g = {"w": jnp.ones((N, 3))}
      state = step(state, g, jnp.asarray(values[i]), jnp.asarray(tokens[i]))
  kept = tokens > 0
  expected = (np.where(kept, values, 0) * tokens).sum() / tokens.sum()
  np.testing.assert_allclose(float(state.inner_state["value"]), expected,
                             rtol=1e-5)


@pytest.mark.skipif(
    not hasattr(P(), "unreduced") or not hasattr(jax.sharding, "reshard"),
    reason="unreduced sharding types need jax >= 0.9.1")
@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.parametrize("axis_name", [None, "data"])
def test_value_under_jit_with_deferred_gradients(axis_name):
  # The typed form (no axis_name) and the slots form: the loss that
  # value_and_grad returns is the batch's, replicated.
  tx = oa.accumulate(_probe(), every_k=2, axis_name=axis_name)
  loss = lambda p, b: helpers.safe_mean(helpers.linear_token_losses(p, b), b)
  grad_fn = oa.value_and_grad(
      loss, num_microbatches=1, num_tokens_fn=helpers.num_tokens,
      axis_name="data", gradient_sync="deferred")
  batches = helpers.uneven_micro_batches(2, seed=1, rows=N, seq=4, dim=3,
                                         devices=N)

  @jax.jit
  def micro_step(params, state, batch):
    value, grads = grad_fn(params, batch)
    _, state = tx.update(grads, state, params,
                         num_tokens=helpers.num_tokens(batch), value=value)
    return state

  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params = jax.device_put(helpers.linear_params(3), P())
    state = tx.init(params)
    for b in batches:
      state = micro_step(params, state, jax.device_put(b, P("data")))
  whole = jax.tree.map(lambda *x: jnp.concatenate(x), *batches)
  expected = loss(helpers.linear_params(3), whole)
  np.testing.assert_allclose(float(state.inner_state["value"]),
                             float(expected), rtol=1e-5)


@pytest.mark.slow
def test_float64_gradients_are_summed_in_float64():
  with jax.enable_x64(True):
    params = {"w": jnp.zeros(2, jnp.float64)}
    grads = [{"w": jnp.array([1.0, 1e-9])}, {"w": jnp.array([1.0, 0.0])}]

    def mean_of(tx):
      state = tx.init(params)
      for g in grads:
        updates, state = tx.update(g, state, params, num_tokens=1)
      return -updates["w"]

    exact = mean_of(oa.accumulate(optax.sgd(1.0), 2))
    assert exact.dtype == jnp.float64
    assert oa.accumulate(optax.sgd(1.0), 2).init(params).grad_sum[
        "w"].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(exact), [1.0, 0.5e-9], rtol=1e-12)
    # Negative control: a float32 sum loses the 1e-9 part.
    lossy = mean_of(oa.accumulate(optax.sgd(1.0), 2,
                                  accumulator_dtype=jnp.float32))
    assert float(lossy[1]) != 0.5e-9


def test_bfloat16_gradients_are_summed_in_float32_by_default():
  params = {"w": jnp.zeros(2, jnp.bfloat16), "v": jnp.zeros(2)}
  state = oa.accumulate(optax.sgd(1.0), 2).init(params)
  assert state.grad_sum["w"].dtype == jnp.float32
  state = oa.accumulate(optax.sgd(1.0), 2,
                        accumulator_dtype={"w": jnp.bfloat16, "v": None}
                        ).init(params)
  assert state.grad_sum["w"].dtype == jnp.bfloat16
  assert state.grad_sum["v"].dtype == jnp.float32
