"""``oa.accumulate`` without ``axis_name`` on unreduced gradients under jit.

The loop of PyTorch DDP's ``no_sync`` written for ``jax.jit`` with Explicit
axes: ``oa.value_and_grad(..., gradient_sync="deferred")`` per jit call, its
gradient typed unreduced over the data axes, and ``oa.accumulate`` built with
no ``axis_name`` at all (its types say over which axes). Every result is
compared with the full batch on uneven token counts; the compiled micro-step
must hold its gradient-sized reduction in the emitting branch only.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax
import orbax.checkpoint as ocp
import pytest

import helpers
import optax_accum as oa

N = 8  # simulated devices (tests/conftest.py).
K = 4  # micro-steps (jit calls) per update.
ROWS, SEQ, DIM, HIDDEN = 16, 4, 3, 8  # rows per micro-step, over N devices.


def _params():
  return helpers.mlp_params(DIM, HIDDEN, seed=1)


def _micro_batches(num=K, seed=0):
  return helpers.uneven_micro_batches(num, seed, ROWS, SEQ, DIM, N)


_loss = helpers.mlp_mean_loss


def _tp_loss(params, batch):
  """``_loss`` written for a tensor axis: its dots name their outputs."""
  h = jnp.einsum("rsd,dh->rsh", batch["x"], params["w1"],
                 out_sharding=P("data", None, "tensor"))
  h = jnp.tanh(h + jax.lax.broadcast_in_dim(
      params["b1"], h.shape, (2,), out_sharding=P("data", None, "tensor")))
  out = jnp.einsum("rsh,h->rs", h, params["w2"], out_sharding=P("data"))
  return helpers.safe_mean(batch["mask"] * (out - batch["y"]) ** 2, batch)


def _concat(batches):
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)


def _full_batch_grad(batches):
  return jax.grad(_loss)(_params(), _concat(batches))


def _mesh(shape=(N,), names=("data",)):
  return jax.make_mesh(shape, names,
                       axis_types=(AxisType.Explicit,) * len(shape))


def _grad_fn(axis_name=None, loss=_loss):
  return oa.value_and_grad(
      loss, num_microbatches=1, num_tokens_fn=helpers.num_tokens,
      axis_name=axis_name, gradient_sync="deferred")


def _micro_step(tx, grad_fn=None, **update_kwargs):
  grad_fn = grad_fn or _grad_fn()

  @jax.jit
  def micro_step(params, state, batch, **kwargs):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch),
                               **update_kwargs, **kwargs)
    return updates, state, loss

  return micro_step


def _jax_grad_step(tx):
  """The naive micro-step: jax.grad, which JAX reduces in the call."""

  @jax.jit
  def micro_step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    return tx.update(grads, state, params,
                     num_tokens=helpers.num_tokens(batch))

  return micro_step


def _run(micro_step, params, state, batches):
  for batch in batches:
    updates, state, _ = micro_step(params, state, batch)
  return updates, state


def _neg(tree):
  return jax.tree.map(jnp.negative, tree)


@pytest.mark.slow
def test_reduces_once_per_update_exactly_without_axis_name():
  batches = _micro_batches()
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)
  micro_step = _micro_step(tx)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data")) for b in batches]
    state = tx.init(params)
    updates, state = _run(micro_step, params, state, sharded[:1])
    # From the first call on, the sum is typed like the gradient.
    assert jax.typeof(state.grad_sum["w1"]).sharding.spec.unreduced == {
        "data"}
    assert not bool(oa.has_updated(state))
    compiled = micro_step.lower(params, state, sharded[1]).compile()
    updates, state = _run(micro_step, params, state, sharded[1:])
    assert bool(oa.has_updated(state))
    assert float(oa.tokens_seen(state)) == float(
        sum(helpers.num_tokens(b) for b in batches))
  helpers.assert_trees_close(updates, _neg(_full_batch_grad(batches)),
                             rtol=1e-5, atol=1e-6)
  counts = oa.count_collectives(compiled, include_scalars=False)
  # The gradient's reduction sits in the emitting branch alone.
  assert counts.outside == {}, counts
  assert counts.in_branch.get("all-reduce", 0) >= 1, counts


def test_naive_loop_reduces_every_call():
  """Negative control: jax.grad under jit reduces the gradient each call."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)

  micro_step = _jax_grad_step(tx)

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_micro_batches(1)[0], P("data"))
    compiled = micro_step.lower(params, tx.init(params), batch).compile()
  counts = oa.count_collectives(compiled, include_scalars=False)
  assert counts.outside.get("all-reduce", 0) >= 1, counts


@pytest.mark.slow
def test_adamw_schedule_clipping_trajectory_matches_full_batch():
  """Two updates of a clipped adamw with a schedule, as on the full batch."""
  batches = _micro_batches(2 * K, seed=3)

  def inner():
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=4)
    return optax.chain(optax.clip_by_global_norm(0.5),
                       optax.adamw(schedule, weight_decay=0.1))

  tx = oa.accumulate(inner(), every_k=K)

  @jax.jit
  def micro_step(params, state, batch):
    _, grads = _grad_fn()(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch))
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    for b in batches:
      params, state = micro_step(params, state, jax.device_put(b, P("data")))
    assert int(state.count) == 2
  ref_tx, ref = inner(), _params()
  ref_state = ref_tx.init(ref)
  for i in range(2):
    g = jax.grad(_loss)(ref, _concat(batches[i * K:(i + 1) * K]))
    u, ref_state = ref_tx.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, u)
  helpers.assert_trees_close(params, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_emit_partial_window_and_empty_micro_step():
  batches = _micro_batches(3, seed=5)
  empty = jax.tree.map(jnp.zeros_like, batches[1])  # no token at all.
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)
  step, emit_step = _micro_step(tx), _micro_step(tx, emit=True)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    for b in (batches[0], empty):
      _, state, _ = step(params, state, jax.device_put(b, P("data")))
    updates, state, _ = emit_step(params, state,
                                  jax.device_put(batches[2], P("data")))
    assert bool(oa.has_updated(state)) and int(state.micro_step) == 0
    # The next cycle starts from zeros: one micro-step, emitted at once.
    again, state, _ = emit_step(params, state,
                                jax.device_put(batches[0], P("data")))
    # A flush of a cycle without tokens: no update, no NaN.
    flushed, state = jax.jit(lambda p, s: tx.update(
        jax.tree.map(jnp.zeros_like, p), s, p, num_tokens=0, emit=True))(
            params, state)
    assert not bool(oa.has_updated(state))
  helpers.assert_trees_close(
      updates, _neg(_full_batch_grad([batches[0], batches[2]])),
      rtol=1e-5, atol=1e-6)
  helpers.assert_trees_close(again, _neg(_full_batch_grad([batches[0]])),
                             rtol=1e-5, atol=1e-6)
  helpers.assert_trees_equal(flushed, jax.tree.map(jnp.zeros_like, flushed))


@pytest.mark.slow
def test_skip_nonfinite_is_one_global_decision():
  batches = _micro_batches()
  bad = dict(batches[2])
  # One token's input is NaN, on one device only: the whole micro-step goes.
  bad["x"] = bad["x"].at[ROWS - 1, 0, 0].set(jnp.nan)
  bad["mask"] = bad["mask"].at[ROWS - 1, 0].set(1.0)
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, skip_nonfinite=True)
  micro_step = _micro_step(tx)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    sharded = [jax.device_put(b, P("data"))
               for b in (batches[0], batches[1], bad, batches[3])]
    updates, state = _run(micro_step, params, tx.init(params), sharded)
    assert int(state.nonfinite_count) == 1
  expected = _full_batch_grad([batches[0], batches[1], batches[3]])
  helpers.assert_trees_close(updates, _neg(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["hsdp", "data_tensor"])
@pytest.mark.slow
def test_hsdp_and_data_tensor_meshes(layout):
  batches = _micro_batches()
  if layout == "hsdp":
    names = ("replica", "fsdp")
    data, specs = names, {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P()}
  else:
    names = ("data", "tensor")
    data, specs = "data", {"w1": P(None, "tensor"), "b1": P("tensor"),
                           "w2": P("tensor")}
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)
  micro_step = _micro_step(tx, _grad_fn(
      loss=_loss if layout == "hsdp" else _tp_loss))
  mesh = _mesh((2, 4), names)
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), specs)
    sharded = [jax.device_put(b, P(data)) for b in batches]
    state = tx.init(params)
    assert state.grad_sum["w1"].sharding.spec == specs["w1"]
    _, state = _run(micro_step, params, state, sharded[:1])
    compiled = micro_step.lower(params, state, sharded[1]).compile()
    updates, state = _run(micro_step, params, state, sharded[1:])
  helpers.assert_trees_close(updates, _neg(_full_batch_grad(batches)),
                             rtol=1e-5, atol=1e-6)
  for name, spec in specs.items():
    assert updates[name].sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, spec), updates[name].ndim), name
  counts = oa.count_collectives(compiled, mesh=mesh, include_scalars=False)
  for axes_, c in counts.by_axes.items():
    if "replica" in axes_ or "data" in axes_:
      # Replica and data reductions: in the emitting branch only.
      assert not c.outside, (axes_, counts)


@pytest.mark.slow
def test_axis_name_is_checked_against_the_types():
  """Given too, axis_name must name the axes the gradients are unreduced
  over (a state built with it keeps slots), or our error names it."""
  batch = _micro_batches(1)[0]
  tx = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="data")
  wrong = oa.accumulate(optax.sgd(1.0), every_k=K, axis_name="tensor")
  with jax.set_mesh(_mesh((4, 2), ("data", "tensor"))):
    params = jax.device_put(_params(), P())
    sharded = jax.device_put(batch, P("data"))
    _micro_step(tx)(params, tx.init(params), sharded)
    with pytest.raises(ValueError, match=r"axis_name='tensor'"):
      _micro_step(wrong)(params, wrong.init(params), sharded)


def test_replicated_gradients_still_work_without_axis_name():
  """The SINGLE form is unchanged: reduced gradients, no slots."""
  batches = _micro_batches()
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)

  micro_step = _jax_grad_step(tx)

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    for b in batches:
      updates, state = micro_step(params, state, jax.device_put(b, P("data")))
    assert not jax.typeof(state.grad_sum["w1"]).sharding.spec.unreduced
  # Each micro-step is a mean over its own tokens: weighted back exactly.
  helpers.assert_trees_close(updates, _neg(_full_batch_grad(batches)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hsdp", [False, True])
@pytest.mark.slow
def test_mid_cycle_checkpoint_restores_bit_for_bit(tmp_path, hsdp):
  batches = _micro_batches()
  tx = oa.accumulate(optax.adam(0.1), every_k=K)
  micro_step = _micro_step(tx)
  if hsdp:  # parameters sharded over "fsdp", the sum unreduced over both.
    mesh, data = _mesh((2, 4), ("replica", "fsdp")), ("replica", "fsdp")
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P()}
  else:
    mesh, data, specs = _mesh(), "data", P()
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), specs)
    sharded = [jax.device_put(b, P(data)) for b in batches]
    fresh = tx.init(params)
    _, state = _run(micro_step, params, fresh, sharded[:2])
    # Each device's partial sum in its own slot, mid-cycle: nothing moves.
    saved = oa.checkpointable_state(state)
    saved_specs = oa.state_partition_specs(saved)
    assert saved_specs.grad_sum["w1"] == (
        P("replica", None, "fsdp") if hsdp else P("data"))
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "state", saved)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(tmp_path / "state", jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=x.sharding), saved))
    helpers.assert_trees_equal(restored, saved)
    resumed = oa.restored_state(restored, fresh)
    resumed = _run(micro_step, params, resumed, sharded[2:])
    straight = _run(micro_step, params, state, sharded[2:])
    # Reduced at the save (one all-reduce), it resumes to float32 rounding.
    from_reduced, _ = _run(micro_step, params,
                           jax.jit(oa.reduced_state)(state), sharded[2:])
    helpers.assert_trees_equal(oa.checkpointable_state(resumed),
                               oa.checkpointable_state(straight))
  helpers.assert_trees_close(from_reduced, straight[0], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="checkpointable_state"):
    oa.state_partition_specs(state)
