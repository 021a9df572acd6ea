"""oa.value_and_grad in real train steps: rng, kwargs, batch_axes, aux, dtypes.

Every feature is checked against a hand-computed or full-batch reference,
next to a negative control that shows what the naive way gets wrong: one key
for every micro-batch draws one mask; the plain mean of per-micro-batch means
is not the full batch's metric; a contiguous split of a sharded batch
gathers it.
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
from optax_accum._src.microbatch import rng as rng_lib

N = 8  # simulated devices (tests/conftest.py).
K = 2  # micro-batches (per device, with axis_name).
BATCH, SEQ, DIM = 32, 4, 8


def _data(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, SEQ + 1, size=BATCH)
  lengths[:4] = [0, 4, 1, 0]
  return jax.tree.map(
      jnp.asarray, helpers.padded_batch(rng, lengths, SEQ, DIM))


def _params():
  return helpers.linear_params(DIM)


num_tokens = helpers.num_tokens


def mean_loss(params, batch):
  return helpers.safe_mean(helpers.linear_token_losses(params, batch), batch)


def dropout_loss(params, batch, *, rng):
  """Dropout on the inputs, then the linear model's per-token mean."""
  keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
  dropped = dict(batch, x=jnp.where(keep, 2.0 * batch["x"], 0.0))
  return mean_loss(params, dropped)


def _key(seed):
  # rbg keys compile several times faster than threefry's on CPU.
  return jax.random.key(seed, impl="rbg")


def _mesh(axis_type=AxisType.Explicit):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def _assert_full_batch(loss, grads, batch=None, loss_fn=mean_loss):
  batch = _data() if batch is None else batch
  expected_loss, expected_grads = jax.value_and_grad(loss_fn)(_params(), batch)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


_dropout_grad = jax.jit(jax.grad(dropout_loss))


def _hand_dropout_grads(microbatches_and_keys):
  """The token-weighted gradient, micro-batch by micro-batch, by hand."""
  total, grads = 0.0, jax.tree.map(jnp.zeros_like, _params())
  for mb, key in microbatches_and_keys:
    n = float(num_tokens(mb))
    g = _dropout_grad(_params(), mb, rng=key)
    grads = jax.tree.map(lambda s, g, n=n: s + n * g, grads, g)
    total += n
  return jax.tree.map(lambda s: s / total, grads)


# rng=


@pytest.mark.slow
def test_each_micro_batch_gets_its_own_key_and_the_gradient_uses_it():
  def loss_fn(params, batch, *, rng):
    return dropout_loss(params, batch, rng=rng), jax.random.key_data(rng)

  fn = jax.jit(oa.value_and_grad(loss_fn, num_microbatches=4, has_aux=True,
                                 num_tokens_fn=num_tokens))
  rng = _key(7)
  (_, keys), grads = fn(_params(), _data(), rng=rng)
  expected_keys = [jax.random.key_data(rng_lib.key_for(rng, i))
                   for i in range(4)]
  np.testing.assert_array_equal(keys, np.stack(expected_keys))
  np.testing.assert_array_equal(  # the documented derivation
      keys[1], jax.random.key_data(jax.random.fold_in(rng, 1)))
  assert len({tuple(k) for k in np.asarray(keys)}) == 4
  expected = _hand_dropout_grads(zip(
      helpers.split(_data(), 4), map(rng_lib.key_for,
                                     [rng] * 4, range(4))))
  helpers.assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)

  # Negative control: one key for every micro-batch, through *args.
  def one_key(params, batch, key):
    return dropout_loss(params, batch, rng=key)

  same = jax.jit(oa.value_and_grad(one_key, num_microbatches=4,
                           num_tokens_fn=num_tokens))
  _, same_grads = same(_params(), _data(), rng)
  assert not helpers.trees_close(same_grads, expected, rtol=1e-3)


def test_rng_is_reproducible_and_differs_across_calls_and_without_it():
  fn = jax.jit(oa.value_and_grad(dropout_loss, num_microbatches=4,
                                 num_tokens_fn=num_tokens))
  first = fn(_params(), _data(), rng=_key(0))
  helpers.assert_trees_equal(first, fn(_params(), _data(),
                                       rng=_key(0)))
  assert not helpers.trees_close(
      first, fn(_params(), _data(), rng=_key(1)), rtol=1e-3)
  raw = jax.random.PRNGKey(0)  # raw uint32 keys are keys too.
  assert rng_lib.check_rng(raw) is raw

  def no_rng(params, batch, **kwargs):
    assert "rng" not in kwargs  # without rng, loss_fn never sees it.
    return mean_loss(params, batch)

  oa.value_and_grad(no_rng, num_microbatches=2, equal_weights=True)(
      _params(), _data())
  with pytest.raises(TypeError, match=r"rng must be one PRNG key.*float32"):
    fn(_params(), _data(), rng=jnp.zeros(2))


@pytest.mark.slow
def test_keys_differ_across_devices_under_axis_name_in_shard_map_and_jit():
  def loss_fn(params, batch, *, rng):
    return dropout_loss(params, batch, rng=rng), jax.random.key_data(rng)

  fn = oa.value_and_grad(loss_fn, num_microbatches=K, has_aux=True,
                         num_tokens_fn=num_tokens, axis_name="data")
  rng = _key(3)
  mapped = jax.jit(jax.shard_map(
      lambda p, b, key: fn(p, b, rng=key), mesh=_mesh(AxisType.Auto),
      in_specs=(P(), P("data"), P()),
      out_specs=((P(), P("data")), P())))
  (_, keys), grads = mapped(_params(), _data(), rng)
  keys = np.asarray(keys).reshape(N, K, -1)  # device d's K micro-batches.

  def expected_key(d, i):
    return jax.random.key_data(jax.random.fold_in(
        jax.random.fold_in(rng, d), i))

  for d in range(N):
    for i in range(K):
      np.testing.assert_array_equal(keys[d, i], expected_key(d, i))
  assert len({tuple(k) for k in keys.reshape(N * K, -1)}) == N * K
  rows = BATCH // (N * K)
  expected = _hand_dropout_grads([
      (jax.tree.map(lambda x, j=d * K + i: x[j * rows:(j + 1) * rows],
                    _data()), rng_lib.key_for(
                        jax.random.fold_in(rng, d), i))
      for d in range(N) for i in range(K)])
  helpers.assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)

  # Under jit over an Auto mesh axis: the same keys and gradient.
  with jax.set_mesh(_mesh(AxisType.Auto)):
    (_, mesh_keys), mesh_grads = jax.jit(fn)(
        jax.device_put(_params(), P()), jax.device_put(_data(), P("data")),
        rng=rng)
  np.testing.assert_array_equal(  # (K, N * key size), device by device.
      np.asarray(mesh_keys).reshape(K, N, -1).swapaxes(0, 1), keys)
  helpers.assert_trees_close(mesh_grads, expected, rtol=1e-5, atol=1e-6)


# **kwargs and batch_axes.


def _odd_batch():
  """x with its batch axis second, a scalar and a per-batch table."""
  data = _data()
  return {"x_t": data["x"].swapaxes(0, 1), "y": data["y"],
          "mask": data["mask"], "scale": jnp.float32(2.0),
          "table": jnp.linspace(0.0, 1.0, DIM)}


_ODD_AXES = {"x_t": 1, "y": 0, "mask": 0, "scale": None, "table": None}


def odd_loss(params, batch, offset, *, power):
  x = batch["x_t"].swapaxes(0, 1) + batch["table"]
  losses = helpers.linear_token_losses(params, dict(batch, x=x))
  return batch["scale"] * helpers.safe_mean(losses ** power, batch) + offset


@pytest.mark.slow
def test_batch_axes_and_kwargs_give_the_full_batch():
  fn = jax.jit(oa.value_and_grad(
      odd_loss, num_microbatches=4, batch_axes=_ODD_AXES,
      num_tokens_fn=num_tokens))
  loss, grads = fn(_params(), _odd_batch(), jnp.float32(1.0), power=2.0)
  _assert_full_batch(loss, grads, _odd_batch(),
                     lambda p, b: odd_loss(p, b, 1.0, power=2.0))
  # A per-batch leaf split like the others would be wrong (or refused).
  with pytest.raises(ValueError, match=r"batch\['scale'\] is a scalar"):
    oa.value_and_grad(odd_loss, num_microbatches=4, batch_axes=dict(
        _ODD_AXES, scale=0))(_params(), _odd_batch(), 1.0, power=2.0)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_batch_axes_and_kwargs_under_jit_over_a_mesh_axis(axis_type):
  fn = jax.jit(oa.value_and_grad(
      odd_loss, num_microbatches=K, batch_axes=_ODD_AXES,
      num_tokens_fn=num_tokens, axis_name="data"))
  batch = _odd_batch()
  with jax.set_mesh(_mesh(axis_type)):
    specs = {"x_t": P(None, "data"), "y": P("data"), "mask": P("data"),
             "scale": P(), "table": P()}
    sharded = {k: jax.device_put(v, specs[k]) for k, v in batch.items()}
    loss, grads = fn(jax.device_put(_params(), P()), sharded,
                     jnp.float32(1.0), power=2.0)
    counts = oa.count_collectives(fn.lower(
        _params(), sharded, jnp.float32(1.0), power=2.0).compile(),
                                  include_scalars=False)
  _assert_full_batch(loss, grads, batch,
                     lambda p, b: odd_loss(p, b, 1.0, power=2.0))
  assert counts.in_loop == {}
  assert counts.total == {"all-reduce": 1}  # the table is not gathered.


def test_batch_axes_errors_name_the_leaf_and_what_was_expected():
  batch = _odd_batch()
  with pytest.raises(TypeError, match=r"batch_axes must be an int.*'0'"):
    oa.value_and_grad(odd_loss, num_microbatches=2, batch_axes="0")
  cases = [
      (dict(_ODD_AXES, x_t=3), r"batch\['x_t'\] axis 3, out of range"),
      (dict(_ODD_AXES, x_t=0), r"share the size.*x_t.*: 4"),
      ({"x_t": 1}, r"batch_axes must be a single value or a pytree prefix"),
      (None, r"splits no leaf"),
  ]
  for batch_axes, message in cases:
    fn = oa.value_and_grad(lambda p, b: 0.0, num_microbatches=2,
                           batch_axes=batch_axes)
    with pytest.raises(ValueError, match=message):
      fn(_params(), batch)


def test_param_specs_that_do_not_fit_params_are_named_without_a_mesh():
  """On one device param_specs does nothing, but a tree that cannot be a
  prefix of the parameters' is named there too, not first on the mesh."""
  fn = oa.value_and_grad(odd_loss, num_microbatches=2,
                         param_specs={"nope": P("data")},
                         batch_axes=_ODD_AXES, equal_weights=True)
  with pytest.raises(ValueError, match=r"param_specs must be a"
                     r" PartitionSpec or a tree prefix of the parameters'"):
    fn(_params(), _odd_batch(), jnp.float32(1.0), power=2.0)
  fits = oa.value_and_grad(odd_loss, num_microbatches=2, param_specs=P(),
                           batch_axes=_ODD_AXES, equal_weights=True)
  fits(_params(), _odd_batch(), jnp.float32(1.0), power=2.0)


# aux_reduction.


def _metrics_loss(params, batch):
  """The loss, and per-token metrics of this micro-batch."""
  losses = helpers.linear_token_losses(params, batch)
  n = num_tokens(batch)
  close = batch["mask"] * (losses < 0.5)
  return helpers.safe_mean(losses, batch), {
      "accuracy": close.sum() / n,  # 0/0 = NaN without tokens, on purpose.
      "correct": close.sum().astype(jnp.int32),
      "worst": jnp.max(losses),
      "best": jnp.min(jnp.where(batch["mask"] > 0, losses, jnp.inf)),
      "per_example": close.sum(-1),
  }


_REDUCTIONS = {"accuracy": "mean", "correct": "sum", "worst": "max",
               "best": "min", "per_example": "stack"}


def _full_metrics(batch):
  _, metrics = _metrics_loss(_params(), batch)
  return metrics


def _assert_metrics(metrics, batch):
  """The reduced metrics are the full batch's."""
  full = _full_metrics(batch)
  np.testing.assert_allclose(metrics["accuracy"], full["accuracy"], rtol=1e-5)
  assert metrics["correct"].dtype == jnp.int32
  assert int(metrics["correct"]) == int(full["correct"])
  np.testing.assert_allclose(metrics["worst"], full["worst"], rtol=1e-6)
  np.testing.assert_allclose(metrics["best"], full["best"], rtol=1e-6)


@pytest.mark.slow
def test_aux_reduction_gives_the_full_batch_metrics():
  batch = _data()
  batch["mask"] = batch["mask"].at[8:16].set(0.0)  # a micro-batch: 0 tokens.
  fn = jax.jit(oa.value_and_grad(
      _metrics_loss, num_microbatches=4, has_aux=True,
      num_tokens_fn=num_tokens, aux_reduction=_REDUCTIONS))
  (loss, metrics), grads = fn(_params(), batch)
  _assert_full_batch(loss, grads, batch)
  _assert_metrics(metrics, batch)
  np.testing.assert_array_equal(
      metrics["per_example"],
      np.asarray(_full_metrics(batch)["per_example"]).reshape(4, -1))
  assert np.isfinite(metrics["accuracy"])  # the empty micro-batch's NaN.

  # Negative control: the plain mean of the stacked per-micro-batch means.
  stacked = oa.value_and_grad(_metrics_loss, num_microbatches=4,
                              has_aux=True, num_tokens_fn=num_tokens)
  (_, per_mb), _ = stacked(_params(), _data())
  mean_of_means = float(np.mean(per_mb["accuracy"]))
  assert abs(mean_of_means - float(_full_metrics(_data())["accuracy"])) > 1e-2


def test_aux_mean_without_tokens_is_zero_and_string_applies_to_every_leaf():
  batch = _data()
  batch["mask"] = jnp.zeros_like(batch["mask"])
  fn = oa.value_and_grad(
      lambda p, b: (mean_loss(p, b), {"a": num_tokens(b) / num_tokens(b)}),
      num_microbatches=2, has_aux=True, num_tokens_fn=num_tokens,
      aux_reduction="mean")
  (_, aux), _ = fn(_params(), batch)
  assert float(aux["a"]) == 0.0


@pytest.mark.parametrize("reduction,combine", [
    ("sum", np.sum), ("max", np.max), ("min", np.min)])
@pytest.mark.slow
def test_a_micro_batch_without_tokens_adds_nothing_to_any_reduction(
    reduction, combine):
  """Its aux may be a 0/0 mean (the stacked NaN below): summed, or taken
  into a max or min, it made the whole metric NaN."""
  batch = _data()
  batch["mask"] = batch["mask"].at[8:16].set(0.0)  # a micro-batch: 0 tokens.
  fn = lambda red: oa.value_and_grad(
      _metrics_loss, num_microbatches=4, has_aux=True,
      num_tokens_fn=num_tokens, aux_reduction=red)
  (_, stacked), _ = fn("stack")(_params(), batch)
  per_mb = np.asarray(stacked["accuracy"])
  assert np.isnan(per_mb[1]) and not np.isnan(np.delete(per_mb, 1)).any()
  (_, reduced), _ = jax.jit(fn(reduction))(_params(), batch)
  np.testing.assert_allclose(reduced["accuracy"],
                             combine(np.delete(per_mb, 1)), rtol=1e-6)


def test_with_no_tokens_at_all_each_reduction_runs_over_nothing():
  batch = _data()
  batch["mask"] = jnp.zeros_like(batch["mask"])
  aux = {"sum": "sum", "max": "max", "min": "min", "imax": "max"}
  fn = oa.value_and_grad(
      lambda p, b: (mean_loss(p, b), {"sum": jnp.float32(1),
                                      "max": jnp.float32(1),
                                      "min": jnp.float32(1),
                                      "imax": jnp.int32(1)}),
      num_microbatches=2, has_aux=True, num_tokens_fn=num_tokens,
      aux_reduction=aux)
  (_, got), _ = jax.jit(fn)(_params(), batch)
  assert float(got["sum"]) == 0.0
  assert float(got["max"]) == -np.inf and float(got["min"]) == np.inf
  assert int(got["imax"]) == np.iinfo(np.int32).min


def test_aux_is_reduced_in_the_carry_not_stacked():
  def loss_fn(params, batch):
    return mean_loss(params, batch), jnp.ones(4096) * batch["y"].sum()

  for reduction, stacked_outputs in (("sum", 0), ("stack", 1)):
    fn = oa.value_and_grad(loss_fn, num_microbatches=8, has_aux=True,
                           aux_reduction=reduction, equal_weights=True)
    jaxpr = jax.make_jaxpr(fn)(_params(), _data())
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    shapes = [v.aval.shape for v in scan.outvars]
    assert shapes.count((8, 4096)) == stacked_outputs, shapes


@pytest.mark.parametrize("where", ["shard_map", "jit"])
def test_aux_reduction_over_devices_once_after_the_loop(where):
  fn = oa.value_and_grad(
      _metrics_loss, num_microbatches=K, has_aux=True,
      num_tokens_fn=num_tokens, aux_reduction=_REDUCTIONS, axis_name="data")
  params, batch = _params(), _data()
  if where == "shard_map":
    reduced = jax.tree.map(lambda _: P(), _REDUCTIONS)
    fn = jax.jit(jax.shard_map(
        fn, mesh=_mesh(AxisType.Auto), in_specs=(P(), P("data")),
        out_specs=((P(), dict(reduced, per_example=P("data"))), P())))
    (loss, metrics), grads = fn(params, batch)
    counts = oa.count_collectives(fn.lower(params, batch).compile())
  else:  # Auto axes: each device's slice, as in shard_map.
    fn = jax.jit(fn)
    with jax.set_mesh(_mesh(AxisType.Auto)):
      batch = jax.device_put(batch, P("data"))
      (loss, metrics), grads = fn(params, batch)
      counts = oa.count_collectives(fn.lower(params, batch).compile())
  _assert_full_batch(loss, grads)
  _assert_metrics(metrics, _data())
  # Stacked: device d's micro-batch i, as the two modes lay them out.
  per_example = np.asarray(metrics["per_example"])
  if where == "shard_map":  # (N * K, rows): device by device.
    per_example = per_example.reshape(N, K, -1)
  else:  # (K, N * rows): micro-batch by micro-batch.
    per_example = per_example.reshape(K, N, -1).swapaxes(0, 1)
  full = np.asarray(_full_metrics(_data())["per_example"])
  np.testing.assert_array_equal(per_example, full.reshape(N, K, -1))
  assert counts.in_loop == {}
  # After the loop: the float sums ride with the gradient's all-reduce; the
  # int32 sum ("correct") takes one of its own, and max and min one each.
  assert counts.total == {"all-reduce": 4}, counts


def test_aux_reduction_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"aux_reduction must be one of.*'avg'"):
    oa.value_and_grad(_metrics_loss, num_microbatches=2, has_aux=True,
                      aux_reduction={"accuracy": "avg"})
  with pytest.raises(ValueError, match=r"has_aux=False"):
    oa.value_and_grad(mean_loss, num_microbatches=2, aux_reduction="mean")
  fn = oa.value_and_grad(_metrics_loss, num_microbatches=2, has_aux=True,
                         aux_reduction={"accuracy": "mean"})
  with pytest.raises(ValueError, match=r"pytree prefix of aux"):
    fn(_params(), _data())


# The loss's dtype.


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_loss_comes_back_in_loss_fns_dtype_summed_in_float32(dtype):
  def low_loss(params, batch):
    return mean_loss(params, batch).astype(dtype)

  with jax.numpy_dtype_promotion("strict"):
    loss, grads = jax.jit(oa.value_and_grad(
        low_loss, num_microbatches=8, num_tokens_fn=num_tokens))(
            _params(), _data())
  assert loss.dtype == dtype
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  # Each micro-batch's low-precision loss, summed in float32, cast once.
  losses = [low_loss(_params(), mb).astype(jnp.float32)
            for mb in helpers.split(_data(), 8)]
  tokens = [num_tokens(mb) for mb in helpers.split(_data(), 8)]
  expected = sum(n * x for n, x in zip(tokens, losses)) / sum(tokens)
  assert loss == expected.astype(dtype)
  np.testing.assert_allclose(loss.astype(jnp.float32),
                             mean_loss(_params(), _data()), rtol=1e-2)
  _, expected_grads = jax.value_and_grad(mean_loss)(_params(), _data())
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-2, atol=1e-3)


# A sharded batch without axis_name.


def _contiguous_scan(params, batch):
  """The contiguous split of a sharded batch: XLA must gather it."""
  split = jax.tree.map(lambda x: x.reshape((K, -1) + x.shape[1:]), batch)

  def step(total, mb):
    return jax.tree.map(jnp.add, total, jax.grad(mean_loss)(params, mb)), None

  return lax.scan(step, jax.tree.map(jnp.zeros_like, params), split)[0]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sharded_batch_without_axis_name_is_not_resharded(axis_type):
  def loss_fn(params, batch, *, rng):
    return dropout_loss(params, batch, rng=rng), batch["mask"].sum(-1)

  fn = jax.jit(oa.value_and_grad(loss_fn, num_microbatches=K, has_aux=True,
                                 num_tokens_fn=num_tokens))
  rng = _key(5)
  with jax.set_mesh(_mesh(axis_type)):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_data(), P("data"))
    (_, tokens), grads = fn(params, batch, rng=rng)
    counts = oa.count_collectives(fn.lower(params, batch, rng=rng).compile())
  with jax.set_mesh(_mesh(AxisType.Auto)):  # Explicit refuses this reshape.
    naive = oa.count_collectives(jax.jit(_contiguous_scan).lower(
        jax.device_put(_params(), P()),
        jax.device_put(_data(), P("data"))).compile())
  # The documented layouts. Explicit axes: micro-batch i is the i-th block
  # of each device's rows. Auto axes (XLA places the batch): rows i, i + K,
  # i + 2K, ...
  rows = np.asarray(_data()["mask"]).sum(-1)
  if axis_type == AxisType.Explicit:
    take = lambda x, i: x.reshape((N, K, -1) + x.shape[1:])[:, i].reshape(
        (-1,) + x.shape[1:])
  else:
    take = lambda x, i: x[i::K]
  np.testing.assert_array_equal(
      tokens, np.stack([take(rows, i) for i in range(K)]))
  expected = _hand_dropout_grads([
      (jax.tree.map(lambda x, i=i: take(np.asarray(x), i), _data()),
       rng_lib.key_for(rng, i)) for i in range(K)])
  helpers.assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)
  for collective in ("all-gather", "all-to-all", "collective-permute"):
    assert collective not in counts.total, counts
  assert "all-gather" in naive.total, naive


def test_sharded_batch_too_small_to_split_names_the_sizes():
  with jax.set_mesh(_mesh()):
    batch = jax.device_put(jax.tree.map(lambda x: x[:16], _data()), P("data"))
    with pytest.raises(ValueError, match=(
        r"batch size 16 must be divisible by num_microbatches \* the data"
        r" axis size = 4 \* 8")):
      oa.value_and_grad(mean_loss, num_microbatches=4)(_params(), batch)
