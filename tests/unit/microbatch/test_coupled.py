"""coupled_value_and_grad: the full batch's gradient of a loss that couples it.

Every case compares against ``jax.value_and_grad`` of the whole batch, for
three losses that are not sums over examples; the naive method (the mean of
per-micro-batch losses, each with its own negatives) must differ. Memory is
read from the compiled program, collectives from its HLO.
"""

import itertools
import subprocess
import sys

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa

N = 8  # simulated devices (tests/conftest.py).
BATCH, DIM, EMB = 16, 8, 4


def _data(seed=0, batch=BATCH):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, DIM)).astype(np.float32)
  return {
      "a": jnp.asarray(x),
      "b": jnp.asarray(x + 0.3 * rng.normal(size=x.shape).astype(np.float32)),
      "y": jnp.asarray(rng.normal(size=batch).astype(np.float32)),
  }


def _params(seed=1):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) / 2)
  return {"wa": f(DIM, EMB), "wb": f(DIM, EMB), "v": f(EMB),
          "router": f(DIM, 3), "log_t": jnp.float32(0.5)}


def _normalize(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


# Three losses that couple the batch, each with its encoder.


def two_towers(params, mb):
  return {"a": _normalize(jnp.tanh(mb["a"] @ params["wa"])),
          "b": _normalize(jnp.tanh(mb["b"] @ params["wb"]))}


def info_nce(params, reps, batch):
  """Symmetric InfoNCE with in-batch negatives and a learnable temperature."""
  del batch
  logits = reps["a"] @ reps["b"].T * jnp.exp(params["log_t"])
  labels = jnp.arange(logits.shape[0])
  rows = jax.nn.log_softmax(logits, axis=1)[labels, labels]
  cols = jax.nn.log_softmax(logits, axis=0)[labels, labels]
  return -(rows.mean() + cols.mean()) / 2


def one_tower(params, mb):
  return jnp.tanh(mb["a"] @ params["wa"])


def batch_normalised(params, reps, batch):
  """Regression on representations standardised over the batch."""
  z = (reps - reps.mean(0)) / jnp.sqrt(reps.var(0) + 1e-3)
  return jnp.mean((z @ params["v"] - batch["y"]) ** 2)


def moe(params, mb):
  return {"h": jnp.tanh(mb["a"] @ params["wa"]),
          "router_logits": mb["a"] @ params["router"]}


def load_balanced(params, reps, batch):
  """A task loss plus a Switch-style load-balancing term over the batch."""
  probs = jax.nn.softmax(reps["router_logits"])
  experts = probs.shape[-1]
  fraction = jax.nn.one_hot(jnp.argmax(probs, -1), experts).mean(0)
  balance = experts * jnp.sum(fraction * probs.mean(0))
  task = jnp.mean((reps["h"] @ params["v"] - batch["y"]) ** 2)
  return task + 0.5 * balance


LOSSES = {
    "info_nce": (two_towers, info_nce),
    "batch_normalised": (one_tower, batch_normalised),
    "load_balanced": (moe, load_balanced),
}


def _full_batch(encode_fn, loss_fn, params, batch):
  return jax.value_and_grad(lambda p: loss_fn(p, encode_fn(p, batch), batch))(
      params
  )


def _assert_close(actual, expected):
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(actual[1], expected[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(4, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matches_the_full_batch(name, k):
  encode_fn, loss_fn = LOSSES[name]
  params, batch = _params(), _data()
  fn = jax.jit(oa.coupled_value_and_grad(encode_fn, loss_fn,
                                         num_microbatches=k))
  with jax.numpy_dtype_promotion("strict"):
    value, grads = fn(params, batch)
  _assert_close((value, grads), _full_batch(encode_fn, loss_fn, params, batch))
  chex.assert_trees_all_equal_dtypes(grads, params)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_per_microbatch_accumulation_differs(name):
  """The negative control: each micro-batch with only its own examples."""
  encode_fn, loss_fn = LOSSES[name]
  params, batch = _params(), _data()
  naive = oa.value_and_grad(
      lambda p, mb: loss_fn(p, encode_fn(p, mb), mb), num_microbatches=4,
      equal_weights=True,  # equal micro-batches: wrong only by coupling.
  )
  value, grads = naive(params, batch)
  expected_value, expected_grads = _full_batch(encode_fn, loss_fn, params,
                                               batch)
  assert abs(float(value - expected_value)) > 1e-3
  gap = max(float(jnp.max(jnp.abs(g - e))) for g, e in zip(
      jax.tree.leaves(grads), jax.tree.leaves(expected_grads)))
  assert gap > 1e-3


@pytest.mark.slow
def test_aux_args_and_integer_reps():
  """Labels travel in reps (no gradient); a temperature comes in *args."""

  def encode_fn(params, mb, scale):
    return {"z": _normalize(mb["a"] @ params["wa"]) * scale,
            "label": (mb["y"] > 0).astype(jnp.int32)}

  def loss_fn(params, reps, batch, scale):
    del batch
    logits = reps["z"] @ reps["z"].T * scale * jnp.exp(params["log_t"])
    same = reps["label"][:, None] == reps["label"][None, :]
    log_p = jax.nn.log_softmax(logits - 1e9 * jnp.eye(len(logits)), axis=1)
    loss = -jnp.sum(jnp.where(same, log_p, 0)) / jnp.sum(same)
    return loss, {"positives": jnp.sum(same), "mean_logit": logits.mean()}

  params, batch, scale = _params(), _data(), jnp.float32(2.0)
  fn = oa.coupled_value_and_grad(encode_fn, loss_fn, num_microbatches=4,
                                 has_aux=True)
  (value, aux), grads = fn(params, batch, scale)
  expected = jax.value_and_grad(
      lambda p: loss_fn(p, encode_fn(p, batch, scale), batch, scale),
      has_aux=True)(params)
  _assert_close((value, grads), (expected[0][0], expected[1]))
  np.testing.assert_allclose(aux["mean_logit"], expected[0][1]["mean_logit"],
                             rtol=1e-5, atol=1e-6)
  assert int(aux["positives"]) == int(expected[0][1]["positives"])


def _dropout_encoder(params, mb, rng=None):
  h = jnp.tanh(mb["a"] @ params["wa"])
  if rng is not None:
    h = jnp.where(jax.random.bernoulli(rng, 0.5, h.shape), h * 2, 0)
  return h


@pytest.mark.slow
def test_rng_gives_each_microbatch_one_key_for_both_passes():
  params, batch, rng, k = _params(), _data(), jax.random.key(3), 4
  fn = jax.jit(oa.coupled_value_and_grad(_dropout_encoder, batch_normalised,
                                         num_microbatches=k))

  def reference(p):  # micro-batch i encoded with fold_in(rng, i).
    split = jax.tree.map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)
    reps = jnp.concatenate([
        _dropout_encoder(p, jax.tree.map(lambda x, i=i: x[i], split),
                         rng=jax.random.fold_in(rng, i))
        for i in range(k)])
    return batch_normalised(p, reps, batch)

  _assert_close(fn(params, batch, rng=rng),
                jax.value_and_grad(reference)(params))
  same = fn(params, batch, rng=rng)[0]
  other = fn(params, batch, rng=jax.random.key(4))[0]
  without = fn(params, batch)[0]
  assert float(same) == float(fn(params, batch, rng=rng)[0])
  assert float(other) != float(same) and float(without) != float(same)
  # Without rng= the encoder is called without it: no dropout.
  _assert_close(fn(params, batch),
                _full_batch(_dropout_encoder, batch_normalised, params, batch))


def _mlp_encoder(params, x):
  """Wide hidden layers, narrow representations: activations dominate."""
  for w in params:
    x = jnp.tanh(x @ w)
  return x


def _spread(params, reps, x):
  del params, x
  return jnp.sum(jnp.square(reps - reps.mean(0)))


def _temp_bytes(f, *args):
  return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_temporary_memory_falls_with_k():
  rng = np.random.default_rng(0)
  shapes = [(16, 128), (128, 128), (128, 128), (128, 128), (128, 8)]
  params = [jnp.asarray(rng.normal(size=s).astype(np.float32) / 8)
            for s in shapes]
  x = jnp.asarray(rng.normal(size=(512, 16)).astype(np.float32))
  full = _temp_bytes(
      jax.value_and_grad(lambda p: _spread(p, _mlp_encoder(p, x), x)), params)
  temps = [_temp_bytes(oa.coupled_value_and_grad(
      _mlp_encoder, _spread, num_microbatches=k), params, x)
           for k in (1, 2, 4, 8)]
  assert all(a > b for a, b in itertools.pairwise(temps)), temps
  assert temps[-1] < 0.35 * full, (temps, full)


@pytest.mark.slow
def test_low_precision_params_get_gradients_in_their_dtype():
  encode_fn, loss_fn = LOSSES["info_nce"]
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _data())
  fn = jax.jit(oa.coupled_value_and_grad(
      encode_fn, loss_fn, num_microbatches=4, accumulator_dtype=jnp.float32))
  value, grads = fn(params, batch)
  chex.assert_trees_all_equal_dtypes(grads, params)
  assert value.dtype == jnp.bfloat16


# Data parallelism: every device sees the global batch's negatives.


# Both towers' reps gathered in one all-gather, their cotangents scattered back
# in one reduce-scatter, the gradient and the loss summed in one all-reduce.
ONCE = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}


def _mesh(axis_type):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def _coupled(num_microbatches=2, loss_fn=info_nce, **kwargs):
  return oa.coupled_value_and_grad(two_towers, loss_fn,
                                   num_microbatches=num_microbatches, **kwargs)


def _expected(batch_size=2 * N * 2):
  params, batch = _params(), _data(batch=batch_size)
  return _full_batch(two_towers, info_nce, params, batch)


@pytest.mark.slow
def test_shard_map_gathers_reps_and_reduces_once():
  params, batch = _params(), _data(batch=32)
  fn = jax.jit(jax.shard_map(
      _coupled(axis_name="data"), mesh=_mesh(AxisType.Auto),
      in_specs=(P(), P("data")), out_specs=P()))
  _assert_close(fn(params, batch), _expected(32))
  counts = oa.count_collectives(fn.lower(params, batch).compile())
  assert counts.in_loop == {}, counts
  assert counts.total == ONCE, counts

  # The count can fail: a collective that the encoder itself runs is in a loop.
  def chatty(params, mb):
    return jax.tree.map(lambda r: r + lax.pmean(r.mean(), "data") * 0,
                        two_towers(params, mb))

  chatty_fn = jax.jit(jax.shard_map(
      oa.coupled_value_and_grad(chatty, info_nce, num_microbatches=2,
                                axis_name="data"),
      mesh=_mesh(AxisType.Auto), in_specs=(P(), P("data")), out_specs=P()))
  assert oa.count_collectives(chatty_fn.lower(params, batch).compile()).in_loop


def test_every_device_must_see_the_global_negatives():
  """The negative control: shard_map over the naive per-device loss differs."""
  params, batch = _params(), _data(batch=32)

  def local_only(params, batch):
    value, grads = jax.value_and_grad(
        lambda p: info_nce(p, two_towers(p, batch), batch))(params)
    return lax.pmean(value, "data"), lax.pmean(grads, "data")

  fn = jax.jit(jax.shard_map(local_only, mesh=_mesh(AxisType.Auto),
                             in_specs=(P(), P("data")), out_specs=P()))
  value, _ = fn(params, batch)
  assert abs(float(value - _expected(32)[0])) > 1e-2


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.slow
def test_under_jit_with_a_mesh(axis_type):
  with jax.set_mesh(_mesh(axis_type)):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_data(batch=32), P("data"))
    fn = jax.jit(_coupled(axis_name="data", has_aux=False))
    result = fn(params, batch)
    counts = oa.count_collectives(fn.lower(params, batch).compile())
  _assert_close(result, _expected(32))
  assert counts.in_loop == {}, counts
  if axis_type == AxisType.Auto:
    assert counts.total == ONCE, counts
  else:  # the typed form: each tower's reps gathered, one gradient reduction.
    assert counts.total == {"all-gather": 2, "all-reduce": 1}, counts


@pytest.mark.slow
def test_under_jit_with_fsdp_params_and_aux():
  def loss_fn(params, reps, batch):
    return info_nce(params, reps, batch), batch["y"].sum()

  with jax.set_mesh(_mesh(AxisType.Explicit)):
    params = jax.device_put(_params(), {"wa": P(), "wb": P("data"), "v": P(),
                                        "router": P(), "log_t": P()})
    batch = jax.device_put(_data(batch=32), P("data"))
    fn = jax.jit(_coupled(axis_name="data", has_aux=True, loss_fn=loss_fn))
    (value, aux), grads = fn(params, batch)
    counts = oa.count_collectives(fn.lower(params, batch).compile())
  _assert_close((value, grads), _expected(32))
  assert grads["wb"].sharding.spec == P("data", None)  # the params' sharding.
  assert counts.in_loop == {}, counts
  # wb gathered once before the loops; the towers' reps gathered for the
  # loss; the gradient reduced once: wb's reduce-scattered, the rest's
  # all-reduced.
  assert counts.total == {"all-gather": 4, "all-reduce": 1,
                          "reduce-scatter": 1}, counts
  # The typed form's loss sees the whole batch: the sum of every y.
  np.testing.assert_allclose(aux, np.asarray(_data(batch=32)["y"]).sum(),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_shard_map_with_fsdp_params_takes_param_specs():
  specs = {"wa": P("data"), "wb": P(), "v": P(), "router": P(), "log_t": P()}

  def step(**kwargs):
    return jax.jit(jax.shard_map(
        _coupled(axis_name="data", **kwargs), mesh=_mesh(AxisType.Auto),
        in_specs=(specs, P("data")), out_specs=(P(), specs)))

  _assert_close(step(param_specs=specs)(_params(), _data(batch=32)),
                _expected(32))
  with pytest.raises(TypeError, match=(  # JAX's, with our note.
      r"\(params\['wa'\]\) with param_specs=None\. If they are shards")):
    step()(_params(), _data(batch=32))


def test_rng_differs_across_devices():
  params, batch = _params(), _data(batch=32)
  coupled = oa.coupled_value_and_grad(
      lambda p, mb, rng: jax.random.uniform(rng, (mb["a"].shape[0], 1)),
      lambda p, reps, batch: (jnp.float32(0), reps),
      num_microbatches=2, axis_name="data", has_aux=True)
  fn = jax.jit(jax.shard_map(
      lambda p, b, key: coupled(p, b, rng=key),
      mesh=_mesh(AxisType.Auto), in_specs=(P(), P("data"), P()),
      out_specs=P(), check_vma=False))
  (_, reps), _ = fn(params, batch, jax.random.key(0))
  assert len(np.unique(np.asarray(reps))) == 32  # 16 micro-batches, 16 keys.


# Bad input.


def _encode(p, mb):
  return two_towers(p, mb)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(encode_fn=None), TypeError, "encode_fn must be callable, got None"),
    (dict(loss_fn=3), TypeError, "loss_fn must be callable, got 3"),
    (dict(num_microbatches=0), ValueError, "num_microbatches .* got 0"),
    (dict(num_microbatches=2.0), TypeError, "num_microbatches .* float"),
    (dict(num_microbatches=True), TypeError, "num_microbatches"),
    (dict(has_aux=1), TypeError, "has_aux must be a bool"),
    (dict(axis_name=1), TypeError, "axis_name"),
    (dict(accumulator_dtype=jnp.int32), ValueError, "accumulator_dtype"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  kwargs = {"encode_fn": _encode, "loss_fn": info_nce, "num_microbatches": 2,
            **kwargs}
  with pytest.raises(error, match=match):
    oa.coupled_value_and_grad(kwargs.pop("encode_fn"), kwargs.pop("loss_fn"),
                              **kwargs)


@pytest.mark.parametrize("encode_fn, loss_fn, kwargs, match", [
    (_encode, info_nce, dict(num_microbatches=3),
     "batch size 16 .* num_microbatches=3"),
    (lambda p, mb: jnp.sum(mb["a"]), info_nce, {},
     r"reps has shape \(\); every representation needs the micro-batch's"
     " leading axis of size 8"),
    (lambda p, mb: {"a": mb["a"][:, :3].T}, info_nce, {},
     r"reps\['a'\] has shape \(3, 8\).* size 8"),
    (_encode, lambda p, reps, b: reps["a"], {}, "scalar loss"),
    (_encode, info_nce, dict(has_aux=True), r"pair \(loss, aux\)"),
    (lambda p, mb: {}, info_nce, {}, "at least one array"),
])
def test_bad_functions_and_batches_are_named(encode_fn, loss_fn, kwargs,
                                             match):
  fn = oa.coupled_value_and_grad(
      encode_fn, loss_fn, **{"num_microbatches": 2, **kwargs})
  with pytest.raises(ValueError, match=match):
    fn(_params(), _data())


def test_bad_rng_and_unbound_axis_are_named():
  fn = _coupled()
  with pytest.raises(TypeError, match="rng must be one PRNG key"):
    fn(_params(), _data(), rng=3)
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    jax.jit(_coupled(axis_name="data"))(_params(), _data())
  with jax.set_mesh(_mesh(AxisType.Auto)):
    with pytest.raises(ValueError, match=r"24 .* 2 \* 8"):
      jax.jit(_coupled(axis_name="data"))(_params(), _data(batch=24))


# bfloat16 on a data x model mesh: XLA aborted the process compiling a
# bfloat16 sum over "data" in a shard_map that leaves "model" automatic.

BF16_CASES = [(entry, form, layout)
              for entry in ("coupled", "value_and_grad")
              for form in ("auto", "explicit", "shard_map")
              for layout in ("tp", "fsdp")
              if entry == "coupled" or (form, layout) in (
                  ("auto", "tp"), ("shard_map", "fsdp"),
                  ("explicit", "fsdp"))]


@pytest.mark.parametrize("entry,form,layout", BF16_CASES)
@pytest.mark.slow
def test_bfloat16_on_a_data_by_model_mesh_runs_and_matches_one_device(
    entry, form, layout):
  """Each case in its own process (tests/support/bf16_mesh_worker.py): an
  abort there fails this case only."""
  done = subprocess.run(
      [sys.executable, str(helpers.SUPPORT / "bf16_mesh_worker.py"),
       entry, form, layout],
      env=helpers.worker_env(JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "matches one device" in done.stdout, done.stdout
