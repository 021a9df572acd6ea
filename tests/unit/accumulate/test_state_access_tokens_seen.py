"""oa.tokens_seen: the tokens behind every emitted update, kept in the state.

It counts the token counts that the emitted means divided by: kept
micro-steps only, over every device with ``axis_name`` (inside shard_map,
and under jit on deferred, unreduced gradients), and it survives a
checkpoint like the rest of the state.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import helpers
import optax_accum as oa

N = 8  # simulated devices (tests/conftest.py).
SEQ, DIM = 4, 3


def _params():
  return helpers.linear_params(DIM)


def _loss(params, batch):
  return helpers.safe_mean(helpers.linear_token_losses(params, batch), batch)


def _micro_batches(rows, num, seed=0):
  rng = np.random.default_rng(seed)
  return [jax.tree.map(jnp.asarray, helpers.padded_batch(
      rng, rng.integers(0, SEQ + 1, size=rows), SEQ, DIM))
          for _ in range(num)]


def test_counts_the_kept_tokens_of_emitted_updates():
  tx = optax.chain(optax.scale(1.0), oa.accumulate(
      optax.sgd(0.1), every_k=2, skip_nonfinite=True,
      should_skip=lambda g, state, p: state.micro_step == 1))
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen = []
  # (gradient, tokens): cycles of two; the second micro-step of each cycle
  # is dropped by should_skip; a NaN gradient by skip_nonfinite; a cycle
  # without tokens emits nothing.
  for g, n in [(1.0, 3), (1.0, 4), (np.nan, 5), (1.0, 2), (1.0, 0),
               (1.0, 0), (1.0, 6)]:
    _, state = update({"w": jnp.full(3, g, jnp.float32)}, state, params,
                      num_tokens=n)
    seen.append(float(oa.tokens_seen(state)))
  assert seen == [0.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
  assert oa.tokens_seen(state).dtype == jnp.float32
  assert oa.tokens_seen(state).shape == ()


def test_equal_weights_count_a_micro_step_as_one():
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, equal_weights=True)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  for _ in range(5):
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
  assert float(oa.tokens_seen(state)) == 4.0


def test_does_not_drift_over_billions_of_tokens():
  """A plain float32 sum of 1e6-token updates drifts by thousands."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=1)
  params = {"w": jnp.zeros(1)}
  tokens = 1_000_003.0
  steps = 3000

  def body(state, _):
    _, state = tx.update({"w": jnp.ones(1)}, state, params,
                         num_tokens=tokens)
    return state, None

  state, _ = jax.jit(lambda s: jax.lax.scan(body, s, length=steps))(
      tx.init(params))
  exact = tokens * steps
  assert abs(float(oa.tokens_seen(state)) - exact) <= 256  # float32 ulp
  naive = jax.lax.scan(lambda t, _: (t + jnp.float32(tokens), None),
                       jnp.float32(0), length=steps)[0]
  assert abs(float(naive) - exact) > 1000


@pytest.mark.slow
def test_resumes_from_a_checkpoint_mid_run(tmp_path):
  tx = oa.accumulate(optax.adam(0.1), every_k=3)
  micro_batches = _micro_batches(rows=4, num=10)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch))
    return optax.apply_updates(params, updates), state

  params, state = _params(), tx.init(_params())
  for batch in micro_batches[:4]:  # one update, one micro-step more
    params, state = step(params, state, batch)
  first = float(sum(helpers.num_tokens(b) for b in micro_batches[:3]))
  assert float(oa.tokens_seen(state)) == first
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", (params, state))
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(
        tmp_path / "ckpt", jax.eval_shape(lambda: (_params(),
                                                   tx.init(_params()))))
  helpers.assert_trees_equal(restored, (params, state))
  resumed_params, resumed = restored
  for batch in micro_batches[4:]:
    params, state = step(params, state, batch)
    resumed_params, resumed = step(resumed_params, resumed, batch)
  helpers.assert_trees_equal(resumed, state)
  assert float(oa.tokens_seen(resumed)) == float(
      sum(helpers.num_tokens(b) for b in micro_batches[:9]))


def _mesh(axis_type):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def test_sums_over_devices_inside_shard_map():
  """Each device's own num_tokens, differing by device: their sum counts."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, axis_name="data")
  micro_batches = _micro_batches(rows=2 * N, num=5)

  def micro_step(params, state, batch):
    grads = jax.grad(_loss)(oa.device_local(params, "data"), batch)
    _, state = tx.update(grads, state, params,
                         num_tokens=helpers.num_tokens(batch))
    return state, oa.tokens_seen(state)

  with jax.set_mesh(_mesh(AxisType.Auto)):
    params = _params()
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    assert specs.tokens_seen == P()
    step = jax.jit(jax.shard_map(
        micro_step, in_specs=(P(), specs, P("data")),
        out_specs=(specs, P())))
    for batch in micro_batches:
      state, seen = step(params, state, batch)
  expected = float(sum(helpers.num_tokens(b) for b in micro_batches[:4]))
  np.testing.assert_allclose(float(seen), expected)
  assert float(oa.tokens_seen(state)) == float(seen)


@pytest.mark.skipif(
    not hasattr(P(), "unreduced") or not hasattr(jax.sharding, "reshard"),
    reason="unreduced sharding types need jax >= 0.9.1")
def test_sums_over_devices_under_jit_on_deferred_gradients():
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, axis_name="data")
  grad_fn = oa.value_and_grad(
      _loss, num_microbatches=1, num_tokens_fn=helpers.num_tokens,
      axis_name="data", gradient_sync="deferred")
  micro_batches = _micro_batches(rows=2 * N, num=5)

  @jax.jit
  def micro_step(params, state, batch):
    _, grads = grad_fn(params, batch)
    _, state = tx.update(grads, state, params,
                         num_tokens=helpers.num_tokens(batch))
    return state

  with jax.set_mesh(_mesh(AxisType.Explicit)):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    for batch in micro_batches:
      state = micro_step(params, state, jax.device_put(batch, P("data")))
    seen = float(oa.tokens_seen(state))
  assert seen == float(sum(helpers.num_tokens(b) for b in micro_batches[:4]))
