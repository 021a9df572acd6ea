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

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

SEQ, DIM, HIDDEN = 5, 3, 4
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 4
NUM_UPDATES = 5
CLIP = 2.0
WEIGHT_DECAY = 0.1
RTOL, ATOL = 1e-5, 1e-6


def _schedule(count):
  return 0.05 * 0.7 ** count.astype(jnp.float32)


def _inner(schedule=_schedule):
  return optax.chain(
      optax.clip_by_global_norm(CLIP),
      optax.adamw(schedule, eps=1e-3, weight_decay=WEIGHT_DECAY),
  )


def _params():
  return helpers.mlp_params(DIM, HIDDEN, seed=0)


_token_losses = helpers.mlp_token_losses
_num_tokens = helpers.num_tokens


def _mean_loss(params, batch):
  return helpers.safe_mean(_token_losses(params, batch), batch)


def _sum_loss(params, batch):
  return _token_losses(params, batch).sum()


_LOSSES = {"mean": _mean_loss, "sum": _sum_loss}
_grad = {name: jax.jit(jax.grad(fn)) for name, fn in _LOSSES.items()}


def _batches(num_microbatches_per_update):
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


def _micro_batches(batch):
  return helpers.split(batch, len(batch["mask"]) // MICRO_BATCH_SIZE)


_BATCHES = _batches([NUM_MICROBATCHES] * NUM_UPDATES)
_WARMUP_BATCHES = _batches([2, 2, 4, 4, 4])


def _warmup(count):
  return jnp.where(count < 2, 2, 4)


# --------------------------------------------------------------------------
# Reference: the inner optimizer on the full batch's token-weighted gradient.


@functools.cache
def _full_batch_step(schedule_per_micro_step=False):
  """A jitted full-batch update; the gradient is multiplied by ``scale``."""
  if schedule_per_micro_step:
    inner = _inner(lambda count: _schedule(NUM_MICROBATCHES * count))
  else:
    inner = _inner()

  @jax.jit
  def step(params, opt_state, batch, scale):
    grads = jax.grad(_mean_loss)(params, batch)
    grads = jax.tree.map(lambda g: scale * g, grads)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  return inner, step


def _full_batch_trajectory(
    batches, schedule_per_micro_step=False, grad_scale=None
):
  """Params after each update; ``grad_scale(batch)`` rescales each gradient."""
  inner, step = _full_batch_step(schedule_per_micro_step)
  params, opt_state = _params(), inner.init(_params())
  trajectory, grad_norms = [], []
  for batch in batches:
    scale = jnp.float32(1.0 if grad_scale is None else grad_scale(batch))
    params, opt_state, grads = step(params, opt_state, batch, scale)
    trajectory.append(params)
    grad_norms.append(float(optax.tree.norm(grads)))
  return trajectory, grad_norms


@functools.cache
def _reference(warmup=False):
  return _full_batch_trajectory(_WARMUP_BATCHES if warmup else _BATCHES)


def _micro_step_trajectory(tx, batches, loss_reduction="mean"):
  """Feeds ``tx`` a micro-batch gradient per call; params after each update."""

  @jax.jit
  def micro_step(params, opt_state, micro_batch):
    grads = jax.grad(_LOSSES[loss_reduction])(params, micro_batch)
    updates, opt_state = tx.update(
        grads, opt_state, params, num_tokens=_num_tokens(micro_batch)
    )
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = _params(), tx.init(_params())
  trajectory, states = [], []
  for batch in batches:
    for micro_batch in _micro_batches(batch):
      params, opt_state = micro_step(params, opt_state, micro_batch)
    trajectory.append(params)
    states.append(opt_state)
  return trajectory, states


def _assert_same_trajectory(trajectory, expected):
  assert len(trajectory) == len(expected)
  for step, (params, expected_params) in enumerate(zip(trajectory, expected)):
    try:
      helpers.assert_trees_close(params, expected_params, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
      raise AssertionError(f"params differ after update {step + 1}") from e


def _differs(trajectory, expected):
  try:
    _assert_same_trajectory(trajectory, expected)
  except AssertionError:
    return True
  return False


def _inner_counts(inner_state):
  """The step counts of adam and of the learning-rate schedule."""
  is_counted = lambda s: isinstance(
      s, (optax.ScaleByAdamState, optax.ScaleByScheduleState)
  )
  return [
      int(s.count)
      for s in jax.tree.leaves(inner_state, is_leaf=is_counted)
      if is_counted(s)
  ]


# --------------------------------------------------------------------------
# Tests.


def test_reference_is_sensitive():
  """Clipping bites on some updates only, and every update has its own lr."""
  _, grad_norms = _reference()
  assert any(n > CLIP for n in grad_norms), grad_norms
  assert any(n < CLIP for n in grad_norms), grad_norms
  lrs = [float(_schedule(jnp.int32(t))) for t in range(NUM_UPDATES)]
  assert len(set(lrs)) == NUM_UPDATES
  tokens = [[float(_num_tokens(mb)) for mb in _micro_batches(b)]
            for b in _BATCHES]
  assert all(len(set(t)) > 1 for t in tokens), tokens


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_accumulate_matches_full_batch_training(loss_reduction):
  tx = oa.accumulate(_inner(), NUM_MICROBATCHES, loss_reduction=loss_reduction)
  trajectory, states = _micro_step_trajectory(tx, _BATCHES, loss_reduction)
  expected, _ = _reference()
  _assert_same_trajectory(trajectory, expected)
  for update, state in enumerate(states, start=1):
    assert int(state.count) == update
    assert int(state.micro_step) == 0
    assert bool(oa.has_updated(state))
    assert _inner_counts(state.inner_state) == [update, update]


def test_value_and_grad_matches_full_batch_training():
  inner = _inner()
  grad_fn = oa.value_and_grad(
      _mean_loss, num_microbatches=NUM_MICROBATCHES, num_tokens_fn=_num_tokens
  )

  @jax.jit
  def step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = _params(), inner.init(_params())
  trajectory = []
  for batch in _BATCHES:
    params, opt_state = step(params, opt_state, batch)
    trajectory.append(params)
  expected, _ = _reference()
  _assert_same_trajectory(trajectory, expected)
  assert _inner_counts(opt_state) == [NUM_UPDATES, NUM_UPDATES]


def test_batch_size_warmup_matches_full_batches_of_matching_sizes():
  tx = oa.accumulate(_inner(), _warmup)
  trajectory, states = _micro_step_trajectory(tx, _WARMUP_BATCHES)
  expected, _ = _reference(warmup=True)
  _assert_same_trajectory(trajectory, expected)
  assert [int(s.count) for s in states] == [1, 2, 3, 4, 5]
  assert _inner_counts(states[-1].inner_state) == [NUM_UPDATES, NUM_UPDATES]
  # Reading the cycle length off the count after its increment (an
  # off-by-one) groups the same micro-batches into other updates.
  shifted, _ = _micro_step_trajectory(
      oa.accumulate(_inner(), lambda count: _warmup(count + 1)),
      _WARMUP_BATCHES,
  )
  assert _differs(shifted, expected)


def test_naive_alternatives_leave_the_full_batch_trajectory():
  expected, _ = _reference()
  k = NUM_MICROBATCHES

  def total_tokens(batch):
    return float(_num_tokens(batch))

  alternatives = {
      # Each micro-batch's mean weighs the same, whatever its token count.
      "mean of means": _micro_step_trajectory(
          optax.MultiSteps(
              _inner(), k, use_grad_mean=True
          ).gradient_transformation(),
          _BATCHES,
      )[0],
      # Clipping (the first stage of inner) applied to every micro-batch.
      "clip per micro-batch": _micro_step_trajectory(
          optax.chain(
              optax.clip_by_global_norm(CLIP),
              oa.accumulate(
                  optax.adamw(_schedule, eps=1e-3, weight_decay=WEIGHT_DECAY), k
              ),
          ),
          _BATCHES,
      )[0],
      # The schedule reads the micro-step count instead of the update count.
      "schedule per micro-step": _full_batch_trajectory(
          _BATCHES, schedule_per_micro_step=True
      )[0],
      # sum_i n_i g_i divided by k, or not divided, instead of by sum_i n_i.
      "divide by k": _full_batch_trajectory(
          _BATCHES, grad_scale=lambda b: total_tokens(b) / k
      )[0],
      "no division": _full_batch_trajectory(
          _BATCHES, grad_scale=total_tokens
      )[0],
  }
  for name, trajectory in alternatives.items():
    assert _differs(trajectory, expected), name
