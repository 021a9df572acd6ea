"""The gradient noise scale: the estimator, then the two entry points.

The estimator (``_src/noise_scale.py``) is checked against a brute-force
computation from the micro-batch gradients, written another way (a weighted
sum of squared deviations), and for bias on problems whose gradient
covariance is known, over many seeds at once: synthetic per-token gradients
``G + noise`` and a linear regression. The naive estimator, which ignores
the micro-batches' token counts, must miss there.

The last section checks ``with_stats=True`` on ``oa.value_and_grad`` and
``oa.accumulate``: the brute force again, the two entry points against each
other, distributed against one device, the collectives left unchanged, and
the example ``examples/noise_scale/`` at a tiny size.
"""

import functools
import re

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import reduced_fallbacks
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting

SEQ, DIM = 4, 8


def _brute_force(grads, tokens):
  """``(trace_cov, grad_sq_norm, noise_scale)`` in float64, from scratch.

  ``grads[i]`` is micro-batch ``i``'s per-token mean gradient (a flat vector)
  and ``tokens[i]`` its token count; micro-batches without tokens are left
  out. The token-weighted spread of the micro-batch gradients about their
  mean estimates the per-token covariance's trace.
  """
  tokens = np.asarray(tokens, np.float64)
  keep = tokens > 0
  grads = np.asarray(grads, np.float64)[keep]
  tokens = tokens[keep]
  m, total = len(tokens), tokens.sum()
  mean = (tokens[:, None] * grads).sum(0) / total
  trace_cov = (tokens * ((grads - mean) ** 2).sum(1)).sum() / (m - 1)
  grad_sq_norm = (mean**2).sum() - trace_cov / total
  return trace_cov, grad_sq_norm, trace_cov / grad_sq_norm


def _estimate(grads, tokens, loss_reduction="mean", drop=None):
  """The library's statistics from per-token mean gradients ``grads[i]``.

  The micro-batches are added one by one as the entry points add them: each
  as its loss reduction hands it over, the dropped ones with ``drop``.
  """
  tokens = jnp.asarray(tokens, jnp.float32)
  drop = np.zeros(len(tokens), bool) if drop is None else drop
  sums = noise_scale.zero_sums()
  grad_sum, token_count = jnp.zeros_like(grads[0]), jnp.zeros([], jnp.float32)
  for g, n, d in zip(grads, tokens, drop):
    c = token_weighting.contribution(n, loss_reduction, drop=d)
    handed = g if loss_reduction == "mean" else n * g
    sums = noise_scale.add_sq_norms(sums, {"w": handed}, c, loss_reduction)
    grad_sum = token_weighting.add_weighted(grad_sum, handed, c)
    token_count = token_count + c.tokens
  mean = token_weighting.mean(grad_sum, token_count, grad_sum)
  return noise_scale.estimate_from_groups(
      [sums], [noise_scale.sq_norm({"w": mean})], token_count)


def _assert_stats_close(stats, expected, rtol=1e-4):
  trace_cov, grad_sq_norm, scale = expected
  np.testing.assert_allclose(stats.trace_cov, trace_cov, rtol=rtol)
  np.testing.assert_allclose(stats.grad_sq_norm, grad_sq_norm, rtol=rtol)
  np.testing.assert_allclose(stats.noise_scale, scale, rtol=rtol)


# The estimator against the brute force.


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_estimate_equals_the_brute_force_with_unequal_token_counts(
    loss_reduction):
  rng = np.random.default_rng(0)
  tokens = np.array([3.0, 17.0, 1.0, 40.0, 8.0])
  grads = 1.0 + rng.normal(size=(5, DIM)) / np.sqrt(tokens)[:, None]
  with jax.numpy_dtype_promotion("strict"):
    stats = _estimate(jnp.asarray(grads, jnp.float32), tokens, loss_reduction)
  _assert_stats_close(stats, _brute_force(grads, tokens))
  assert stats.num_microbatches == 5
  assert all(x.dtype == jnp.float32 and x.shape == () for x in stats)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_empty_and_dropped_micro_batches_do_not_count(loss_reduction):
  rng = np.random.default_rng(1)
  tokens = np.array([5.0, 0.0, 12.0, 7.0, 0.0, 30.0])
  grads = rng.normal(size=(6, DIM)) + 0.5
  # What an empty micro-batch's mean loss gives (0/0), and a dropped one's
  # gradient: neither may be looked at.
  grads[1], grads[4] = np.nan, np.inf
  drop = np.array([False, False, False, True, False, False])
  grads[3] = 1e6
  stats = _estimate(jnp.asarray(grads, jnp.float32), tokens, loss_reduction,
                    drop=drop)
  kept = np.array([0, 2, 5])
  _assert_stats_close(stats, _brute_force(grads[kept], tokens[kept]))
  assert stats.num_microbatches == 3


@pytest.mark.parametrize("tokens", [[4.0], [0.0, 9.0, 0.0], [0.0, 0.0], []])
def test_fewer_than_two_micro_batches_with_tokens_give_nan(tokens):
  grads = jnp.ones((max(len(tokens), 1), DIM), jnp.float32)
  stats = _estimate(grads, tokens)
  for name in ("noise_scale", "grad_sq_norm", "trace_cov"):
    assert np.isnan(getattr(stats, name)), (name, stats)
  assert stats.num_microbatches == sum(n > 0 for n in tokens)


def test_equal_token_counts_give_the_papers_two_batch_size_estimators():
  """McCandlish et al. (2018), appendix A.1, with B_small=n and B_big=m*n."""
  rng = np.random.default_rng(2)
  m, n = 4, 16.0
  grads = rng.normal(size=(m, DIM)) + 0.3
  small_sq = (grads**2).sum(1).mean()  # |G_small|^2, averaged over batches.
  big_sq = (grads.mean(0) ** 2).sum()  # |G_big|^2.
  b_small, b_big = n, m * n
  grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
  trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
  stats = _estimate(jnp.asarray(grads, jnp.float32), [n] * m)
  _assert_stats_close(stats, (trace, grad_sq, trace / grad_sq))


# The estimator is unbiased: mean estimates over many seeds.

SEEDS = 4096


def _naive_estimate(grads, tokens):
  """The paper's estimators with B_small = N / m, blind to unequal counts."""
  m, total = grads.shape[0], tokens.sum()
  small_sq = jnp.mean(jnp.sum(grads**2, -1))
  mean = jnp.sum(tokens[:, None] * grads, 0) / total
  big_sq = jnp.sum(mean**2)
  b_small, b_big = total / m, total
  trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
  return trace, big_sq - trace / b_big


def _synthetic_stats(z, tokens, true_grad, scale_tril):
  """Micro-batch means of per-token gradients ``true_grad + L z``.

  ``z[i, t]`` is token ``t`` of micro-batch ``i``'s standard normal draw;
  micro-batch ``i`` has the first ``tokens[i]`` tokens.
  """
  per_token = true_grad + z @ scale_tril.T
  mask = np.arange(z.shape[1])[None, :] < np.asarray(tokens)[:, None]
  tokens = jnp.asarray(tokens, jnp.float32)
  grads = (per_token * mask[..., None]).sum(1) / tokens[:, None]
  return _estimate(grads, tokens), _naive_estimate(grads, tokens)


def _relative_errors(estimates, truth):
  """The mean estimate's relative error, and its standard error's."""
  estimates = np.asarray(estimates, np.float64)
  error = abs(estimates.mean() - truth) / truth
  return error, estimates.std() / np.sqrt(len(estimates)) / truth


@pytest.mark.parametrize("tokens", [[16, 16, 16, 16], [1, 2, 5, 56]])
def test_mean_estimates_match_a_known_covariance(tokens):
  rng = np.random.default_rng(3)
  dim = 6
  true_grad = jnp.asarray(rng.normal(size=dim) * 0.4, jnp.float32)
  scale_tril = jnp.asarray(np.tril(rng.normal(size=(dim, dim))), jnp.float32)
  trace = float(jnp.sum(scale_tril**2))  # tr(L L^T).
  grad_sq = float(jnp.sum(true_grad**2))
  # numpy draws the noise: jax.random's would take seconds to compile.
  z = rng.normal(size=(SEEDS, len(tokens), max(tokens), dim))
  stats, naive = jax.jit(jax.vmap(
      functools.partial(_synthetic_stats, tokens=tokens, true_grad=true_grad,
                        scale_tril=scale_tril)))(z.astype(np.float32))

  for estimates, truth in ((stats.trace_cov, trace),
                           (stats.grad_sq_norm, grad_sq)):
    error, standard_error = _relative_errors(estimates, truth)
    assert standard_error < 0.04, standard_error  # enough seeds to tell.
    assert error < 0.2, (error, truth)
  # The noise scale is a ratio of estimates: only its median is near the
  # truth's, and only when |G|^2's estimate is precise.
  np.testing.assert_allclose(np.median(stats.noise_scale), trace / grad_sq,
                             rtol=0.2)
  # Negative control: the paper's estimators with the mean micro-batch size
  # are unbiased for equal counts only.
  naive_trace, naive_grad_sq = (np.asarray(x).mean() for x in naive)
  if len(set(tokens)) == 1:
    np.testing.assert_allclose(naive_trace, trace, rtol=0.2)
  else:
    assert abs(naive_trace - trace) > trace, (naive_trace, trace)
    assert abs(naive_grad_sq - grad_sq) > grad_sq, (naive_grad_sq, grad_sq)


def _regression(dim, noise, lengths, seed):
  """Per-token squared errors of a linear model, ``SEEDS`` batches of them.

  With ``x ~ N(0, I)`` and ``y = x . w* + noise * eps``, the per-token
  gradient of ``(x . w - y)^2 / 2`` at ``w = w* + d`` is ``x (x . d - noise *
  eps)``: its mean is ``G = d`` and its covariance ``(|d|^2 + noise^2) I + d
  d^T``, of trace ``(dim + 1) |d|^2 + dim noise^2``.

  Returns:
    ``(params, batches, loss, trace, grad_sq)``: ``batches`` has a leading
    axis of ``SEEDS``, each batch has rows of the given ``lengths``.
  """
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=dim)
  d = rng.normal(size=dim) * 0.5
  params = {"w": jnp.asarray(w_true + d, jnp.float32)}
  rows = len(lengths)
  x = rng.normal(size=(SEEDS, rows, SEQ, dim))
  y = x @ w_true + noise * rng.normal(size=(SEEDS, rows, SEQ))
  mask = np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]
  batches = {"x": x, "y": y, "mask": np.broadcast_to(mask, y.shape)}
  batches = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), batches)

  def loss(params, batch):
    token_losses = batch["mask"] * 0.5 * (batch["x"] @ params["w"]
                                          - batch["y"]) ** 2
    return helpers.safe_mean(token_losses, batch)

  sq = float(np.sum(d**2))
  return params, batches, loss, (dim + 1) * sq + dim * noise**2, sq


# The rows' lengths: 5 micro-batches of 2 rows, with unequal token counts
# (2, 5, 3, 8) and none.
REGRESSION_LENGTHS = np.array([1, 1, 4, 1, 0, 3, 4, 4, 0, 0])
REGRESSION_K = 5


def test_mean_estimates_match_a_linear_regression_known_covariance():
  params, batches, loss, trace, grad_sq = _regression(
      dim=4, noise=0.5, lengths=REGRESSION_LENGTHS, seed=4)

  def stats(batch):
    microbatches = helpers.split(batch, REGRESSION_K)
    grads = jnp.stack([jax.grad(loss)(params, mb)["w"] for mb in microbatches])
    tokens = jnp.stack([helpers.num_tokens(mb) for mb in microbatches])
    return _estimate(grads, tokens)

  result = jax.jit(jax.vmap(stats))(batches)
  assert np.all(result.num_microbatches == 4)
  for estimates, truth in ((result.trace_cov, trace),
                           (result.grad_sq_norm, grad_sq)):
    error, standard_error = _relative_errors(estimates, truth)
    assert standard_error < 0.04, standard_error
    assert error < 0.2, (error, truth)


# ---------------------------------------------------------------------------
# The entry points: with_stats=True on oa.value_and_grad and oa.accumulate.
# ---------------------------------------------------------------------------

N = 8  # simulated devices (tests/conftest.py).
K = 2  # micro-batches per device.
BATCH = 32


def _data(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, SEQ + 1, size=BATCH)
  lengths[:4] = 0  # the first micro-batch has no tokens, split in 8 or 16.
  return jax.tree.map(jnp.asarray, helpers.padded_batch(rng, lengths, SEQ, DIM))


def _params():
  return helpers.mlp_params(DIM, 16, seed=0)


def mean_loss(params, batch):
  return helpers.safe_mean(helpers.mlp_token_losses(params, batch), batch)


def sum_loss(params, batch):
  return helpers.mlp_token_losses(params, batch).sum()


def _expected(batch, num_microbatches):
  """The brute force over ``batch``'s contiguous micro-batches."""
  microbatches = helpers.split(batch, num_microbatches)
  tokens = [helpers.num_tokens(mb) for mb in microbatches]
  grads = [ravel_pytree(jax.grad(mean_loss)(_params(), mb))[0]
           for mb in microbatches]
  return _brute_force(np.stack(grads), tokens)


def _value_and_grad(num_microbatches, loss=mean_loss, **kwargs):
  return oa.value_and_grad(
      loss, num_microbatches=num_microbatches,
      num_tokens_fn=helpers.num_tokens, with_stats=True,
      loss_reduction="mean" if loss is mean_loss else "sum", **kwargs)


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


@pytest.mark.parametrize("loss", [
    mean_loss, pytest.param(sum_loss, marks=pytest.mark.slow)])
def test_value_and_grad_with_stats_equals_the_brute_force(loss):
  k = 8  # micro-batches of 4 rows; the first has no tokens.
  batch = _data()
  value, grads, stats = jax.jit(_value_and_grad(k, loss))(_params(), batch)
  _assert_stats_close(stats, _expected(batch, k))
  assert stats.num_microbatches == k - 1
  # The value and gradient are those of the call without statistics.
  plain = oa.value_and_grad(
      loss, num_microbatches=k, num_tokens_fn=helpers.num_tokens,
      loss_reduction="mean" if loss is mean_loss else "sum")
  expected_value, expected_grads = jax.jit(plain)(_params(), batch)
  # To float32 rounding: XLA may fuse the two programs differently (jax 0.9.1
  # differs from the call without statistics by 1 ulp in one element).
  helpers.assert_trees_close((value, grads), (expected_value, expected_grads),
                             rtol=1e-5, atol=1e-6)


def _accumulate_stats(tx, params, microbatches, end_with_emit=False):
  """The state after one micro-step per micro-batch, jitted once."""

  @jax.jit
  def step(state, microbatch, emit):
    grads = jax.grad(mean_loss)(params, microbatch)
    _, state = tx.update(grads, state, params,
                         num_tokens=helpers.num_tokens(microbatch),
                         emit=emit if end_with_emit else None)
    return state

  state = tx.init(params)
  assert np.isnan(oa.grad_stats(state).noise_scale)  # before any emit.
  for i, mb in enumerate(microbatches):
    state = step(state, mb, jnp.asarray(i == len(microbatches) - 1))
  assert oa.has_updated(state)
  return state


@pytest.mark.slow
def test_accumulate_and_value_and_grad_give_the_same_stats():
  k = 8
  batch, params = _data(), _params()
  _, _, expected = jax.jit(_value_and_grad(k))(params, batch)
  microbatches = helpers.split(batch, k)
  tx = oa.accumulate(optax.sgd(0.1), every_k=k, with_stats=True)
  state = _accumulate_stats(tx, params, microbatches)
  helpers.assert_trees_close(oa.grad_stats(state), expected, rtol=1e-4)
  # Inside a larger optimizer state too (an optax.chain's is a tuple).
  helpers.assert_trees_close(
      oa.grad_stats((optax.EmptyState(), {"accumulate": state})), expected,
      rtol=1e-4)


@pytest.mark.slow
def test_accumulate_cycle_ended_with_emit_has_the_stats_of_its_micro_batches():
  batch, params = _data(), _params()
  microbatches = helpers.split(batch, 8)[:5]
  tx = oa.accumulate(optax.sgd(0.1), every_k=100, with_stats=True)
  state = _accumulate_stats(tx, params, microbatches, end_with_emit=True)
  five = jax.tree.map(lambda x: x[: 5 * BATCH // 8], batch)
  _, _, expected = jax.jit(_value_and_grad(5))(params, five)
  helpers.assert_trees_close(oa.grad_stats(state), expected, rtol=1e-4)
  assert oa.grad_stats(state).num_microbatches == 4  # the first is empty.


@pytest.mark.slow
def test_value_and_grad_in_shard_map_equals_one_device():
  batch, params = _data(), _params()
  _, _, expected = jax.jit(_value_and_grad(K * N))(params, batch)
  # Each device's own micro-batches are the small batches.
  sharded = jax.jit(jax.shard_map(
      _value_and_grad(K, axis_name="data"), mesh=_mesh(),
      in_specs=(P(), P("data")), out_specs=P()))
  _, _, stats = sharded(params, batch)
  helpers.assert_trees_close(stats, expected, rtol=1e-4)
  with jax.set_mesh(_mesh(AxisType.Auto)):  # the same: each device's slice.
    _, _, stats = jax.jit(_value_and_grad(K, axis_name="data"))(
        jax.device_put(params, P()), jax.device_put(batch, P("data")))
  helpers.assert_trees_close(stats, expected, rtol=1e-4)


@pytest.mark.slow
def test_value_and_grad_with_explicit_axes_equals_one_device():
  """Explicit axes, every leaf typed reduced: the small batches are each
  device's rows of each micro-batch (SPEC 6), K * N of them, as in
  shard_map; none of them is reduced over devices to take its norm."""
  batch, params = _data(), _params()
  _, _, expected = jax.jit(_value_and_grad(K * N))(params, batch)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    args = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    fn = jax.jit(_value_and_grad(K))
    _, _, stats = fn(*args)
    compiled = fn.lower(*args).compile()
    plain = jax.jit(oa.value_and_grad(
        mean_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens)
    ).lower(*args).compile()
  helpers.assert_trees_close(stats, expected, rtol=1e-4)
  rows = helpers.split(batch, K * N)  # device d's i-th block: d * K + i.
  assert stats.num_microbatches == sum(helpers.num_tokens(r) > 0 for r in rows)
  # No gradient-sized collective in the loop, and the same reduction after
  # it as without statistics: only scalars are added.
  with_stats = helpers.reduction_bytes(compiled, mesh, ("data",))
  assert with_stats == helpers.reduction_bytes(plain, mesh, ("data",))
  assert with_stats["loop"] == 0
  assert helpers.loop_collectives_by_axes(
      compiled, (N,), ("data",), include_scalars=False) == {}


def _fallback_loss(params, batch):
  """mean_loss with ``x @ w1 + b1`` written plainly: JAX cannot type ``b1``
  reduced, so it falls back (reduced by JAX in every micro-batch)."""
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  losses = batch["mask"] * (hidden @ params["w2"] - batch["y"]) ** 2
  return helpers.safe_mean(losses, batch)


def _fallback_sum_loss(params, batch):
  return _fallback_loss(params, batch) * helpers.num_tokens(batch)


@pytest.mark.parametrize("loss_reduction,model", [
    ("mean", False), pytest.param("sum", False, marks=pytest.mark.slow),
    pytest.param("mean", True, marks=pytest.mark.slow)])
def test_explicit_axes_fallback_leaves_take_the_micro_batches(
    loss_reduction, model):
  """SPEC 6: a reduced leaf's small batches are each device's rows of each
  micro-batch; a fallback leaf's (``b1``) the micro-batches themselves;
  trace and squared norm add over the two groups. With a model axis, ``w1``
  is sharded over it and ``w2`` replicated: each device's rows count once."""
  batch, params = _data(), _params()
  devices = N // 2 if model else N  # along the data axis.

  def brute_force(microbatches, names):
    grads, tokens = [], []
    for mb in microbatches:
      g = jax.grad(_fallback_loss)(params, mb)
      grads.append(ravel_pytree({n: g[n] for n in names})[0])
      tokens.append(helpers.num_tokens(mb))
    return _brute_force(np.stack(grads), tokens)

  rows = helpers.split(batch, K * devices)  # device d's i-th: d * K + i.
  blocked = jax.tree.map(
      lambda x: x.reshape((devices, K, -1) + x.shape[1:]).swapaxes(
          0, 1).reshape(x.shape), batch)
  reduced = brute_force(rows, ("w1", "w2"))
  fallback = brute_force(helpers.split(blocked, K), ("b1",))
  trace = reduced[0] + fallback[0]
  grad_sq = reduced[1] + fallback[1]
  loss = _fallback_loss if loss_reduction == "mean" else _fallback_sum_loss
  fn = oa.value_and_grad(loss, num_microbatches=K, with_stats=True,
                         num_tokens_fn=helpers.num_tokens,
                         loss_reduction=loss_reduction)
  if model:
    mesh = jax.make_mesh((devices, 2), ("data", "model"),
                         axis_types=(AxisType.Explicit,) * 2)
    specs = {"w1": P(None, "model"), "b1": P(), "w2": P()}
  else:
    mesh, specs = _mesh(AxisType.Explicit), {"w1": P(), "b1": P(), "w2": P()}
  with jax.set_mesh(mesh):
    with reduced_fallbacks.collecting() as reports:
      _, _, stats = jax.jit(fn)(jax.device_put(params, specs),
                                jax.device_put(batch, P("data")))
  assert reports[-1].fallback_leaves == ("params['b1']",)
  _assert_stats_close(stats, (trace, grad_sq, trace / grad_sq))
  assert stats.num_microbatches == sum(helpers.num_tokens(r) > 0 for r in rows)


@pytest.mark.slow
def test_accumulate_in_shard_map_equals_one_device():
  batch, params = _data(), _params()
  _, _, expected = jax.jit(_value_and_grad(K * N))(params, batch)
  tx = oa.accumulate(optax.sgd(0.1), every_k=K, axis_name="data",
                     with_stats=True)

  def step(params, state, batch):
    grads = jax.grad(mean_loss)(oa.device_local(params, "data"), batch)
    _, state = tx.update(grads, state, params,
                         num_tokens=helpers.num_tokens(batch))
    return state

  with jax.set_mesh(_mesh()):
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    sharded = jax.jit(jax.shard_map(
        step, in_specs=(P(), specs, P("data")), out_specs=specs))
    # Micro-step i: every device's i-th slice of its rows.
    for i in range(K):
      microbatch = jax.tree.map(
          lambda x, i=i: x.reshape((N, K, -1) + x.shape[1:])[:, i].reshape(
              (-1,) + x.shape[1:]), batch)
      state = sharded(params, state, microbatch)
    counts = oa.count_collectives(
        sharded.lower(params, state, microbatch).compile())
  stats = oa.grad_stats(state)
  for actual, want in zip(stats, expected):
    np.testing.assert_allclose(actual, want, rtol=1e-4)  # on every device.
  assert counts.total == counts.in_branch == {"all-reduce": 1}


def _all_reduce_operands(compiled):
  """The shapes of every all-reduce's operands in a compiled program."""
  shapes = []
  for line in compiled.as_text().splitlines():
    match = re.search(r"= (\(.*?\)|\S+) all-reduce\(", line)
    if match:
      shapes += [tuple(int(d) for d in dims.split(",") if d) for dims in
                 re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", match.group(1))]
  return shapes


@pytest.mark.parametrize("under", ["shard_map", "jit"])
def test_with_stats_adds_only_scalars_to_the_one_reduction(under):
  params, batch = _params(), _data()
  counts, operands = {}, {}
  for with_stats in (False, True):
    fn = oa.value_and_grad(
        mean_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
        axis_name="data", with_stats=with_stats)
    if under == "shard_map":
      compiled = jax.jit(jax.shard_map(
          fn, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P()
      )).lower(params, batch).compile()
    else:  # Auto axes (with Explicit ones, each micro-batch's gradient is
      # reduced for its norm: docs/noise_scale.md).
      with jax.set_mesh(_mesh(AxisType.Auto)):
        compiled = jax.jit(fn).lower(
            jax.device_put(params, P()),
            jax.device_put(batch, P("data"))).compile()
    counts[with_stats] = oa.count_collectives(compiled)
    operands[with_stats] = _all_reduce_operands(compiled)
  assert counts[True] == counts[False]
  assert counts[True].total == {"all-reduce": 1}
  assert counts[True].in_loop == {}
  # XLA combines all-reduces, so the count alone would not see a second
  # reduction of the statistics: what the one reduction carries must differ
  # by a few scalars only.
  added = list(operands[True])
  for shape in operands[False]:
    added.remove(shape)
  assert added and len(added) <= 3 and all(s == () for s in added), added


def test_value_and_grad_stats_are_unbiased_for_a_linear_regression():
  params, batches, loss, trace, grad_sq = _regression(
      dim=4, noise=0.5, lengths=REGRESSION_LENGTHS, seed=4)
  fn = oa.value_and_grad(loss, num_microbatches=REGRESSION_K,
                         num_tokens_fn=helpers.num_tokens, with_stats=True)
  _, _, stats = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(params, batches)
  for estimates, truth in ((stats.trace_cov, trace),
                           (stats.grad_sq_norm, grad_sq)):
    error, standard_error = _relative_errors(estimates, truth)
    assert standard_error < 0.04, standard_error
    assert error < 0.2, (error, truth)


@pytest.mark.slow
def test_docs_snippets_run():
  helpers.run_markdown_snippets("docs/noise_scale.md", min_blocks=2)


@pytest.mark.slow
def test_noise_scale_example_adapts_the_batch_size(tmp_path):
  example = helpers.import_example("noise_scale/main")
  plot_path = tmp_path / "noise_scale.png"
  results = example.main([
      "--steps", "6", "--k", "4", "--microbatch-size", "2", "--seq-len", "24",
      "--dim", "16", "--layers", "1", "--heads", "2", "--target-loss", "10",
      "--out", str(plot_path), "--quiet"])
  fixed, adaptive = results["fixed"], results["adaptive"]
  assert fixed["updates"] == 6
  np.testing.assert_array_equal(fixed["cycle_microbatches"], 4)
  for run in (fixed, adaptive):
    assert np.isfinite(run["noise_scale"]).all()
    assert np.isfinite(run["held_out_loss"])
  # The adaptive run's first cycle is the fixed run's; every later one ends
  # once its tokens reach the smoothed noise scale of the update before.
  assert adaptive["cycle_microbatches"][0] == 4
  targets = adaptive["smoothed_noise_scale"][:-1]
  assert np.all(adaptive["cycle_tokens"][1:] >= targets), adaptive
  assert np.all(adaptive["cycle_microbatches"][1:] >= 2)
  assert adaptive["updates"] > fixed["updates"]  # smaller batches, early on.
  assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_noise_scale_example_gives_every_flag_a_help_text(monkeypatch):
  helpers.assert_flags_have_help_and_defaults("noise_scale/main", monkeypatch)
