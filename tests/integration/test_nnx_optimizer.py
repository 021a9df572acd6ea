"""oa.AccumulatingOptimizer: an nnx.Optimizer whose update applies the
accumulated update on the call that emits, and only then.

Two updates of k=4 micro-batches of uneven token counts follow the full
batch's nnx.Optimizer (parameters and step); between emits the parameters
do not move; the step passes oa.check_k_invariance, and counts one step
per update at every split.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4


def _loss(model, mb):
  losses = mb["mask"] * (model(mb["x"])[..., 0] - mb["y"]) ** 2
  return helpers.safe_mean(losses, mb)


def _batch(seed):
  """16 rows of uneven lengths (the first micro-batch's 4 rows short)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 7, size=16)
  lengths[:4] = 1
  return jax.tree.map(jnp.asarray, helpers.padded_batch(rng, lengths, 6, 3))


def _params(model):
  """A copy of the parameters' values (nnx.state holds the Variables)."""
  return {"kernel": np.array(model.kernel[...]),
          "bias": np.array(model.bias[...])}


@nnx.jit
def _micro_step(model, optimizer, mb):
  optimizer.update(model, nnx.grad(_loss)(model, mb),
                   num_tokens=mb["mask"].sum())


def _accumulating(model, k=K):
  return oa.AccumulatingOptimizer(
      model, oa.accumulate(optax.adamw(1e-2), every_k=k), wrt=nnx.Param)


def test_two_updates_of_four_micro_batches_follow_the_full_batch():
  full_model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  full = nnx.Optimizer(full_model, optax.adamw(1e-2), wrt=nnx.Param)
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = _accumulating(model)

  @nnx.jit
  def full_step(model, optimizer, batch):
    optimizer.update(model, nnx.grad(_loss)(model, batch))

  for seed in (1, 2):
    batch = _batch(seed)
    full_step(full_model, full, batch)
    before = _params(model)
    for i, mb in enumerate(helpers.split(batch, K)):
      _micro_step(model, optimizer, mb)
      if i < K - 1:  # no pass over the parameters until the emit.
        helpers.assert_trees_equal(_params(model), before)
    assert not np.array_equal(_params(model)["kernel"], before["kernel"])
    helpers.assert_trees_close(_params(model), _params(full_model),
                               rtol=1e-5)
    assert int(optimizer.step[...]) == int(full.step[...]) == seed
  assert int(oa.find_accumulate_state(optimizer.opt_state).count) == 2


def test_the_step_is_k_invariant_its_step_count_too():
  make_step = helpers.optimizer_k_step(_micro_step)
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  report = oa.check_k_invariance(make_step, (model, _accumulating(model, 1)),
                                 _batch(3))
  assert report.ok, report
  # The check leaves any nnx.Optimizer's step out; this one counts updates:
  # one at every k.
  for k in (1, K):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = _accumulating(model, k)
    make_step(k)((model, optimizer), _batch(3))
    assert int(optimizer.step[...]) == 1


def test_a_chain_around_accumulate_applies_on_emit_too():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = oa.AccumulatingOptimizer(
      model, optax.chain(oa.accumulate(optax.sgd(0.1), every_k=2)),
      wrt=nnx.Param)
  before = _params(model)
  mb = helpers.split(_batch(4), 4)
  _micro_step(model, optimizer, mb[0])
  helpers.assert_trees_equal(_params(model), before)
  _micro_step(model, optimizer, mb[1])
  assert int(optimizer.step[...]) == 1
  assert not np.array_equal(_params(model)["kernel"], before["kernel"])


def test_a_transformation_without_accumulate_is_refused():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="accumulate"):
    oa.AccumulatingOptimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("swap", ["tx_model", "model_none"])
def test_misplaced_constructor_arguments_are_named(swap):
  """They raised flax's "'Linear' object has no attribute 'init'"."""
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  tx = oa.accumulate(optax.sgd(0.1), every_k=2)
  args, match = {
      "tx_model": ((tx, model), r"swapped.*\(model, tx"),
      "model_none": ((model, None), r"tx must be an optax.*got None"),
  }[swap]
  with pytest.raises(TypeError, match=match):
    oa.AccumulatingOptimizer(*args, wrt=nnx.Param)


def test_update_with_grads_and_model_swapped_is_named():
  """update(grads, model) used the model's weights as the gradients."""
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = _accumulating(model, 1)
  before = _params(model)
  grads = nnx.grad(_loss)(model, _batch(5))
  with pytest.raises(TypeError, match=r"model=State \(expected the"
                     r" nnx.Module.*grads=Linear.*swapped"):
    optimizer.update(grads, model, num_tokens=4.0)
  helpers.assert_trees_equal(_params(model), before)
  assert int(optimizer.step[...]) == 0
