"""Trajectory tests: accumulated training follows full-batch training exactly.

The inner optimizer clips by global norm (active on some updates), follows a
learning-rate schedule that changes every update and decays weights. Whatever
path the gradients take, ``oa.accumulate`` fed one micro-batch gradient per
call, or ``oa.value_and_grad`` followed by the plain inner optimizer, the
parameters after each optimizer update must equal those of training on the
full batches, and the inner optimizer must have counted one step per update.
The shortcuts a wrong implementation could take (mean of micro-batch means,
clipping each micro-batch, a schedule advancing per micro-step, a wrongly
scaled mean) are run on the same data and shown to end up elsewhere.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa
import trajectories as tr


def test_reference_is_sensitive():
  """Clipping bites on some updates only, and every update has its own lr."""
  _, grad_norms = tr.reference()
  assert any(n > tr.CLIP for n in grad_norms), grad_norms
  assert any(n < tr.CLIP for n in grad_norms), grad_norms
  lrs = [float(tr.schedule(jnp.int32(t))) for t in range(tr.NUM_UPDATES)]
  assert len(set(lrs)) == tr.NUM_UPDATES
  tokens = [[float(tr.num_tokens(mb)) for mb in tr.micro_batches_of(b)]
            for b in tr.BATCHES]
  assert all(len(set(t)) > 1 for t in tokens), tokens


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_accumulate_matches_full_batch_training(loss_reduction):
  tx = oa.accumulate(tr.inner_optimizer(), tr.NUM_MICROBATCHES,
                     loss_reduction=loss_reduction)
  trajectory, states = tr.micro_step_trajectory(tx, tr.BATCHES, loss_reduction)
  expected, _ = tr.reference()
  tr.assert_same_trajectory(trajectory, expected)
  for update, state in enumerate(states, start=1):
    assert int(state.count) == update
    assert int(state.micro_step) == 0
    assert bool(oa.has_updated(state))
    assert tr.inner_counts(state.inner_state) == [update, update]


def test_value_and_grad_matches_full_batch_training():
  inner = tr.inner_optimizer()
  grad_fn = oa.value_and_grad(
      tr.mean_loss, num_microbatches=tr.NUM_MICROBATCHES,
      num_tokens_fn=tr.num_tokens
  )

  @jax.jit
  def step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = tr.initial_params(), inner.init(tr.initial_params())
  trajectory = []
  for batch in tr.BATCHES:
    params, opt_state = step(params, opt_state, batch)
    trajectory.append(params)
  expected, _ = tr.reference()
  tr.assert_same_trajectory(trajectory, expected)
  assert tr.inner_counts(opt_state) == [tr.NUM_UPDATES, tr.NUM_UPDATES]


@pytest.mark.slow
def test_batch_size_warmup_matches_full_batches_of_matching_sizes():
  tx = oa.accumulate(tr.inner_optimizer(), tr.warmup_every_k)
  trajectory, states = tr.micro_step_trajectory(tx, tr.WARMUP_BATCHES)
  expected, _ = tr.reference(warmup=True)
  tr.assert_same_trajectory(trajectory, expected)
  assert [int(s.count) for s in states] == [1, 2, 3, 4, 5]
  assert tr.inner_counts(states[-1].inner_state) == [tr.NUM_UPDATES] * 2
  # Reading the cycle length off the count after its increment (an
  # off-by-one) groups the same micro-batches into other updates.
  shifted, _ = tr.micro_step_trajectory(
      oa.accumulate(tr.inner_optimizer(),
                    lambda count: tr.warmup_every_k(count + 1)),
      tr.WARMUP_BATCHES,
  )
  assert tr.differs(shifted, expected)


@pytest.mark.slow
def test_naive_alternatives_leave_the_full_batch_trajectory():
  expected, _ = tr.reference()
  k = tr.NUM_MICROBATCHES

  def total_tokens(batch):
    return float(tr.num_tokens(batch))

  alternatives = {
      # Each micro-batch's mean weighs the same, whatever its token count.
      "mean of means": tr.micro_step_trajectory(
          optax.MultiSteps(
              tr.inner_optimizer(), k, use_grad_mean=True
          ).gradient_transformation(),
          tr.BATCHES,
      )[0],
      # Clipping (the first stage of inner) applied to every micro-batch.
      "clip per micro-batch": tr.micro_step_trajectory(
          optax.chain(
              optax.clip_by_global_norm(tr.CLIP),
              oa.accumulate(
                  optax.adamw(tr.schedule, eps=1e-3,
                              weight_decay=tr.WEIGHT_DECAY), k
              ),
          ),
          tr.BATCHES,
      )[0],
      # The schedule reads the micro-step count instead of the update count.
      "schedule per micro-step": tr.full_batch_trajectory(
          tr.BATCHES, schedule_per_micro_step=True
      )[0],
      # sum_i n_i g_i divided by k, or not divided, instead of by sum_i n_i.
      "divide by k": tr.full_batch_trajectory(
          tr.BATCHES, grad_scale=lambda b: total_tokens(b) / k
      )[0],
      "no division": tr.full_batch_trajectory(
          tr.BATCHES, grad_scale=total_tokens
      )[0],
  }
  for name, trajectory in alternatives.items():
    assert tr.differs(trajectory, expected), name
