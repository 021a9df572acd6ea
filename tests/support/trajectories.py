"""Full-batch training and its accumulated counterparts, for trajectory tests.

The data (token counts that differ between micro-batches), the inner
optimizer (clipping, a schedule, weight decay), the full-batch reference
and the helpers that compare parameter trajectories: shared by
test_trajectory.py and test_accumulate_loops.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import helpers

SEQ, DIM, HIDDEN = 5, 3, 4
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 4
NUM_UPDATES = 5
CLIP = 2.0
WEIGHT_DECAY = 0.1
RTOL, ATOL = 1e-5, 1e-6


def schedule(count):
  return 0.05 * 0.7 ** count.astype(jnp.float32)


def inner_optimizer(schedule=schedule):
  return optax.chain(
      optax.clip_by_global_norm(CLIP),
      optax.adamw(schedule, eps=1e-3, weight_decay=WEIGHT_DECAY),
  )


def initial_params():
  return helpers.mlp_params(DIM, HIDDEN, seed=0)


token_losses = helpers.mlp_token_losses
num_tokens = helpers.num_tokens


def mean_loss(params, batch):
  return helpers.safe_mean(token_losses(params, batch), batch)


def sum_loss(params, batch):
  return token_losses(params, batch).sum()


LOSSES = {"mean": mean_loss, "sum": sum_loss}


def make_batches(num_microbatches_per_update):
  """One batch per update; token counts differ between its micro-batches."""
  rng = np.random.default_rng(42)
  batches = []
  for k in num_microbatches_per_update:
    rows = k * MICRO_BATCH_SIZE
    lengths = rng.integers(0, SEQ + 1, size=rows)
    lengths[rng.integers(rows)] = SEQ  # no update without tokens
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    batches.append({
        "x": jnp.asarray(rng.normal(size=(rows, SEQ, DIM)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, SEQ)) + 1.0, jnp.float32),
        "mask": jnp.asarray(mask, jnp.float32),
    })
  return batches


def micro_batches_of(batch):
  return helpers.split(batch, len(batch["mask"]) // MICRO_BATCH_SIZE)


BATCHES = make_batches([NUM_MICROBATCHES] * NUM_UPDATES)
WARMUP_BATCHES = make_batches([2, 2, 4, 4, 4])


def warmup_every_k(count):
  return jnp.where(count < 2, 2, 4)


# --------------------------------------------------------------------------
# Reference: the inner optimizer on the full batch's token-weighted gradient.


@functools.cache
def full_batch_step(schedule_per_micro_step=False):
  """A jitted full-batch update; the gradient is multiplied by ``scale``."""
  if schedule_per_micro_step:
    inner = inner_optimizer(lambda count: schedule(NUM_MICROBATCHES * count))
  else:
    inner = inner_optimizer()

  @jax.jit
  def step(params, opt_state, batch, scale):
    grads = jax.grad(mean_loss)(params, batch)
    grads = jax.tree.map(lambda g: scale * g, grads)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  return inner, step


def full_batch_trajectory(
    batches, schedule_per_micro_step=False, grad_scale=None
):
  """Params after each update; ``grad_scale(batch)`` rescales each gradient."""
  inner, step = full_batch_step(schedule_per_micro_step)
  params, opt_state = initial_params(), inner.init(initial_params())
  trajectory, grad_norms = [], []
  for batch in batches:
    scale = jnp.float32(1.0 if grad_scale is None else grad_scale(batch))
    params, opt_state, grads = step(params, opt_state, batch, scale)
    trajectory.append(params)
    grad_norms.append(float(optax.tree.norm(grads)))
  return trajectory, grad_norms


@functools.cache
def reference(warmup=False):
  return full_batch_trajectory(WARMUP_BATCHES if warmup else BATCHES)


def micro_step_trajectory(tx, batches, loss_reduction="mean"):
  """Feeds ``tx`` a micro-batch gradient per call; params after each update."""

  @jax.jit
  def micro_step(params, opt_state, micro_batch):
    grads = jax.grad(LOSSES[loss_reduction])(params, micro_batch)
    updates, opt_state = tx.update(
        grads, opt_state, params, num_tokens=num_tokens(micro_batch)
    )
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = initial_params(), tx.init(initial_params())
  trajectory, states = [], []
  for batch in batches:
    for micro_batch in micro_batches_of(batch):
      params, opt_state = micro_step(params, opt_state, micro_batch)
    trajectory.append(params)
    states.append(opt_state)
  return trajectory, states


def assert_same_trajectory(trajectory, expected):
  assert len(trajectory) == len(expected)
  for step, (params, expected_params) in enumerate(zip(trajectory, expected)):
    try:
      helpers.assert_trees_close(params, expected_params, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
      raise AssertionError(f"params differ after update {step + 1}") from e


def differs(trajectory, expected):
  try:
    assert_same_trajectory(trajectory, expected)
  except AssertionError:
    return True
  return False


def inner_counts(inner_state):
  """The step counts of adam and of the learning-rate schedule."""
  is_counted = lambda s: isinstance(
      s, (optax.ScaleByAdamState, optax.ScaleByScheduleState)
  )
  return [
      int(s.count)
      for s in jax.tree.leaves(inner_state, is_leaf=is_counted)
      if is_counted(s)
  ]
