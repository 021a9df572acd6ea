"""oa.check_k_invariance on train steps written the way users write them.

Correct steps in each form pass; each mistake of the seam between a user's
step and gradient accumulation is planted as users make it and must be
reported (never raised) with the hint that names its class. Every test of a
mistake is a negative control of the passing ones: the same step, one line
changed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4
ROWS, SEQ, DIM, HIDDEN = 8, 6, 3, 5


@pytest.fixture(name="batch")
def _batch():
  """Rows of very uneven lengths: micro-batches of unequal token counts."""
  rng = np.random.default_rng(0)
  lengths = [1, 1, 6, 6, 2, 1, 5, 6]
  return jax.tree.map(jnp.asarray,
                      helpers.padded_batch(rng, lengths, SEQ, DIM))


def _params():
  return helpers.mlp_params(DIM, HIDDEN, seed=1)


def _optimizer():
  schedule = optax.cosine_decay_schedule(1e-2, 100)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=0.1))


def _per_example_loss(params, mb):
  """Each example's mean over its own tokens, then the mean over examples."""
  token_losses = helpers.mlp_token_losses(params, mb)
  per_example = token_losses.sum(-1) / jnp.maximum(mb["mask"].sum(-1), 1.0)
  return per_example.mean()


# Steps are cached by their arguments: the tests that build the same step
# (the default ones above all) share its compilations.
@functools.cache
def _one_call_step(k, loss_fn=helpers.mlp_mean_loss, opt=None, **grad_kwargs):
  """The README's one-call loop: oa.value_and_grad, then the optimizer."""
  opt = opt or _optimizer()
  grad_kwargs.setdefault("num_tokens_fn", helpers.num_tokens)
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=k, **grad_kwargs)

  @jax.jit
  def step(state, batch):
    params, opt_state = state
    _, grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _one_call_state(opt=None):
  params = _params()
  return params, (opt or _optimizer()).init(params)


@functools.cache
def _per_call_step(k, wrap=None, apply="update_and_apply",
                   loss_fn=helpers.mlp_mean_loss, num_tokens=helpers.num_tokens,
                   every_k=None, opt=None):
  """k calls of a jitted micro-step with oa.accumulate(every_k=k)."""
  tx = oa.accumulate(opt or _optimizer(), every_k=every_k or k)
  tx = wrap(tx) if wrap else tx

  @jax.jit
  def micro_step(params, opt_state, mb):
    grads = jax.grad(loss_fn)(params, mb)
    if apply == "update_and_apply":
      return oa.update_and_apply(tx, grads, opt_state, params,
                                 num_tokens=num_tokens(mb))
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=num_tokens(mb))
    if apply == "apply_if_updated":
      return oa.apply_if_updated(params, updates, opt_state), opt_state
    return optax.apply_updates(params, updates), opt_state

  def step(state, batch):
    params, opt_state = state
    for mb in helpers.split(batch, k):
      params, opt_state = micro_step(params, opt_state, mb)
    return params, opt_state

  return step


def _per_call_state(wrap=None, opt=None):
  params = _params()
  tx = oa.accumulate(opt or _optimizer(), every_k=1)
  return params, (wrap(tx) if wrap else tx).init(params)


# Correct steps pass.


# The two other ways to apply are update_and_apply's equals
# (tests/unit/accumulate/test_applying.py): one form passing here suffices.
@pytest.mark.parametrize("apply", [
    "update_and_apply",
    pytest.param("apply_if_updated", marks=pytest.mark.slow),
    pytest.param("apply_updates", marks=pytest.mark.slow)])
def test_the_per_call_step_passes(batch, apply):
  report = oa.check_k_invariance(
      lambda k: _per_call_step(k, apply=apply), _per_call_state(), batch)
  assert report.ok, report
  assert report.hint == ""
  assert report.num_microbatches == (1, K)
  # oa.accumulate's running sums are scratch after an update: listed.
  assert any(path.endswith(".grad_sum") for path, _ in report.ignored)


def test_the_one_call_loop_passes_with_several_splits(batch):
  report = oa.check_k_invariance(_one_call_step, _one_call_state(), batch,
                                 num_microbatches=(1, 2, 4, 8))
  assert report.ok, report
  assert {row.num_microbatches for row in report.leaves} == {2, 4, 8}


def test_a_per_example_loss_passes_with_equal_weights(batch):
  report = oa.check_k_invariance(
      lambda k: _one_call_step(k, _per_example_loss, num_tokens_fn=None,
                               equal_weights=True),
      _one_call_state(), batch)
  assert report.ok, report


def test_muon_passes(batch):
  params = {"w1": _params()["w1"], "w2": _params()["w2"][:, None]}

  def loss_fn(p, mb):
    hidden = jnp.tanh(mb["x"] @ p["w1"])
    losses = mb["mask"] * ((hidden @ p["w2"])[..., 0] - mb["y"]) ** 2
    return helpers.safe_mean(losses, mb)

  opt = optax.contrib.muon(1e-2)
  report = oa.check_k_invariance(
      lambda k: _one_call_step(k, loss_fn, opt=opt),
      (params, opt.init(params)), batch)
  assert report.ok, report


def test_the_state_given_is_left_as_it_was_even_when_donated(batch):
  state = _one_call_state()
  before = jax.tree.map(np.asarray, state)

  def make_step(k):
    step = _one_call_step(k)
    return jax.jit(step, donate_argnums=0)

  report = oa.check_k_invariance(make_step, state, batch)
  assert report.ok, report
  helpers.assert_trees_equal(jax.tree.map(np.asarray, state), before)


# Mistakes are reported, each with the hint that names its class.


def test_a_mean_of_micro_batch_means_is_reported(batch):
  # optax.MultiSteps' rule: every micro-batch weighs the same.
  report = oa.check_k_invariance(
      lambda k: _one_call_step(k, num_tokens_fn=None, equal_weights=True),
      _one_call_state(), batch)
  assert not report.ok
  assert "weighted by something other than what the loss divides by" in (
      report.hint)
  assert report.worst is not None
  assert "FAILED" in str(report) and report.worst[-48:] in str(report)


def test_a_per_example_loss_weighted_by_tokens_is_reported(batch):
  # big_vision's text losses divide each example by its own tokens; the
  # README's num_tokens=mask.sum() then weighs by the wrong count.
  report = oa.check_k_invariance(
      lambda k: _one_call_step(k, _per_example_loss), _one_call_state(),
      batch)
  assert not report.ok
  assert "equal_weights=True" in report.hint


def test_loss_reduction_sum_on_a_mean_loss_is_reported(batch):
  report = oa.check_k_invariance(
      lambda k: _one_call_step(k, loss_reduction="sum", opt=optax.sgd(0.1)),
      _one_call_state(optax.sgd(0.1)), batch)
  assert not report.ok
  assert "a division is missing" in report.hint, report.hint


def test_a_division_done_twice_is_reported(batch):
  def per_call(k):
    loss_fn = lambda p, mb: helpers.mlp_mean_loss(p, mb) / k
    return _per_call_step(k, loss_fn=loss_fn, opt=optax.sgd(0.1))

  report = oa.check_k_invariance(per_call, _per_call_state(opt=optax.sgd(.1)),
                                 batch)
  assert not report.ok
  assert "done twice" in report.hint, report.hint


def test_a_schedule_outside_accumulate_is_reported(batch):
  # The schedule's counter runs on every call: k times per update.
  outside = lambda tx: optax.chain(tx, optax.scale_by_schedule(
      optax.linear_schedule(1.0, 0.1, 10)))
  report = oa.check_k_invariance(
      lambda k: _per_call_step(k, wrap=outside, apply="apply_updates"),
      _per_call_state(wrap=outside), batch)
  assert not report.ok
  assert "advanced once per micro-step" in report.hint, report.hint


def test_clipping_each_micro_batch_is_reported(batch):
  outside = lambda tx: optax.chain(optax.clip_by_global_norm(1e-3), tx)
  report = oa.check_k_invariance(
      lambda k: _per_call_step(k, wrap=outside, apply="apply_updates"),
      _per_call_state(wrap=outside), batch)
  assert not report.ok
  assert "clipping belongs inside" in report.hint


def test_a_cycle_longer_than_the_micro_batches_is_reported(batch):
  # make_step(k) feeds k micro-batches to a transformation built for 8.
  report = oa.check_k_invariance(
      lambda k: _per_call_step(k, every_k=8), _per_call_state(), batch,
      num_microbatches=(8, 4))
  assert not report.ok
  assert "with k=4 the step made no update" in report.hint, report.hint
  assert "every_k=4" in report.hint


def test_zero_tokens_on_every_call_is_reported(batch):
  report = oa.check_k_invariance(
      lambda k: _per_call_step(k, num_tokens=lambda mb: jnp.float32(0.0)),
      _per_call_state(), batch)
  assert not report.ok
  assert "changed no floating-point leaf" in report.hint, report.hint


def test_a_nonfinite_gradient_is_reported(batch):
  batch = dict(batch, x=batch["x"].at[1, 0, 0].set(jnp.nan))
  report = oa.check_k_invariance(_per_call_step,
                                 _per_call_state(), batch)
  assert not report.ok
  assert "skip_nonfinite=True" in report.hint, report.hint


def test_a_step_returning_state_and_metrics_is_reported(batch):
  """A ``(state, metrics)`` pair is named, not a KeyError from inside."""
  def make_step(k):
    step = _one_call_step(k)
    return lambda state, batch: (step(state, batch), {"loss": 1.0})

  report = oa.check_k_invariance(make_step, _one_call_state(), batch)
  assert not report.ok
  assert "returns the state alone" in report.hint, report.hint
  assert "[0][0]" in report.hint, report.hint


def test_a_nonfinite_reference_is_named_not_taken_for_no_update(batch):
  """Only the reference split's update is NaN: it is named as that, not as
  a step that changed nothing (NaN compares unequal to every update)."""
  def make_step(k):
    step = _one_call_step(k)
    if k > 1:
      return step
    return lambda state, batch: jax.tree.map(
        lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating)
        else x, step(state, batch))

  report = oa.check_k_invariance(make_step, _one_call_state(), batch)
  assert not report.ok
  assert "reference step (k=1) made" in report.hint, report.hint
  assert "non-finite" in report.hint, report.hint


def test_a_step_that_raises_is_reported_not_raised(batch):
  def make_step(k):
    if k > 1:
      def step(state, batch):
        raise RuntimeError("boom")
      return step
    return _one_call_step(k)

  report = oa.check_k_invariance(make_step, _one_call_state(), batch)
  assert not report.ok
  assert report.errors == {K: "RuntimeError: boom"}
  assert "raised with k=4" in report.hint


def test_a_batch_statistic_is_reported_and_can_be_ignored(batch):
  def make_step(k):
    inner = _one_call_step(k)

    def step(state, batch):
      params, opt_state, stats = state
      for mb in helpers.split(batch, k):  # an EMA updated per micro-batch.
        stats = {"mean": 0.9 * stats["mean"] + 0.1 * mb["x"].mean()}
      params, opt_state = inner((params, opt_state), batch)
      return params, opt_state, stats

    return step

  state = (*_one_call_state(), {"mean": jnp.float32(0.0)})
  report = oa.check_k_invariance(make_step, state, batch)
  assert not report.ok
  assert report.worst == "[2]['mean']"
  assert "ignore=" in report.hint
  report = oa.check_k_invariance(make_step, state, batch,
                                 ignore=["[2]['mean']"])
  assert report.ok, report
  assert ("[2]['mean']", "named in ignore") in report.ignored


# Bad arguments are refused by name.


@pytest.mark.parametrize("value", [4, (4,), (1, 1), (0, 4), (1, 2.0), "14"])
def test_num_microbatches_is_checked(batch, value):
  with pytest.raises((TypeError, ValueError), match="num_microbatches"):
    oa.check_k_invariance(_one_call_step, _one_call_state(), batch,
                          num_microbatches=value)


def test_ignore_must_name_a_leaf(batch):
  with pytest.raises(ValueError, match=r"ignore names \['batch_stats'\]"):
    oa.check_k_invariance(_one_call_step, _one_call_state(), batch,
                          ignore=["batch_stats"])


def test_make_step_must_be_callable(batch):
  with pytest.raises(TypeError, match="make_step"):
    oa.check_k_invariance(None, _one_call_state(), batch)


def test_the_state_passed_into_update_given_to_apply_if_updated_is_reported(
    batch):
  # The state before the call says whether the call before it emitted: the
  # parameters never move, in every split alike.
  tx_of = lambda k: oa.accumulate(optax.sgd(0.1), every_k=k)

  def make_step(k):
    tx = tx_of(k)

    @jax.jit
    def micro_step(params, opt_state, mb):
      grads = jax.grad(helpers.mlp_mean_loss)(params, mb)
      updates, new_state = tx.update(grads, opt_state, params,
                                     num_tokens=helpers.num_tokens(mb))
      return oa.apply_if_updated(params, updates, opt_state), new_state

    def step(state, batch):
      params, opt_state = state
      for mb in helpers.split(batch, k):
        params, opt_state = micro_step(params, opt_state, mb)
      return params, opt_state

    return step

  report = oa.check_k_invariance(make_step, (_params(), tx_of(1).init(
      _params())), batch)
  assert not report.ok
  assert "not the one passed into it" in report.hint, report.hint


def test_an_infinite_leaf_left_alone_and_a_non_array_leaf_pass(batch):
  """A state holding ``inf`` the step never touches (a best loss so far)
  and a string: a correct step still passes; inf - inf is not a difference,
  and the string is not compared."""
  def make_step(k):
    step = _one_call_step(k)
    return lambda state, batch: {**state, "train": step(state["train"], batch)}

  state = {"train": _one_call_state(), "best_loss": jnp.float32(jnp.inf),
           "mask": jnp.array([0.0, -jnp.inf]), "name": "run 1"}
  report = oa.check_k_invariance(make_step, state, batch)
  assert report.ok, report


def test_a_leaf_returned_in_another_shape_is_reported(batch):
  """Every split transposing a weight: named, not a broadcasting error."""
  def make_step(k):
    step = _one_call_step(k)

    def transposed(state, batch):
      params, opt_state = step(state, batch)
      return {**params, "w1": params["w1"].T}, opt_state
    return transposed

  report = oa.check_k_invariance(make_step, _one_call_state(), batch)
  assert not report.ok
  assert "['w1'] as float32[" in report.hint, report.hint
  assert "shaped like the one it was given" in report.hint, report.hint


def test_a_bfloat16_update_within_rounding_is_not_called_exact(batch):
  """SGD on bfloat16 parameters whose update is smaller than their
  spacing: a step scaled by 1/k would look the same, so the report says it
  cannot tell instead of passing (a float32 copy of the same state shows
  the mistake)."""
  opt = optax.sgd(1e-3)

  def make_step(k):
    return _per_call_step(k, opt=opt, loss_fn=lambda p, mb: (
        helpers.mlp_mean_loss(p, mb) / k))

  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
  state = params, oa.accumulate(opt, every_k=1).init(params)
  report = oa.check_k_invariance(make_step, state, batch)
  assert not report.ok
  assert "within the rounding of its dtype" in report.hint, report.hint
  as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32)
                        if x.dtype == jnp.bfloat16 else x, state)
  report = oa.check_k_invariance(make_step, as_f32, batch)
  assert not report.ok and "1/4" in report.hint, report.hint


def test_ignoring_every_leaf_the_step_changes_is_named(batch):
  """With every parameter and optimizer leaf in ignore=, nothing moves:
  the hint names ignore= beside the usual causes of no update."""
  report = oa.check_k_invariance(
      _one_call_step, _one_call_state(), batch,
      ignore=["[0]", "[1]"])
  assert not report.ok
  assert "ignore= skips the leaves it changes (it skips [0], [1])" in (
      report.hint), report.hint


def test_a_complex_leaf_is_compared_in_both_parts(batch):
  """An update of a complex leaf's imaginary part, k times the
  reference's: seen (the real part alone would show nothing)."""
  def make_step(k):
    return lambda state, batch: {"z": state["z"] + 0.1j * k}

  report = oa.check_k_invariance(make_step, {"z": jnp.ones(3, jnp.complex64)},
                                 batch)
  assert not report.ok and "4 times" in report.hint, report.hint
