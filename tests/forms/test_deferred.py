"""Deferred gradient sync: a jit call per micro-batch, one reduction per update.

``oa.value_and_grad(..., gradient_sync="deferred")`` returns each device's
partial gradient, typed unreduced over the data axes under jit, and
``oa.accumulate(axis_name=...)`` adds such partials across jit calls and
reduces them once, in its emitting branch (PyTorch DDP's ``no_sync`` loop).
Every result is compared with the full batch's gradient on uneven token
counts; the compiled micro-step must hold no gradient-sized collective
outside the emitting branch, which the naive loop (``jax.grad`` per call)
does hold.
"""

import re

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
from optax_accum._src.mesh import readers

pytestmark = pytest.mark.skipif(
    not hasattr(P(), "unreduced") or not hasattr(jax.sharding, "reshard"),
    reason="unreduced sharding types need jax >= 0.9.1",
)

N = 8  # simulated devices (tests/conftest.py).
K = 4  # micro-steps (jit calls) per update.
ROWS, SEQ, DIM, HIDDEN = 16, 4, 3, 8  # rows per micro-step, over N devices.


def _params():
  return helpers.mlp_params(DIM, HIDDEN, seed=1)


def _micro_batches(num=K, seed=0):
  return helpers.uneven_micro_batches(num, seed, ROWS, SEQ, DIM, N)


_loss = helpers.mlp_mean_loss


def _full_batch_grad(batches):
  whole = jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)
  return jax.grad(_loss)(_params(), whole)


def _mesh(shape=(N,), names=("data",), axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _grad_fn(axis_name="data", **kwargs):
  return oa.value_and_grad(
      _loss, num_microbatches=1, num_tokens_fn=helpers.num_tokens,
      axis_name=axis_name, gradient_sync="deferred", **kwargs)


def _micro_step(tx, grad_fn, **update_kwargs):
  @jax.jit
  def micro_step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch),
                               **update_kwargs)
    return updates, state, loss

  return micro_step


def _all_reduce_sizes(compiled):
  """The largest operand (in elements) of each all-reduce, sorted."""
  sizes = []
  for line in compiled.as_text().splitlines():
    match = re.search(r"=\s*(\(?[^=]*?\)?)\s*all-reduce(-start)?\(", line)
    if match:
      dims = re.findall(r"\[([0-9,]*)\]", match.group(1))
      sizes.append(max(
          (int(np.prod([int(d) for d in ds.split(",") if d]))
           for ds in dims), default=1))
  return sorted(sizes)


def _run(tx, micro_step, params, batches, state=None):
  state = tx.init(params) if state is None else state
  for batch in batches:
    updates, state, _ = micro_step(params, state, batch)
  return updates, state


def test_value_and_grad_deferred_is_unreduced_and_sums_to_the_gradient():
  batch = _micro_batches(1)[0]
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = jax.device_put(batch, P("data"))
    step = jax.jit(_grad_fn())
    compiled = step.lower(params, sharded).compile()
    loss, grads = compiled(params, sharded)
    for g in jax.tree.leaves(grads):
      assert jax.typeof(g).sharding.spec.unreduced == {"data"}
    reduced = jax.jit(lambda g: jax.tree.map(
        lambda x: jax.sharding.reshard(x, P()), g))(grads)
  expected_loss, expected = jax.value_and_grad(_loss)(_params(), batch)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(reduced, expected, rtol=1e-5, atol=1e-6)
  # Only scalars (the loss and the token count) are reduced in the call.
  assert _all_reduce_sizes(compiled) == [1]


def test_deferred_inside_shard_map_gives_device_local_partials():
  batch = _micro_batches(1)[0]
  fn = _grad_fn()

  def per_device(params, batch):
    loss, grads = fn(params, batch)
    return loss, jax.lax.psum(grads, "data")

  with jax.set_mesh(_mesh(axis_type=AxisType.Auto)):
    loss, grads = jax.jit(jax.shard_map(
        per_device, in_specs=(P(), P("data")), out_specs=(P(), P()),
    ))(_params(), batch)
  expected_loss, expected = jax.value_and_grad(_loss)(_params(), batch)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_accumulate_reduces_once_per_update_exactly():
  batches = _micro_batches()
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data")
  micro_step = _micro_step(tx, _grad_fn())
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data")) for b in batches]
    state = tx.init(params)
    compiled = micro_step.lower(params, state, sharded[0]).compile()
    updates, state = _run(tx, micro_step, params, sharded)
    emitted = bool(oa.has_updated(state))
  assert emitted
  expected = _full_batch_grad(batches)
  helpers.assert_trees_close(
      updates, jax.tree.map(jnp.negative, expected), rtol=1e-5, atol=1e-6)
  counts = oa.count_collectives(compiled)
  # Outside the emitting branch: the loss and token count, scalars only.
  assert counts.in_branch == {"all-reduce": 1}, counts
  assert counts.outside == {"all-reduce": 1}, counts
  # The one outside is a scalar's; the gradient's is in the branch.
  assert _all_reduce_sizes(compiled)[0] == 1


@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.parametrize("apply", ["update_and_apply", "tx.update"])
@pytest.mark.slow
def test_the_state_after_a_call_reduces_only_when_it_emits(apply, axis_name):
  """The program of every call after the first (the sum now typed
  unreduced, as the README's recipe has it, without axis_name): no
  gradient-sized collective outside the emitting branch. update_and_apply's
  emit in a loop of at most one trip had XLA all-reduce the unreduced sum
  before the loop, on every call."""
  tx = oa.accumulate(optax.adamw(1e-3), every_k=K, axis_name=axis_name)
  grad_fn = _grad_fn()

  @jax.jit
  def micro_step(params, state, batch):
    _, grads = grad_fn(params, batch)
    count = helpers.num_tokens(batch)
    if apply == "update_and_apply":
      return oa.update_and_apply(tx, grads, state, params, num_tokens=count)
    updates, state = tx.update(grads, state, params, num_tokens=count)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    params, state = micro_step(params, tx.init(params), batch)
    if axis_name is None:
      assert readers.unreduced_axes(state.grad_sum["w1"]) == {"data"}
    compiled = micro_step.lower(params, state, batch).compile()
  counts = oa.count_collectives(compiled, include_scalars=False)
  assert counts.in_branch == {"all-reduce": 1}, counts
  assert counts.outside == {} and counts.in_loop == {}, counts


def test_naive_loop_reduces_the_gradient_on_every_call():
  """Negative control: jax.grad under jit all-reduces it in every call."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)

  @jax.jit
  def micro_step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    return tx.update(grads, state, params,
                     num_tokens=helpers.num_tokens(batch))

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    compiled = micro_step.lower(params, tx.init(params), batch).compile()
  counts = oa.count_collectives(compiled)
  assert counts.outside.get("all-reduce", 0) >= 1
  assert _all_reduce_sizes(compiled)[-1] == DIM * HIDDEN


@pytest.mark.slow
def test_emit_and_should_skip_and_counts():
  batches = _micro_batches()
  # Micro-step 1 (the second) is skipped; the cycle ends early on step 2.
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data",
                     should_skip=lambda g, s, p: s.micro_step == 1)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data")) for b in batches[:3]]
    state = tx.init(params)
    step = _micro_step(tx, _grad_fn())
    emit_step = _micro_step(tx, _grad_fn(), emit=True)
    for batch in sharded[:2]:
      _, state, _ = step(params, state, batch)
    updates, state, _ = emit_step(params, state, sharded[2])
    assert bool(oa.has_updated(state))
    assert int(jnp.sum(state.skipped_count)) == 1
    assert float(jnp.sum(state.token_count)) == 0  # reset on emit.
  expected = _full_batch_grad([batches[0], batches[2]])
  helpers.assert_trees_close(
      updates, jax.tree.map(jnp.negative, expected), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_skip_nonfinite_is_a_global_decision():
  batches = _micro_batches()
  bad = dict(batches[2])
  # One token's input is NaN, on one device only: the whole micro-step goes.
  bad["x"] = bad["x"].at[ROWS - 1, 0, 0].set(jnp.nan)
  bad["mask"] = bad["mask"].at[ROWS - 1, 0].set(1.0)
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data",
                     skip_nonfinite=True)
  micro_step = _micro_step(tx, _grad_fn())
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data"))
               for b in (batches[0], batches[1], bad, batches[3])]
    state = tx.init(params)
    compiled = micro_step.lower(params, state, sharded[0]).compile()
    updates, state = _run(tx, micro_step, params, sharded)
    assert int(jnp.sum(state.nonfinite_count)) == 1
  expected = _full_batch_grad([batches[0], batches[1], batches[3]])
  helpers.assert_trees_close(
      updates, jax.tree.map(jnp.negative, expected), rtol=1e-5, atol=1e-6)
  # The loss and token count, and the non-finite flag: scalars.
  assert oa.count_collectives(compiled).outside == {"all-reduce": 2}


@pytest.mark.slow
def test_checkpoint_mid_cycle_resumes_exactly(tmp_path):
  batches = _micro_batches()
  tx = oa.accumulate(optax.adam(0.1), every_k=K, axis_name="data")
  micro_step = _micro_step(tx, _grad_fn())
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data")) for b in batches]
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    assert specs.grad_sum["w1"] == P("data")
    _, state = _run(tx, micro_step, params, sharded[:2], state)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "state", state)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(
          tmp_path / "state", jax.tree.map(jnp.zeros_like, state))
    resumed, _ = _run(tx, micro_step, params, sharded[2:], restored)
    straight, _ = _run(tx, micro_step, params, sharded[2:], state)
  helpers.assert_trees_equal(resumed, straight)


@pytest.mark.slow
def test_hsdp_reduce_scatters_each_call_and_reduces_replica_once():
  batches = _micro_batches()
  axis_name = ("replica", "fsdp")
  specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P()}
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name=axis_name)
  micro_step = _micro_step(tx, _grad_fn(axis_name))
  with jax.set_mesh(_mesh((2, 4), axis_name)):
    params = jax.device_put(_params(), specs)
    sharded = [jax.device_put(b, P(axis_name)) for b in batches]
    grads = jax.jit(_grad_fn(axis_name))(params, sharded[0])[1]
    assert jax.typeof(grads["w1"]).sharding.spec == P(
        None, "fsdp", unreduced={"replica"})
    assert jax.typeof(grads["w2"]).sharding.spec.unreduced == set(axis_name)
    state = tx.init(params)
    specs = oa.state_partition_specs(state, axis_name)
    assert specs.grad_sum["w1"] == P("replica", None, "fsdp")
    assert specs.grad_sum["w2"] == P(axis_name)
    compiled = micro_step.lower(params, state, sharded[0]).compile()
    updates, state = _run(tx, micro_step, params, sharded)
  expected = _full_batch_grad(batches)
  helpers.assert_trees_close(
      updates, jax.tree.map(jnp.negative, expected), rtol=1e-5, atol=1e-6)
  assert updates["w1"].sharding.spec == P(None, "fsdp")
  counts = oa.count_collectives(compiled, mesh=_mesh((2, 4), axis_name))
  # Over "fsdp", reduced each call (XLA on CPU may write the reduce-scatter
  # as an all-reduce and a slice); over "replica", once, when emitting.
  assert counts.by_axes[("fsdp",)].outside, counts
  assert counts.by_axes[("replica",)].in_branch.get("all-reduce", 0) >= 1, (
      counts)


def _refused(step, tx, match):
  """``step`` on one replicated-parameter micro-batch raises ``match``."""
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    with pytest.raises(ValueError, match=match):
      step(params, tx.init(params), batch)


def test_replicated_gradient_is_refused_not_counted_per_device():
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data")

  @jax.jit
  def micro_step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)  # already reduced: P().
    return tx.update(grads, state, params, num_tokens=1.0)

  _refused(micro_step, tx, r"not unreduced over \['data'\].*"
           r"gradient_sync='deferred'")


def test_unreduced_gradient_into_plain_optax_is_refused_by_jax():
  """We cannot intercept optax; JAX refuses at trace time, not silently."""
  tx = optax.sgd(1.0)

  @jax.jit
  def step(params, state, batch):
    _, grads = _grad_fn()(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    with pytest.raises(Exception, match="reduce"):
      step(params, tx.init(params), batch)


def test_should_skip_reading_unreduced_gradients_gets_our_hint():
  """JAX's own error, with our note on what should_skip can read."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data",
                     should_skip=lambda g, s, p: optax.tree.norm(g) > 1e3)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    with pytest.raises(Exception) as info:
      _micro_step(tx, _grad_fn())(params, tx.init(params), batch)
  notes = "\n".join(getattr(info.value, "__notes__", []))
  assert re.search(r"should_skip.*unreduced", notes), notes


def test_with_stats_is_refused_on_unreduced_gradients():
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data",
                     with_stats=True)
  step = _micro_step(tx, _grad_fn())
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    with pytest.raises(ValueError, match="with_stats"):
      step(params, tx.init(params), batch)


def test_bad_deferred_settings_name_gradient_sync():
  # On a multi-device mesh, a batch left unsharded gives nothing to defer
  # over: refused (on one device "deferred" is the plain gradient).
  no_axes = oa.value_and_grad(_loss, num_microbatches=1, equal_weights=True,
                              gradient_sync="deferred")
  with jax.set_mesh(_mesh()), pytest.raises(ValueError, match=(
      r"gradient_sync=.deferred.*has none.*axis_name")):
    jax.jit(no_axes)(_params(), _micro_batches(1)[0])
  with pytest.raises(ValueError, match="with_stats"):
    _grad_fn(with_stats=True)
  with jax.set_mesh(_mesh(axis_type=AxisType.Auto)):
    with pytest.raises(ValueError, match=r"gradient_sync=.deferred.*Explicit"):
      jax.jit(_grad_fn())(_params(), _micro_batches(1)[0])
