"""``oa.check_train_step``: every micro-batch, one gradient reduction.

Our steps pass (the manual, typed and FSDP forms of ``oa.value_and_grad``,
an ``oa.accumulate`` micro-step, ``oa.coupled_value_and_grad``'s two loops);
the negative controls fail, naming what they do: a scan that reduces the
gradient in every micro-batch, a loop that runs fewer micro-batches than
asked, a micro-step that reduces on every call, a gradient never reduced or
reduced twice. What each finds wrong comes with the fix of the step's form:
the typed form's arguments under jax.jit, the recipe's inside shard_map,
both where the program does not tell. Programs are compiled on 8 simulated
devices (tests/conftest.py), each once.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

N = 8  # simulated devices (tests/conftest.py).
K = 4
PARAMS = {"w": jnp.ones((4, 2)), "v": jnp.ones(2)}
BATCH = jnp.ones((64, 4))
ABSTRACT_MESH = jax.sharding.AbstractMesh((N,), ("data",))
FSDP_SPECS = {"w1": P("data"), "b1": P("data"), "w2": P()}


def _loss(params, x):
  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"]) ** 2)


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def _manual(step, check_vma=True):
  """``step(params, batch)`` on each device's rows, compiled."""
  f = jax.shard_map(step, mesh=_mesh(), in_specs=(P(), P("data")),
                    out_specs=P(), check_vma=check_vma)
  return jax.jit(f).lower(PARAMS, BATCH).compile()


@functools.cache
def _value_and_grad_step(k=K):
  return _manual(oa.value_and_grad(_loss, num_microbatches=k,
                                   axis_name="data", equal_weights=True))


def _check(program, **kwargs):
  return oa.check_train_step(program, data_axes="data", **kwargs)


def test_the_manual_step_passes_and_reduces_each_leaf_once():
  found = _check(_value_and_grad_step(), num_microbatches=K, params=PARAMS)
  assert found.trip_counts == (K,)
  assert not found.accumulate_step
  assert (found.in_loop, found.outside) == ({}, {"all-reduce": 1})
  assert found.reduced_elements == found.gradient_elements == {"data": 10}


def test_the_typed_step_passes():
  mesh = _mesh(AxisType.Explicit)
  grad_fn = oa.value_and_grad(_loss, num_microbatches=K, equal_weights=True)
  with jax.set_mesh(mesh):
    params = jax.device_put(PARAMS, P())
    batch = jax.device_put(BATCH, P("data"))
    compiled = jax.jit(grad_fn).lower(params, batch).compile()
  found = _check(compiled, num_microbatches=K, params=params)
  assert found.trip_counts == (K,) and found.in_loop == {}
  assert found.reduced_elements == found.gradient_elements


def test_a_loop_of_fewer_microbatches_than_asked_fails():
  with pytest.raises(AssertionError,
                     match=f"runs {K} times, expected 8: 4 of every 8"):
    _check(_value_and_grad_step(), num_microbatches=8)
  with pytest.raises(AssertionError,
                     match="no micro-batch loop of optax_accum found"):
    _check(_value_and_grad_step(1), num_microbatches=K)
  # One micro-batch per call: no loop, and nothing to count.
  assert _check(_value_and_grad_step(1), num_microbatches=1).trip_counts == ()


def test_a_scan_that_reduces_in_every_microbatch_fails():
  """The naive loop: pmean the gradient of each micro-batch, then sum."""

  def naive(params, x):
    def step(total, mb):
      grads = jax.lax.pmean(jax.grad(_loss)(params, mb), "data")
      return jax.tree.map(jnp.add, total, grads), None
    total, _ = jax.lax.scan(step, jax.tree.map(jnp.zeros_like, params),
                            x.reshape(K, -1, x.shape[-1]))
    return total

  compiled = _manual(naive, check_vma=False)
  assert oa.count_collectives(compiled, include_scalars=False).in_loop
  with pytest.raises(AssertionError, match=(
      r"1 all-reduce of gradient size \(40 bytes\) over \('data',\) inside"
      " the micro-batch loop: the gradient is reduced every micro-batch"
      r".*oa\.value_and_grad\(\.\.\., axis_name=\.\.\.\)")) as raised:
    _check(compiled, num_microbatches=K)
  assert "sharding_report" not in str(raised.value)  # the typed form's.


def test_a_typed_loop_reducing_a_bias_in_every_microbatch_names_the_report():
  """Under jax.jit with Explicit axes a bias added to batch-sharded
  activations stays replicated (reduced in the loop, on the CPU): the fix
  is oa.sharding_report's, not the shard_map recipe's."""
  def biased(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["v"]) ** 2)

  grad_fn = oa.value_and_grad(biased, num_microbatches=K, equal_weights=True)
  with jax.set_mesh(_mesh(AxisType.Explicit)), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback's, once per process.
    compiled = jax.jit(grad_fn).lower(
        jax.device_put(PARAMS, P()), jax.device_put(BATCH, P("data"))
        ).compile()
  with pytest.raises(AssertionError, match=(
      r"inside the micro-batch loop.*oa\.sharding_report lists the leaves"
      )) as raised:
    _check(compiled, num_microbatches=K)
  assert "axis_name" not in str(raised.value)


def test_a_gradient_never_or_twice_reduced_fails():
  def local_grads(params, x):  # each device's own: never summed.
    return jax.grad(_loss)(params, x)

  def twice(params, x):  # and a gradient-sized metric, summed again.
    grads = jax.lax.psum(jax.grad(_loss)(params, x), "data")
    return grads, jax.lax.psum(jax.tree.map(jnp.square, grads), "data")

  with pytest.raises(AssertionError, match="never summed"):
    _check(_manual(local_grads, check_vma=False), num_microbatches=1)
  compiled = _manual(twice, check_vma=False)
  assert _check(compiled, num_microbatches=1)  # without params: not seen.
  with pytest.raises(AssertionError, match=(
      "sum 20 gradient elements, the gradient has 10: some leaf is reduced"
      " more than once")):
    _check(compiled, num_microbatches=1, params=PARAMS)
  with pytest.raises(AssertionError, match="some leaf is not reduced"):
    _check(_value_and_grad_step(), num_microbatches=K,
           params={**PARAMS, "u": jnp.ones(3)})


def _micro_step_program(log_grads: bool):
  """An ``oa.accumulate`` micro-step under shard_map (that may also sum
  each call's gradient over the devices, for a metric)."""
  mesh = _mesh(AxisType.Explicit)
  tx = oa.accumulate(optax.sgd(0.1), every_k=K, axis_name="data")

  def micro_step(params, state, mb):
    grads = jax.grad(_loss)(oa.device_local(params, "data"), mb)
    updates, state = tx.update(grads, state, params, num_tokens=1.0)
    logged = jax.lax.psum(grads, "data") if log_grads else {}
    return optax.apply_updates(params, updates), state, logged

  with jax.set_mesh(mesh):
    params = jax.device_put(PARAMS, P())
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(
        micro_step, in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs, P())))
    return step.lower(params, state, jax.device_put(BATCH, P("data"))
                      ).compile()


def test_an_accumulate_micro_step_reduces_in_its_emitting_branch():
  found = _check(_micro_step_program(False), num_microbatches=1,
                 params=PARAMS)
  assert found.accumulate_step
  assert (found.in_emitting_branch, found.outside) == ({"all-reduce": 1}, {})
  assert found.reduced_elements == found.gradient_elements
  with pytest.raises(AssertionError, match=(
      r"outside oa\.accumulate's emitting branch: the gradient is reduced on"
      " every micro-step")) as raised:
    _check(_micro_step_program(True), num_microbatches=1)
  # The shard_map recipe, not the typed form's arguments.
  assert "oa.device_local(params, axis_name)" in str(raised.value)
  assert "gradient_sync" not in str(raised.value)


ZERO_PARAMS = {"w": jnp.ones((16, 8)), "v": jnp.ones(8)}  # shardable by 8.


@functools.cache
def _typed_micro_step_program(grads_sync: str, accumulate_sync: str):
  """A ZeRO micro-step under jax.jit with Explicit axes, one call per
  micro-batch: ``gradient_sync`` given to oa.value_and_grad, then to
  oa.accumulate."""
  tx = oa.accumulate(optax.adamw(0.1), every_k=K, shard_optimizer="data",
                     gradient_sync=accumulate_sync)
  grad_fn = oa.value_and_grad(_loss, num_microbatches=1, equal_weights=True,
                              gradient_sync=grads_sync)

  @jax.jit
  def micro_step(params, state, mb):
    _, grads = grad_fn(params, mb)
    updates, state = tx.update(grads, state, params, num_tokens=1.0)
    return oa.apply_if_updated(params, updates, state), state

  with jax.set_mesh(_mesh(AxisType.Explicit)):
    params = jax.device_put(ZERO_PARAMS, P())
    return micro_step.lower(params, jax.jit(tx.init)(params),
                            jax.device_put(jnp.ones((64, 16)), P("data"))
                            ).compile()


def test_zero2_asked_of_value_and_grad_is_told_the_typed_fix():
  """gradient_sync='every_microbatch' given to oa.value_and_grad in a ZeRO
  per-call loop: exact, but the gradient is all-reduced on every call.
  Failed before: the hint named oa.device_local, the shard_map recipe."""
  with pytest.raises(AssertionError, match="1 all-reduce") as raised:
    _check(_typed_micro_step_program("every_microbatch", "once"),
           num_microbatches=1, gradient_sync="every_microbatch")
  message = str(raised.value)
  assert "oa.value_and_grad(..., gradient_sync='deferred')" in message
  assert ("ZeRO-2 is gradient_sync='every_microbatch' given to"
          " oa.accumulate (with shard_optimizer), not to oa.value_and_grad"
          ) in message
  assert "device_local" not in message and "shard_map" not in message


def test_zero2_in_a_per_call_loop_passes_when_asked():
  """ZeRO-2 as docs/zero.md says: deferred gradients, gradient_sync given
  to oa.accumulate: a reduce-scatter per leaf on every call, which the
  check lets run when told, as the typed form's fix says."""
  compiled = _typed_micro_step_program("deferred", "every_microbatch")
  found = _check(compiled, num_microbatches=1,
                 gradient_sync="every_microbatch")
  assert found.accumulate_step
  assert found.outside == {"reduce-scatter": 2}
  with pytest.raises(AssertionError, match=(
      r"2 reduce-scatters .*ZeRO-2, gradient_sync='every_microbatch' given"
      r" to oa\.accumulate, .* pass gradient_sync='every_microbatch' here"
      " too")) as raised:
    _check(compiled, num_microbatches=1)
  assert "device_local" not in str(raised.value)


def test_fsdp_reduce_scatters_in_the_loop_pass_only_when_asked():
  mesh = _mesh(AxisType.Explicit)
  grad_fn = oa.value_and_grad(
      helpers.mlp_mean_loss, num_microbatches=2, axis_name="data",
      num_tokens_fn=helpers.num_tokens, gradient_sync="every_microbatch",
      param_specs=FSDP_SPECS)
  rng = np.random.default_rng(0)
  batch = helpers.padded_batch(rng, rng.integers(1, 5, size=32), 4, 8)
  with jax.set_mesh(mesh):
    params = jax.device_put(helpers.mlp_params(8, 16, seed=1), FSDP_SPECS)
    batch = jax.device_put(jax.tree.map(jnp.asarray, batch), P("data"))
    compiled = jax.jit(jax.shard_map(
        grad_fn, in_specs=(FSDP_SPECS, P("data")),
        out_specs=(P(), FSDP_SPECS))).lower(params, batch).compile()
  with pytest.raises(AssertionError, match=(
      r"2 reduce-scatters .* inside the micro-batch loop.*"
      "gradient_sync='every_microbatch'")):
    _check(compiled, num_microbatches=2)
  found = _check(compiled, num_microbatches=2, params=params,
                 gradient_sync="every_microbatch")
  assert found.in_loop == {"reduce-scatter": 2}
  assert found.reduced_elements == found.gradient_elements


def test_a_leaf_reduced_in_stages_over_two_data_axes_passes():
  """FSDP over ("data", "fsdp"), typed: XLA reduce-scatters a sharded leaf
  over fsdp, then all-reduces its shard over data: each stage counted on its
  axis, against the leaf's shard there."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
                       axis_types=(AxisType.Explicit,) * 2)
  specs = {"w1": P("fsdp"), "b1": P("fsdp"), "w2": P()}
  grad_fn = oa.value_and_grad(helpers.mlp_mean_loss, num_microbatches=2,
                              num_tokens_fn=helpers.num_tokens)
  rng = np.random.default_rng(0)
  batch = helpers.padded_batch(rng, rng.integers(1, 5, size=32), 4, 8)
  with jax.set_mesh(mesh):
    params = jax.device_put(helpers.mlp_params(8, 16, seed=1), specs)
    batch = jax.device_put(jax.tree.map(jnp.asarray, batch),
                           P(("data", "fsdp")))
    compiled = jax.jit(grad_fn).lower(params, batch).compile()
  found = oa.check_train_step(compiled, num_microbatches=2,
                              data_axes=("data", "fsdp"), params=params)
  # w1 (128), b1 (16): whole over fsdp, a quarter over data; w2 (16) both.
  assert found.gradient_elements == {"data": 52, "fsdp": 160}
  assert found.reduced_elements == found.gradient_elements


def test_coupled_value_and_grad_has_two_loops_of_k():
  """Two scans without our loop's named scope: the outermost loops."""
  fn = oa.coupled_value_and_grad(
      lambda p, mb: jnp.tanh(mb @ p["w"]),
      lambda p, reps, batch: jnp.mean(jax.nn.logsumexp(reps @ reps.T, 1)),
      num_microbatches=K)
  compiled = jax.jit(fn).lower(PARAMS, jnp.ones((16, 4))).compile()
  assert oa.check_train_step(compiled, num_microbatches=K).trip_counts == (
      K, K)


_LOOP = """\
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %g = f32[8] all-reduce(%x), replica_groups={}, to_apply=%add
}"""


def test_reads_hlo_text_and_the_bound_of_a_loop_condition():
  """XLA's TPU compiler writes no known_trip_count: the condition's bound."""
  found = _check(_LOOP, num_microbatches=4, mesh=ABSTRACT_MESH)
  assert found.trip_counts == (4,) and found.outside == {"all-reduce": 1}
  traced = _LOOP.replace("constant(4)", "get-tuple-element(%p), index=2")
  with pytest.raises(AssertionError, match="no trip count known"):
    oa.check_train_step(traced, num_microbatches=4)
  assert oa.check_train_step(traced, num_microbatches=None).trip_counts == (
      None,)


_FUSED_CONDITION = """\
%fused_compare (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %bound = s32[] constant(4)
  ROOT %lt = pred[] compare(%param_0, %bound), direction=LT
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}
"""


def test_reads_the_bound_of_a_condition_fused_with_its_compare():
  """XLA's GPU compiler fuses the compare with its constant bound."""
  fused = _FUSED_CONDITION + _LOOP.split("}\n\n", 1)[1]
  found = _check(fused, num_microbatches=4, mesh=ABSTRACT_MESH)
  assert found.trip_counts == (4,)
  with pytest.raises(AssertionError, match="no trip count known"):
    oa.check_train_step(fused.replace("constant(4)", "parameter(1)"),
                        num_microbatches=4)


_MICRO_STEP = """\
%emit (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add, \
metadata={op_name="jit(step)/cond/branch_1_fun/optax_accum_emit/psum"}
}

%skip (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"2"}}
  ROOT %c = f32[8]{0} conditional(%p, %x, %x), \
branch_computations={%skip, %emit}
}"""


def test_a_micro_step_reduces_only_in_its_emitting_branch():
  """Read off the op_name metadata: a reduction in the loop of a micro-step
  (a deferred oa.value_and_grad's), outside that branch, runs every call."""
  found = _check(_MICRO_STEP, num_microbatches=2, mesh=ABSTRACT_MESH)
  assert found.accumulate_step and found.trip_counts == (2,)
  assert found.in_emitting_branch == {"all-reduce": 1}
  in_loop = _MICRO_STEP.replace(
      "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)",
      "  %g = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add\n"
      "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %g)")
  assert in_loop != _MICRO_STEP
  with pytest.raises(AssertionError, match=r"1 all-reduce .* outside oa\."):
    _check(in_loop, num_microbatches=2, mesh=ABSTRACT_MESH)


_TYPED_FIX = "oa.value_and_grad(..., gradient_sync='deferred')"
_MANUAL_FIX = "oa.device_local(params, axis_name)"


@pytest.mark.parametrize("op_name, axis_type, named, unnamed", [
    # Under jax.jit with Explicit axes: the typed form's arguments.
    ("jit(step)/cond/branch_1_fun/optax_accum_emit/psum", AxisType.Explicit,
     (_TYPED_FIX,), (_MANUAL_FIX,)),
    # The same branch inside a shard_map (on an Explicit mesh too): the
    # recipe's oa.device_local.
    ("jit(step)/shard_map/cond/branch_1_fun/optax_accum_emit/psum",
     AxisType.Explicit, (_MANUAL_FIX,), (_TYPED_FIX,)),
    # Our own shard_map inside the branch (ZeRO's reduce-scatter) is no
    # user's shard_map.
    ("jit(step)/cond/branch_1_fun/optax_accum_emit/shard_map/psum",
     AxisType.Explicit, (_TYPED_FIX,), (_MANUAL_FIX,)),
    # Auto axes and no shard_map: the program does not tell; both named.
    ("jit(step)/cond/branch_1_fun/optax_accum_emit/psum", AxisType.Auto,
     (_TYPED_FIX, _MANUAL_FIX), ()),
])
def test_a_micro_steps_fix_is_that_of_its_form(op_name, axis_type, named,
                                               unnamed):
  in_loop = _MICRO_STEP.replace(
      "jit(step)/cond/branch_1_fun/optax_accum_emit/psum", op_name).replace(
          "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)",
          "  %g = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add\n"
          "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %g)")
  mesh = jax.sharding.AbstractMesh((N,), ("data",), axis_types=(axis_type,))
  with pytest.raises(AssertionError, match="outside oa") as raised:
    _check(in_loop, num_microbatches=2, mesh=mesh)
  assert all(fix in str(raised.value) for fix in named)
  assert not any(fix in str(raised.value) for fix in unnamed)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"data_axes": "data"}, ValueError, "pass mesh=mesh"),
    ({"params": PARAMS}, ValueError, "pass mesh=mesh"),
    ({"data_axes": "model", "mesh": ABSTRACT_MESH}, ValueError,
     r"names \['model'\], not an axis"),
    ({"data_axes": ("data", 1), "mesh": ABSTRACT_MESH}, TypeError,
     "data_axes"),
    ({"gradient_sync": "deferred"}, ValueError, "gradient_sync must be"),
    ({"num_microbatches": 0}, ValueError, "num_microbatches must be"),
])
def test_refuses_arguments_naming_them(kwargs, error, message):
  with pytest.raises(error, match=message):
    oa.check_train_step(_LOOP, **{"num_microbatches": 4, **kwargs})


def _scanned_layers_loss(params, x):
  """A model that scans its 2 layers (a stacked weight), as decoders do."""
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x @ params["w"],
                      params["layers"])
  return jnp.mean((h @ params["v"]) ** 2)


def _layered_step(step):
  params = {**PARAMS, "layers": jnp.ones((2, 2, 2))}
  f = jax.shard_map(step, mesh=_mesh(), in_specs=(P(), P("data")),
                    out_specs=P(), check_vma=False)
  return jax.jit(f).lower(params, BATCH).compile()


def test_a_models_own_loop_is_not_read_as_the_micro_batch_loop():
  # The full batch at once, its model scanning its layers: no loop of ours.
  full = _layered_step(lambda p, x: jax.lax.pmean(
      jax.grad(_scanned_layers_loss)(p, x), "data"))
  with pytest.raises(AssertionError, match=(
      "no micro-batch loop of optax_accum found, nor a loop that runs 4"
      " times")) as raised:
    _check(full, num_microbatches=K)
  assert "runs 2 times" not in str(raised.value)
  # Ours around the same model: its loop is found, the model's is not.
  ours = _layered_step(oa.value_and_grad(
      _scanned_layers_loss, num_microbatches=K, axis_name="data",
      equal_weights=True))
  assert _check(ours, num_microbatches=K).trip_counts == (K,)

  def by_hand(params, x):  # a hand-written accumulation loop of K trips.
    def body(total, mb):
      grads = jax.grad(_scanned_layers_loss)(params, mb)
      return jax.tree.map(jnp.add, total, grads), None
    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params),
                            x.reshape(K, -1, x.shape[-1]))
    return jax.lax.pmean(jax.tree.map(lambda g: g / K, total), "data")

  assert _check(_layered_step(by_hand), num_microbatches=K).trip_counts == (
      K,)
