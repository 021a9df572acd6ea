"""Checkpointing: the accumulation state is arrays only and resumes mid-cycle.

Training is interrupted in the middle of an accumulation cycle, when the
running gradient sum and token count hold work that no parameter update has
seen yet; the parameters and the optimizer state go through an orbax-checkpoint
save and restore, and training resumed from the restored trees must match the
uninterrupted run bit for bit.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

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
  abstract = jax.eval_shape(lambda: (_params(), _tx().init(_params())))
  restored = _save_and_restore(tmp_path / "mid_cycle", saved, abstract)
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
