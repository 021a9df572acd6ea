"""FSDP memory policies of ``oa.value_and_grad``: exact, placed, smaller.

``gradient_sync`` and ``gather_params`` decide whether parameters sharded
over the data axis are all-gathered, and their gradients reduce-scattered,
once per update or once per micro-batch. Every combination must give the
single-device full-batch gradient, sharded like the parameters; the compiled
program must put its collectives where the policy says (read with
``oa.count_collectives``); and ``memory_analysis()`` must show the memory that
the per-micro-batch variants save on 8 simulated devices.
"""

import re
import warnings

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import fsdp

N = 8  # simulated devices (tests/conftest.py).
K = 2  # micro-batches per device.
BATCH, SEQ, DIM, HIDDEN = 32, 4, 8, 16
ONCE, EVERY = "once", "every_microbatch"
POLICIES = [(s, g) for s in (ONCE, EVERY) for g in (ONCE, EVERY)]
# w1 and b1 are sharded over the data axis, w2 is replicated.
SPECS = {"w1": P("data"), "b1": P("data"), "w2": P()}
SHARDED_LEAVES = 2


def _data():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, SEQ + 1, size=BATCH)
  lengths[:2] = 0  # device 0's first micro-batch has no token: its loss is NaN.
  return jax.tree.map(jnp.asarray, helpers.padded_batch(rng, lengths, SEQ, DIM))


def _params():
  return helpers.mlp_params(DIM, HIDDEN, seed=1)


def raw_mean_loss(params, batch):
  """0/0 = NaN without tokens: it must be dropped before any collective."""
  return helpers.raw_mean(helpers.mlp_token_losses(params, batch), batch)


def _fn(gradient_sync, gather_params, **kwargs):
  return oa.value_and_grad(
      raw_mean_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
      axis_name="data", gradient_sync=gradient_sync,
      gather_params=gather_params, **kwargs,
  )


def _assert_exact(loss, grads):
  expected_loss, expected_grads = jax.value_and_grad(raw_mean_loss)(
      _params(), _data())
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def _expected_counts(gradient_sync, gather_params):
  """``(in the loop, outside it)`` for SHARDED_LEAVES FSDP leaves."""
  gathers = {"all-gather": SHARDED_LEAVES}
  scatters = {"reduce-scatter": SHARDED_LEAVES}
  in_loop, outside = {}, {"all-reduce": 1}  # w2, the loss and the tokens.
  (in_loop if gather_params == EVERY else outside).update(gathers)
  (in_loop if gradient_sync == EVERY else outside).update(scatters)
  return in_loop, outside


def _mesh(shape=(N,), names=("data",), axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


@pytest.mark.parametrize("under", [
    "jit", pytest.param("shard_map", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("gradient_sync", "gather_params"), POLICIES)
def test_every_policy_is_exact_sharded_and_placed(
    gradient_sync, gather_params, under):
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), SPECS)
    batch = jax.device_put(_data(), P("data"))
    if under == "jit":  # the specs are read off the Explicit types.
      step = jax.jit(_fn(gradient_sync, gather_params))
    else:  # inside shard_map the parameters are shards: say how.
      step = jax.jit(jax.shard_map(
          _fn(gradient_sync, gather_params, param_specs=SPECS),
          in_specs=(SPECS, P("data")), out_specs=(P(), SPECS),
      ))
    compiled = step.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
  _assert_exact(loss, grads)
  for name, grad in grads.items():
    assert grad.sharding.is_equivalent_to(params[name].sharding, grad.ndim)
  if under == "shard_map":
    counts = oa.count_collectives(compiled)
    assert (counts.in_loop, counts.outside) == _expected_counts(
        gradient_sync, gather_params)
  else:  # the typed form: in the loop, the loss's scalars aside.
    counts = oa.count_collectives(compiled, include_scalars=False)
    assert (counts.in_loop, counts.outside) == _expected_typed_counts(
        gradient_sync, gather_params)


def _expected_typed_counts(gradient_sync, gather_params):
  """``(in the loop, outside it)`` of the typed form's gradient-sized ones.

  A sharded leaf's sum is reduce-scattered (``lax.psum_scatter`` of each
  device's partial: each micro-batch's under
  ``gradient_sync="every_microbatch"``, else the step's one after the
  loop); the replicated leaf's is all-reduced once, after the loop.
  """
  gathers = {"all-gather": SHARDED_LEAVES}
  scatters = {"reduce-scatter": SHARDED_LEAVES}
  in_loop, outside = {}, {"all-reduce": 1}
  (in_loop if gather_params == EVERY else outside).update(gathers)
  (in_loop if gradient_sync == EVERY else outside).update(scatters)
  return in_loop, outside


def test_shards_inside_shard_map_without_param_specs_are_named():
  """Shards taken for whole parameters fail in the loss: JAX's error is
  kept (its type too), with a note that names param_specs."""
  step = jax.jit(jax.shard_map(
      _fn(ONCE, ONCE), mesh=_mesh(axis_type=AxisType.Auto),
      in_specs=(SPECS, P("data")), out_specs=(P(), SPECS)))
  with pytest.raises(TypeError) as raised:
    step(_params(), _data())
  assert re.search(
      r"vary over axis_name='data' \(params\['b1'\], params\['w1'\]\)"
      r" with param_specs=None\. If they are shards .* pass param_specs=",
      " ".join(raised.value.__notes__))


def test_auto_axes_use_the_given_param_specs():
  mesh = _mesh(axis_type=AxisType.Auto)
  shardings = {k: jax.NamedSharding(mesh, s) for k, s in SPECS.items()}
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), shardings)
    batch = jax.device_put(_data(), jax.NamedSharding(mesh, P("data")))
    step = jax.jit(_fn(EVERY, EVERY, param_specs=SPECS))
    compiled = step.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
  _assert_exact(loss, grads)
  assert grads["w1"].sharding.is_equivalent_to(shardings["w1"], 2)
  counts = oa.count_collectives(compiled)
  assert (counts.in_loop, counts.outside) == _expected_counts(EVERY, EVERY)


@pytest.mark.slow
def test_sharded_over_one_of_two_data_axes_sums_over_the_other_once():
  mesh = _mesh((4, 2), ("data", "fsdp"))
  specs = {"w1": P("fsdp"), "b1": P(), "w2": P()}
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), specs)
    batch = jax.device_put(_data(), P(("data", "fsdp")))
    step = jax.jit(oa.value_and_grad(
        raw_mean_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
        axis_name=("data", "fsdp"), gradient_sync=EVERY, gather_params=EVERY,
    ))
    compiled = step.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
  _assert_exact(loss, grads)
  assert grads["w1"].sharding.spec[0] == "fsdp"
  by_axes = oa.count_collectives(compiled, mesh=mesh,
                                 include_scalars=False).by_axes
  # In the loop, w1 gathered and its gradient reduce-scattered over "fsdp"
  # only; over "data" once, after the loop.
  assert by_axes[("fsdp",)].in_loop == {"all-gather": 1, "reduce-scatter": 1}
  assert by_axes[("data",)].in_loop == {}
  assert by_axes[("data",)].outside == {"all-reduce": 1}


def test_replicated_params_mean_once_whatever_the_policy(monkeypatch):
  monkeypatch.setattr(fsdp, "_warned_unused", set())
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_data(), P("data"))
    with pytest.warns(UserWarning, match="'every_microbatch' does nothing"):
      compiled = jax.jit(_fn(EVERY, EVERY)).lower(params, batch).compile()
    loss, grads = compiled(params, batch)
  _assert_exact(loss, grads)
  counts = oa.count_collectives(compiled, include_scalars=False)
  assert counts.total == {"all-reduce": 1} and counts.in_loop == {}


@pytest.mark.parametrize("barrier", [False, True])
def test_xla_hoists_gathers_out_of_the_loop_unless_tied_by_a_barrier(barrier):
  """The control: a gather of loop-invariant shards written in the loop."""

  def gather_in_loop(shards, batch):
    def step(total, microbatch):
      tied = shards
      if barrier:
        tied, _ = lax.optimization_barrier((shards, microbatch))
      whole = lax.all_gather(tied, "data", tiled=True)
      return total + jnp.sum(microbatch @ whole), None

    zero = oa.device_local(jnp.zeros([]), "data")
    total, _ = lax.scan(step, zero, batch.reshape(K, -1, DIM))
    return lax.psum(total, "data")

  with jax.set_mesh(_mesh(axis_type=AxisType.Auto)):
    step = jax.jit(jax.shard_map(
        gather_in_loop, in_specs=(P("data"), P("data")), out_specs=P()))
    counts = oa.count_collectives(step.lower(
        jnp.ones((DIM, 4)), jnp.ones((BATCH, DIM))).compile())
  assert counts.in_loop == ({"all-gather": 1} if barrier else {})


# Memory per device, from the compiled programs.

LAYERS, WIDTH, ROWS = 4, 256, 8 * N  # parameter-heavy: 1 MiB of f32 weights.
PARAM_BYTES = LAYERS * WIDTH * WIDTH * 4


def _stack_loss(params, batch):
  h = batch["x"]
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean(h**2)


def _memory_per_device(gradient_sync, gather_params,
                       axis_type=AxisType.Auto):
  """With Auto axes (the shard_map form, the layouts given as param_specs),
  or Explicit ones (the typed form, read off the types)."""
  mesh = _mesh(axis_type=axis_type)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=jax.NamedSharding(mesh, spec))
  params = [sds((WIDTH, WIDTH), P("data"))] * LAYERS
  batch = {"x": sds((ROWS, WIDTH), P("data"))}
  fn = oa.value_and_grad(
      _stack_loss, num_microbatches=K, axis_name="data",
      gradient_sync=gradient_sync, gather_params=gather_params,
      equal_weights=True,
      param_specs=[P("data")] * LAYERS if axis_type == AxisType.Auto else None)
  with jax.set_mesh(mesh):
    memory = jax.jit(fn).lower(params, batch).compile().memory_analysis()
  return (memory.temp_size_in_bytes + memory.argument_size_in_bytes
          + memory.output_size_in_bytes - memory.alias_size_in_bytes)


@pytest.mark.slow
def test_per_microbatch_policies_cut_memory_per_device():
  memory = {policy: _memory_per_device(*policy) for policy in POLICIES}
  report = {p: f"{m / PARAM_BYTES:.2f} x params" for p, m in memory.items()}
  whole_minus_shard = (1 - 1 / N) * PARAM_BYTES
  # A sharded gradient sum instead of a whole one: 7/8 of the parameter
  # bytes less, give or take a little scheduling.
  saved = memory[ONCE, ONCE] - memory[EVERY, ONCE]
  assert 0.8 * whole_minus_shard <= saved <= 1.25 * whole_minus_shard, report
  saved = memory[ONCE, EVERY] - memory[EVERY, EVERY]
  assert 0.8 * whole_minus_shard <= saved <= 1.25 * whole_minus_shard, report
  # Per-micro-batch gathers: on CPU the gathered layers live from their
  # forward to their backward use within a micro-batch (no re-gather), so
  # the saving is about one layer here, not 7/8 of the parameters.
  layer = PARAM_BYTES / LAYERS
  assert memory[ONCE, ONCE] - memory[ONCE, EVERY] >= 0.9 * layer, report
  assert memory[EVERY, ONCE] - memory[EVERY, EVERY] >= 0.9 * layer, report


@pytest.mark.slow
def test_the_typed_form_gathers_per_microbatch_to_save_memory():
  """Explicit axes: gather_params="every_microbatch" saves about a layer.

  gradient_sync="every_microbatch" saves nothing there on CPU: XLA writes
  each micro-batch's reduce-scatter as an all-reduce and a slice, which
  holds the whole sum (docs/distributed.md says so).
  """
  memory = {policy: _memory_per_device(*policy, AxisType.Explicit)
            for policy in POLICIES}
  report = {p: f"{m / PARAM_BYTES:.2f} x params" for p, m in memory.items()}
  layer = PARAM_BYTES / LAYERS
  assert memory[ONCE, ONCE] - memory[ONCE, EVERY] >= 0.9 * layer, report
  assert memory[EVERY, ONCE] - memory[EVERY, EVERY] >= 0.9 * layer, report


# Arguments.


def test_bad_policies_and_param_specs_are_named_at_construction():
  with pytest.raises(ValueError, match="gradient_sync must be one of"):
    oa.value_and_grad(raw_mean_loss, num_microbatches=K,
                      gradient_sync="always")
  with pytest.raises(ValueError, match=r"gather_params .* got 'never'"):
    oa.value_and_grad(raw_mean_loss, num_microbatches=K,
                      gather_params="never")
  with pytest.raises(TypeError, match=r"param_specs\['w1'\] must be a"):
    oa.value_and_grad(raw_mean_loss, num_microbatches=K,
                      param_specs={"w1": "data"})


def test_param_specs_that_do_not_match_the_params_are_named():
  fn = _fn(EVERY, EVERY, param_specs={"w": P("data")})
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match="param_specs must be a"):
      jax.jit(fn).lower(jax.device_put(_params(), SPECS),
                        jax.device_put(_data(), P("data")))


def _lower(fn, params, specs=None):
  """``fn`` traced on ``params`` (placed as ``specs``, else replicated) and
  the batch."""
  return jax.jit(fn).lower(jax.device_put(params, specs or P()),
                           jax.device_put(_data(), P("data")))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_param_specs_naming_an_axis_the_mesh_lacks_are_named(axis_type):
  """Failed before with Explicit axes: the axis was dropped, the gradient
  came back whole (FSDP or ZeRO off without a word)."""
  with jax.set_mesh(_mesh(axis_type=axis_type)):
    with pytest.raises(ValueError, match=re.escape(
        "param_specs['w1']=P('dta',) names the axis 'dta', which the mesh"
        " lacks (its axes: {'data': 8})")) as raised:
      _lower(_fn(ONCE, ONCE, param_specs=dict(SPECS, w1=P("dta"))),
             _params())
  assert "oa.zero_specs(params, 'data')" in str(raised.value)


def test_param_specs_the_data_size_does_not_divide_are_named():
  """A 3-element leaf over 8 devices. Failed before in JAX's "tiled
  reduce_scatter operand scatter dimension size 3 must be divisible by
  shard_count 8", naming neither param_specs nor the leaf. The fix it
  names, oa.zero_specs, keeps that leaf whole, and runs."""
  params = dict(_params(), odd=jnp.ones(3))
  fn = _fn(ONCE, ONCE, param_specs=dict(SPECS, odd=P("data")))
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match=re.escape(
        "param_specs shards params['odd'] over 'data' on dimension 0 of"
        " shape (3,), whose size 3 the 8 devices of 'data' do not divide"
        " (mesh axes {'data': 8}). Shard a dimension that 8 divides, or keep"
        " the leaf whole (P()): oa.zero_specs(params, 'data')")):
      _lower(fn, params)
    specs = oa.zero_specs(params, "data")
    assert specs["odd"] == P()
    _lower(_fn(ONCE, ONCE, param_specs=specs), params)


@pytest.mark.parametrize(("under", "held"), [
    ("jit", "a leaf of shape (16,)"),
    ("shard_map", "this device's shard of shape (2,)")])
def test_param_specs_on_a_dimension_the_leaf_lacks_are_named(under, held):
  """b1 is 1-D. Failed before under jax.jit with Explicit axes: the entry
  was dropped, b1's gradient came back whole; inside shard_map, JAX's
  "axis 1 is out of bounds for array of dimension 1"."""
  specs = dict(SPECS, b1=P(None, "data"))
  fn = _fn(ONCE, ONCE, param_specs=specs)
  if under == "shard_map":
    fn = jax.shard_map(fn, in_specs=(SPECS, P("data")),
                       out_specs=(P(), SPECS))
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match=re.escape(
        "param_specs shards params['b1'] over 'data' on dimension 1, which"
        f" {held} lacks")):
      _lower(fn, _params(), SPECS)


def test_every_microbatch_sync_without_sharded_leaves_warns_once(
    monkeypatch):
  """ZeRO-2 asked of oa.value_and_grad in a per-call loop (replicated
  parameters, no param_specs): exact, but the gradient is all-reduced
  whole on every call. Said once, at the caller's line, naming the call
  that does ZeRO-2; not where a leaf is sharded (FSDP)."""
  monkeypatch.setattr(fsdp, "_warned_unused", set())
  with jax.set_mesh(_mesh()):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _lower(_fn(EVERY, ONCE), _params(), SPECS)  # FSDP: it applies.
      assert not caught, [str(w.message) for w in caught]
      for _ in range(2):
        _lower(_fn(EVERY, ONCE), _params())
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert caught[0].category is UserWarning
  assert caught[0].filename == __file__
  assert re.match(
      r"gradient_sync='every_microbatch' does nothing here: no parameter"
      r" leaf is sharded over the data axes 'data'.* ZeRO-2 is"
      r" oa\.accumulate\(\.\.\., shard_optimizer='data',"
      r" gradient_sync='every_microbatch'\) fed the gradients of"
      r" oa\.value_and_grad\(\.\.\., gradient_sync='deferred'\)",
      str(caught[0].message))


# Shards handed to loss_fn (typed form, both policies "every_microbatch"):
# on TPU and GPU only (typed_trace.hands_shards_on), forced on here to check
# the arithmetic.


def _gathering_loss(params, batch):
  """raw_mean_loss written for FSDP weights: each gathered where used."""
  whole = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)
  return raw_mean_loss(whole, batch)


def _whole_weights_loss(params, batch):
  """A model that refuses sharded weights (as a layer asserting its own
  sharding would)."""
  from optax_accum._src.mesh import readers  # pylint: disable=g-import-not-at-top
  if "data" in readers.spec_names(jax.typeof(params["w1"]).sharding.spec):
    raise ValueError("this model takes whole weights")
  return raw_mean_loss(params, batch)


# Per case: the reduce-scatters left in the loop (the rest are the backward
# pass's, written on the CPU as one all-reduce): none where the loss takes
# both shards; where it refuses them or with_stats, both leaves'; with w1 in
# bfloat16 (its float32 sum) w1's alone.
_SCATTERED = {"takes shards": 0, "refuses shards": 2, "with_stats": 2,
              "bfloat16 weights": 1, "has_aux": 0}


@pytest.mark.parametrize("case", list(_SCATTERED))
def test_shards_handed_to_the_loss_are_exact(monkeypatch, case):
  from optax_accum._src.microbatch import typed_trace  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(typed_trace, "hands_shards_on", lambda platform: True)
  loss = (_whole_weights_loss if case == "refuses shards"
          else _gathering_loss)
  if case == "has_aux":  # stacked aux: weighted after the backward pass.
    loss = lambda p, b: (_gathering_loss(p, b), helpers.num_tokens(b))
  params = _params()
  if case == "bfloat16 weights":
    params = dict(params, w1=params["w1"].astype(jnp.bfloat16))
  with jax.set_mesh(_mesh()):
    fn = oa.value_and_grad(
        loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
        gradient_sync=EVERY, gather_params=EVERY,
        with_stats=case == "with_stats", has_aux=case == "has_aux")
    step = jax.jit(fn)
    args = (jax.device_put(params, SPECS), jax.device_put(_data(), P("data")))
    compiled = step.lower(*args).compile()
    out = compiled(*args)
  loss_value, grads = out[:2]  # with_stats: then the GradStats.
  if case == "has_aux":
    (loss_value, _), grads = out
  if case == "bfloat16 weights":
    expected = jax.value_and_grad(raw_mean_loss)(params, _data())
    helpers.assert_trees_close((loss_value, grads), expected, rtol=2e-2,
                               atol=2e-2)
  else:
    _assert_exact(loss_value, grads)
  for name, grad in grads.items():
    assert grad.sharding.is_equivalent_to(args[0][name].sharding, grad.ndim)
  # On the CPU the backward pass's reduce-scatter of a shard's gradient is an
  # all-reduce: which path ran shows in the loop.
  in_loop = oa.count_collectives(compiled, include_scalars=False).in_loop
  assert in_loop.get("reduce-scatter", 0) == _SCATTERED[case], in_loop
  assert in_loop["all-gather"] == SHARDED_LEAVES, in_loop


def test_shards_stay_gathered_on_the_cpu_without_set_mesh():
  """The platform is read off the parameters' types when no mesh is set:
  on the CPU the loop gathers (and reduce-scatters) itself."""
  mesh = _mesh()
  params = jax.device_put(_params(), {k: jax.NamedSharding(mesh, s)
                                      for k, s in SPECS.items()})
  batch = jax.device_put(_data(), jax.NamedSharding(mesh, P("data")))
  fn = oa.value_and_grad(
      _gathering_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
      gradient_sync=EVERY, gather_params=EVERY)
  compiled = jax.jit(fn).lower(params, batch).compile()
  _assert_exact(*compiled(params, batch))
  in_loop = oa.count_collectives(compiled, include_scalars=False).in_loop
  assert in_loop.get("reduce-scatter") == SHARDED_LEAVES, in_loop
