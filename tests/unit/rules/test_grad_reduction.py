"""grad_reduction ("mean", "max", "last" per leaf), in both entry points.

The model has a "mean" part (a linear model on padded sequences), an "amax"
scalar whose gradient is the micro-batch's max |x| over its tokens (what an
FP8 amax is) and a "last" scalar whose gradient is the micro-batch's token
count. Expected values come from the full batch (``jax.grad``) or, for
``oa.accumulate`` with dropped micro-steps, from the kept micro-batches by
hand.
"""

from flax import linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

DIM, SEQ, K = 3, 4, 4
RULES = {"lin": "mean", "amax": "max", "last": "last"}


def _params():
  return {"lin": helpers.linear_params(DIM), "amax": jnp.float32(0.0),
          "last": jnp.float32(0.0)}


def _batch(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(jnp.asarray,
                      helpers.padded_batch(rng, lengths, SEQ, DIM))


def _stat_terms(params, batch):
  amax = jnp.max(jnp.abs(batch["x"]) * batch["mask"][..., None])
  return params["amax"] * amax + params["last"] * helpers.num_tokens(batch)


def mean_loss(params, batch):
  token_losses = helpers.linear_token_losses(params["lin"], batch)
  return helpers.safe_mean(token_losses, batch) + _stat_terms(params, batch)


def sum_loss(params, batch):
  token_losses = helpers.linear_token_losses(params["lin"], batch)
  return token_losses.sum() + _stat_terms(params, batch)


LOSSES = {"mean": mean_loss, "sum": sum_loss}
# Micro-batch 1 (rows 2-3) has no tokens; the largest |x| is made to sit in
# micro-batch 2.
LENGTHS = [2, 1, 0, 0, 4, 3, 1, 2]


def _full_batch(loss_reduction):
  """The batch and its full-batch gradient (a mean over its tokens).

  With ``loss_reduction="sum"`` too: value_and_grad divides the sum by the
  token count.
  """
  del loss_reduction
  batch = _batch(LENGTHS)
  return batch, jax.grad(mean_loss)(_params(), batch)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_value_and_grad_mean_max_last_are_the_full_batch_ones(loss_reduction):
  batch, expected = _full_batch(loss_reduction)
  fn = jax.jit(oa.value_and_grad(
      LOSSES[loss_reduction], num_microbatches=K,
      num_tokens_fn=helpers.num_tokens, loss_reduction=loss_reduction,
      grad_reduction=RULES))
  _, grads = fn(_params(), batch)
  helpers.assert_trees_close(grads["lin"], expected["lin"], rtol=1e-5,
                             atol=1e-6)
  assert grads["amax"] == expected["amax"]  # the full batch's max |x|.
  assert grads["last"] == 3.0  # the last micro-batch's tokens (1 + 2).
  # The negative control: averaged, the amax is not the full batch's.
  _, averaged = jax.jit(oa.value_and_grad(
      LOSSES[loss_reduction], num_microbatches=K,
      num_tokens_fn=helpers.num_tokens, loss_reduction=loss_reduction))(
          _params(), batch)
  assert abs(averaged["amax"] - expected["amax"]) > 1e-3


def test_value_and_grad_without_tokens_gives_zeros():
  fn = oa.value_and_grad(mean_loss, num_microbatches=K,
                         num_tokens_fn=helpers.num_tokens,
                         grad_reduction=RULES)
  _, grads = fn(_params(), _batch([0] * 8))
  helpers.assert_trees_equal(grads, jax.tree.map(jnp.zeros_like, _params()))


def test_a_prefix_covers_a_subtree_and_mean_is_the_default():
  rules = {"lin": {"w": "mean", "b": "max"}, "amax": "max", "last": "last"}
  batch, expected = _full_batch("mean")
  _, grads = oa.value_and_grad(
      mean_loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
      grad_reduction=rules)(_params(), batch)
  helpers.assert_trees_close(grads["lin"]["w"], expected["lin"]["w"],
                             rtol=1e-5, atol=1e-6)
  assert grads["amax"] == expected["amax"]


@pytest.mark.parametrize("entry", ["accumulate", "value_and_grad"])
@pytest.mark.parametrize("rules, where", [
    # Means only, so nothing else would have noticed (issue 28).
    ({"lin": "mean", "amax": "mean"}, r"it has no entry for \['last'\]"),
    ({"lin": "mean", "amax": "mean", "lsat": "mean"},
     r"its entries at \['lsat'\] match no leaf; it has no entry for"
     r" \['last'\]"),
])
def test_a_grad_reduction_that_is_not_a_prefix_is_refused(entry, rules,
                                                          where):
  match = r"grad_reduction must be a single value or a pytree prefix.*" + where
  with pytest.raises(ValueError, match=match):
    if entry == "accumulate":
      oa.accumulate(optax.sgd(0.1), every_k=2,
                    grad_reduction=rules).init(_params())
    else:
      oa.value_and_grad(mean_loss, num_microbatches=K,
                        num_tokens_fn=helpers.num_tokens,
                        grad_reduction=rules)(_params(), _batch(LENGTHS))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_accumulate_keeps_only_kept_micro_steps(loss_reduction):
  """Micro-step 1 has no tokens, 2 is dropped by should_skip, 3 is NaN."""
  loss_fn = LOSSES[loss_reduction]
  params = _params()
  tx = oa.accumulate(
      optax.sgd(-1.0), every_k=5, loss_reduction=loss_reduction,
      skip_nonfinite=True, grad_reduction=RULES,
      should_skip=lambda g, state, p: state.micro_step == 2)
  microbatches = [_batch([2, 3], seed=s) for s in range(5)]
  microbatches[1] = _batch([0, 0], seed=1)
  grads = [jax.grad(loss_fn)(params, mb) for mb in microbatches]
  grads[3] = jax.tree.map(lambda g: g * jnp.nan, grads[3])
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g, mb in zip(grads, microbatches):
    updates, state = update(g, state, params,
                            num_tokens=helpers.num_tokens(mb))
  assert oa.has_updated(state)
  kept = [0, 4]
  tokens = [helpers.num_tokens(microbatches[i]) for i in kept]
  weights = tokens if loss_reduction == "mean" else [1.0, 1.0]
  mean_lin = jax.tree.map(
      lambda *gs: sum(w * g for w, g in zip(weights, gs)) / sum(tokens),
      *[grads[i]["lin"] for i in kept])
  helpers.assert_trees_close(updates["lin"], mean_lin, rtol=1e-5, atol=1e-6)
  assert updates["amax"] == max(grads[i]["amax"] for i in kept)
  assert updates["last"] == grads[4]["last"] == 5.0
  # The dropped micro-step had the largest amax: it did not count.
  assert grads[2]["amax"] > updates["amax"]


def test_accumulate_emit_and_a_checkpoint_mid_cycle():
  params = _params()
  tx = oa.accumulate(optax.sgd(-1.0), every_k=100, grad_reduction=RULES)
  microbatches = [_batch([1, 2], seed=s) for s in range(3)]
  grads = [jax.grad(mean_loss)(params, mb) for mb in microbatches]
  update = jax.jit(tx.update)
  state = tx.init(params)
  for g, mb in zip(grads[:2], microbatches):
    _, state = update(g, state, params, num_tokens=helpers.num_tokens(mb))
  # A checkpoint is a pytree of arrays: save it as NumPy, restore, go on.
  state = jax.tree.map(jnp.asarray, jax.tree.map(np.asarray, state))
  updates, state = update(grads[2], state, params,
                          num_tokens=helpers.num_tokens(microbatches[2]),
                          emit=True)
  assert updates["amax"] == max(g["amax"] for g in grads)
  assert updates["last"] == grads[2]["last"]
  # The next cycle starts afresh: its max is its own micro-step's.
  small = jax.tree.map(lambda g: g * 0.5, grads[0])
  updates, state = update(small, state, params, num_tokens=1.0, emit=True)
  assert updates["amax"] == small["amax"]


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


@pytest.mark.slow
def test_value_and_grad_takes_the_max_over_devices_once():
  rules = {"lin": "mean", "amax": "max", "last": "mean"}
  lengths = np.random.default_rng(3).integers(0, SEQ + 1, size=64)
  batch = _batch(lengths)
  expected = jax.grad(mean_loss)(_params(), batch)
  with jax.set_mesh(_mesh()):
    fn = jax.jit(oa.value_and_grad(
        mean_loss, num_microbatches=2, num_tokens_fn=helpers.num_tokens,
        axis_name="data", grad_reduction=rules))
    args = (jax.device_put(_params(), P()), jax.device_put(batch, P("data")))
    _, grads = fn(*args)
    counts = oa.count_collectives(fn.lower(*args).compile(),
                                  include_scalars=False)
  assert grads["amax"] == expected["amax"]
  helpers.assert_trees_close(grads["lin"], expected["lin"], rtol=1e-5,
                             atol=1e-6)
  assert counts.in_loop == {}


@pytest.mark.slow
def test_accumulate_takes_the_max_over_devices_in_the_emitting_branch():
  rules = {"lin": "mean", "amax": "max", "last": "mean"}
  tx = oa.accumulate(optax.sgd(-1.0), every_k=2, axis_name="data",
                     grad_reduction=rules)
  lengths = np.random.default_rng(4).integers(0, SEQ + 1, size=32)
  batch = _batch(lengths)

  def step(params, state, mb):
    grads = jax.grad(mean_loss)(oa.device_local(params, "data"), mb)
    return tx.update(grads, state, params, num_tokens=helpers.num_tokens(mb))

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    sharded = jax.jit(jax.shard_map(step, in_specs=(P(), specs, P("data")),
                                    out_specs=(P(), specs)))
    for half in (slice(0, 16), slice(16, 32)):
      mb = jax.device_put(jax.tree.map(lambda x, h=half: x[h], batch),
                          P("data"))
      updates, state = sharded(params, state, mb)
    counts = oa.count_collectives(sharded.lower(params, state, mb).compile())
  expected = jax.grad(mean_loss)(_params(), batch)
  assert updates["amax"] == expected["amax"]
  assert counts.in_branch == {"all-reduce": 2}  # the sum, and the pmax.
  assert counts.total == counts.in_branch


@pytest.mark.parametrize("make", [
    lambda **kw: oa.accumulate(optax.sgd(1.0), 2, **kw),
    lambda **kw: oa.value_and_grad(mean_loss, num_microbatches=2, **kw),
])
def test_bad_rules_are_named_at_construction(make):
  with pytest.raises(ValueError, match=r"grad_reduction\['amax'\].*'min'"):
    make(grad_reduction={"lin": "mean", "amax": "min"})
  with pytest.raises(ValueError, match=r"grad_reduction\['last'\].*axis_name"):
    make(grad_reduction={"last": "last"}, axis_name="data")
  with pytest.raises(ValueError, match="grad_reduction"):
    make(grad_reduction={})


def test_a_prefix_that_does_not_fit_the_gradient_is_named():
  tx = oa.accumulate(optax.sgd(1.0), 2, grad_reduction={"lin": "mean",
                                                        "scale": "max"})
  params = _params()
  # Named at init, where the parameters are first seen, not at the update.
  with pytest.raises(ValueError, match=r"grad_reduction.*\['scale'\]"):
    tx.init(params)


# FP8 training with flax.linen.fp8_ops: amax histories and scales.

FP8_ROWS, FP8_DIM = 16, 8


def _fp8_model():
  return nn.Dense(4, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)


def _fp8_sum_loss(variables, batch):
  """Squared error summed over the unmasked rows (the tokens)."""
  out = _fp8_model().apply(variables, batch["x"])
  return (batch["mask"][:, None] * (out - batch["y"]) ** 2).sum()


def _fp8_batch(step):
  rng = np.random.default_rng(step)
  mask = (rng.random(FP8_ROWS) < 0.7).astype(np.float32)
  return {"x": jnp.asarray(rng.normal(size=(FP8_ROWS, FP8_DIM)) * (step + 1),
                           jnp.float32),
          "y": jnp.asarray(rng.normal(size=(FP8_ROWS, 4)), jnp.float32),
          "mask": jnp.asarray(mask)}


def _fp8_train(grad_fn, steps=3):
  """SGD on the params; the FP8 variables are overwritten by their grads."""
  variables = _fp8_model().init(jax.random.key(0), jnp.ones((1, FP8_DIM)))
  for step in range(steps):
    grads = grad_fn(variables, _fp8_batch(step))
    variables = {
        "params": jax.tree.map(lambda p, g: p - 0.01 * g,
                               variables["params"], grads["params"]),
        fp8_ops.OVERWRITE_WITH_GRADIENT:
            grads[fp8_ops.OVERWRITE_WITH_GRADIENT],
    }
  return variables


def _fp8_full_batch(variables, batch):
  grads = jax.grad(_fp8_sum_loss)(variables, batch)
  return {"params": jax.tree.map(lambda g: g / batch["mask"].sum(),
                                 grads["params"]),
          fp8_ops.OVERWRITE_WITH_GRADIENT:
              grads[fp8_ops.OVERWRITE_WITH_GRADIENT]}


def _fp8_microbatched(fp8_rule):
  fn = jax.jit(oa.value_and_grad(
      _fp8_sum_loss, num_microbatches=4, loss_reduction="sum",
      num_tokens_fn=lambda mb: mb["mask"].sum(),
      grad_reduction={"params": "mean",
                      fp8_ops.OVERWRITE_WITH_GRADIENT: fp8_rule}))
  return lambda variables, batch: fn(variables, batch)[1]


@pytest.mark.slow
def test_fp8_amax_histories_and_scales_follow_the_full_batch():
  expected = _fp8_train(jax.jit(_fp8_full_batch))
  ours = _fp8_train(_fp8_microbatched("max"))
  fp8 = fp8_ops.OVERWRITE_WITH_GRADIENT
  history = expected[fp8]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
  assert int((history > 0).sum()) == 3  # one amax per step so far.
  helpers.assert_trees_close(ours[fp8], expected[fp8], rtol=1e-5)
  helpers.assert_trees_close(ours["params"], expected["params"], rtol=1e-5,
                             atol=1e-6)
  # The negative control: averaged, the histories are not the full batch's.
  averaged = _fp8_train(_fp8_microbatched("mean"))
  assert not helpers.trees_close(averaged[fp8], expected[fp8], rtol=1e-3)
