"""Checkpointing: the accumulation state is arrays only and resumes mid-cycle.

Training is interrupted in the middle of an accumulation cycle, when the
running gradient sum and token count hold work that no parameter update has
seen yet; the parameters and the optimizer state go through an orbax-checkpoint
save and restore, and training resumed from the restored trees must match the
uninterrupted run bit for bit.
"""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import helpers
import optax_accum as oa

SEQ, DIM = 4, 3
EVERY_K = 3
NUM_MICRO_STEPS = 14  # four updates and two micro-steps of a fifth cycle
INTERRUPT_AFTER = 5  # one update done, two micro-steps into the second cycle


def _tx():
  schedule = optax.linear_schedule(0.1, 0.01, transition_steps=4)
  return oa.accumulate(
      optax.chain(
          optax.clip_by_global_norm(1.0),
          optax.adamw(schedule, weight_decay=0.1),
      ),
      EVERY_K,
  )


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, DIM), "b": jnp.float32(0.5)}


def _micro_batches():
  rng = np.random.default_rng(0)
  micro_batches = []
  for _ in range(NUM_MICRO_STEPS):
    lengths = rng.integers(0, SEQ + 1, size=2)
    micro_batch = helpers.padded_batch(rng, lengths, SEQ, DIM)
    micro_batches.append(jax.tree.map(jnp.asarray, micro_batch))
  return micro_batches


def _loss(params, batch):
  return helpers.safe_mean(helpers.linear_token_losses(params, batch), batch)


def _make_step(tx):
  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, opt_state = tx.update(
        grads, opt_state, params, num_tokens=batch["mask"].sum()
    )
    return optax.apply_updates(params, updates), opt_state

  return step


def _save_and_restore(path, tree, abstract_tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(path, abstract_tree)


@pytest.mark.slow
def test_state_is_a_pytree_of_arrays():
  # Eagerly: under jit every output would be an array anyway.
  tx, params = _tx(), _params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  states = [state]
  for _ in range(EVERY_K + 1):
    _, state = tx.update(grads, state, params, num_tokens=jnp.float32(2))
    states.append(state)
  for state in states:
    assert isinstance(state, oa.AccumulateState)
    leaves = jax.tree.leaves(state)
    assert leaves
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
      assert isinstance(leaf, jax.Array), (jax.tree_util.keystr(path), leaf)
    assert state.micro_step.dtype == jnp.int32
    assert state.count.dtype == jnp.int32
    assert state.token_count.dtype == jnp.float32
  # Structure and dtypes never change, so the state round-trips through a
  # checkpoint restored against an abstract target built from scratch.
  for state in states:
    chex.assert_trees_all_equal_shapes_and_dtypes(state, states[0])


@pytest.mark.slow
def test_resume_mid_cycle_matches_uninterrupted_run_bit_for_bit(tmp_path):
  tx = _tx()
  step = _make_step(tx)
  micro_batches = _micro_batches()

  # The uninterrupted run, keeping every intermediate (params, opt_state).
  params, opt_state = _params(), tx.init(_params())
  uninterrupted = []
  for batch in micro_batches:
    params, opt_state = step(params, opt_state, batch)
    uninterrupted.append((params, opt_state))

  saved = uninterrupted[INTERRUPT_AFTER - 1]
  saved_state = saved[1]
  # Mid-cycle: sums that no update has seen yet are part of what is saved.
  assert int(saved_state.micro_step) == INTERRUPT_AFTER % EVERY_K != 0
  assert int(saved_state.count) == INTERRUPT_AFTER // EVERY_K
  assert float(saved_state.token_count) > 0
  assert any(np.any(np.asarray(g) != 0)
             for g in jax.tree.leaves(saved_state.grad_sum))

  # A fresh process would know only the shapes: build the target from scratch.
  # The documented calls (docs/zero.md) pass a state without a mesh as is.
  abstract = jax.eval_shape(lambda: (_params(), _tx().init(_params())))
  restored = oa.restored_state(_save_and_restore(
      tmp_path / "mid_cycle", oa.checkpointable_state(saved),
      oa.checkpointable_state(abstract)), abstract)
  assert isinstance(restored[1], oa.AccumulateState)
  helpers.assert_trees_equal(restored, saved)

  params, opt_state = restored
  for i in range(INTERRUPT_AFTER, NUM_MICRO_STEPS):
    params, opt_state = step(params, opt_state, micro_batches[i])
    helpers.assert_trees_equal((params, opt_state), uninterrupted[i])
  assert int(opt_state.count) == NUM_MICRO_STEPS // EVERY_K

  # Restarting the cycle (keeping only params and the inner optimizer's state)
  # loses the saved micro-steps: the run then ends elsewhere.
  params, opt_state = restored
  opt_state = tx.init(params)._replace(
      inner_state=opt_state.inner_state, count=opt_state.count
  )
  for i in range(INTERRUPT_AFTER, NUM_MICRO_STEPS):
    params, opt_state = step(params, opt_state, micro_batches[i])
  assert not np.array_equal(
      np.asarray(params["w"]), np.asarray(uninterrupted[-1][0]["w"])
  )


def _sharded_nnx(mesh):
  """An NNX model whose kernel is split over "model", and its optimizer."""
  model = nnx.Linear(3, 8, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
      nnx.initializers.lecun_normal(), (None, "model")))
  return model, nnx.Optimizer(model, oa.accumulate(optax.adam(0.1), EVERY_K),
                              wrt=nnx.Param)


def _target(state):
  """docs/flax.md's target: a fresh model's shapes and real shardings."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=x.sharding), state)


@pytest.mark.slow
def test_sharded_nnx_model_restores_mid_cycle_under_an_explicit_mesh(
    tmp_path):
  """docs/flax.md's sharded restore (issue 28), against the naive target."""
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)

  @nnx.jit
  def micro_step(model, optimizer, mb):
    grads = nnx.grad(lambda m: jnp.mean((m(mb["x"]) - mb["y"]) ** 2))(model)
    optimizer.update(model, grads, num_tokens=jnp.float32(8))

  rng = np.random.default_rng(0)
  mbs = [{"x": rng.normal(size=(8, 3)), "y": rng.normal(size=(8, 8))}
         for _ in range(2 * EVERY_K)]
  with jax.set_mesh(mesh):
    model, optimizer = _sharded_nnx(mesh)
    for mb in mbs[:EVERY_K + 1]:  # one update, one micro-step more
      micro_step(model, optimizer, mb)
    saved = nnx.state((model, optimizer))
    abstract = nnx.state(nnx.eval_shape(lambda: _sharded_nnx(mesh)))
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", saved)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(
          tmp_path / "ckpt", _target(nnx.state(_sharded_nnx(mesh))))
    # eval_shape's AbstractMesh shardings are what orbax refuses (older
    # flax gives none).
    if all(x.sharding is not None for x in jax.tree.leaves(abstract)):
      with pytest.raises(ValueError, match="AbstractMesh"):
        ocp.StandardCheckpointer().restore(tmp_path / "ckpt", abstract)
    helpers.assert_trees_equal(restored, saved)
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
        lambda x: x.sharding, saved)

    resumed, resumed_optimizer = _sharded_nnx(mesh)
    nnx.update((resumed, resumed_optimizer), restored)
    assert int(oa.find_accumulate_state(
        resumed_optimizer.opt_state).micro_step) == 1
    for mb in mbs[EVERY_K + 1:]:
      micro_step(model, optimizer, mb)
      micro_step(resumed, resumed_optimizer, mb)
    helpers.assert_trees_equal(nnx.state(resumed), nnx.state(model))
    assert bool(oa.has_updated(resumed_optimizer))


def test_a_checkpoint_saved_before_tokens_seen_restores_as_docs_say(tmp_path):
  """docs/migrating.md: the old structure, then the fields of a new state."""
  tx = _tx()
  step = _make_step(tx)
  params, state = _params(), tx.init(_params())
  for batch in _micro_batches()[:INTERRUPT_AFTER]:
    params, state = step(params, state, batch)
  assert float(oa.tokens_seen(state)) > 0
  new_fields = ("tokens_seen", "tokens_seen_error")
  old = {k: v for k, v in state._asdict().items() if k not in new_fields}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old", old)
    checkpointer.wait_until_finished()
    # The new structure does not fit the old checkpoint.
    with pytest.raises(ValueError):
      checkpointer.restore(tmp_path / "old", jax.eval_shape(tx.init, params))

    target = jax.eval_shape(tx.init, params)._asdict()
    del target["tokens_seen"], target["tokens_seen_error"]
    restored = checkpointer.restore(tmp_path / "old", target)
  restored = tx.init(params)._replace(**restored)
  helpers.assert_trees_equal(
      restored, state._replace(tokens_seen=jnp.float32(0),
                               tokens_seen_error=jnp.float32(0)))
  assert float(oa.tokens_seen(restored)) == 0
