"""``saved_state``: each device's partial sum in its slot, and back.

ZeRO-1 and ZeRO-2 with one jit call per micro-batch (docs/zero.md), whose
running sums are unreduced over the 8 simulated devices between updates,
saved mid-cycle with orbax as the docs say and restored from shapes alone,
as a plain optax state, in an ``nnx.Optimizer`` and in a linen
``TrainState``: the next update is the uninterrupted run's, bit for bit,
where the sums reduced at the save (``oa.reduced_state``) are not; the save
and the restore compile to no collective. A state with nothing unreduced
passes as it is; a restore onto other devices, or without the mesh, gets
our error. (Two processes: ``tests/integration/
test_multiprocess_checkpoint.py``.)
"""

from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import accumulate_parts
import helpers
import optax_accum as oa

pytestmark = accumulate_parts.needs_unreduced_types

K, SAVE_AFTER, MICRO_STEPS = 3, 4, 6  # saved one micro-step into a cycle.


def _params():
  rng = np.random.default_rng(0)
  return {"w1": jnp.asarray(rng.normal(size=(8, 16)) * 0.3, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(16,)) * 0.3, jnp.float32),
          "odd": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}


def _micro_batches():
  rng = np.random.default_rng(1)
  return [{"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(16,)), jnp.float32),
           "mask": jnp.asarray(rng.random(16) < 0.6, jnp.float32)}
          for _ in range(MICRO_STEPS)]


def _run(micro_step, params, state, batches):
  for batch in batches:
    params, state = micro_step(params, state, batch)
  return params, state


def _differing(tree, other):
  return [jax.tree_util.keystr(path) for (path, x), y in zip(
      jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(other),
      strict=True) if not np.array_equal(x, y)]


def _zero(sync="once"):
  return oa.accumulate(helpers.clipped_adamw(2), K, shard_optimizer="data",
                       gradient_sync=sync)


def _save_and_restore(path, tree, target):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, oa.checkpointable_state(tree))
    checkpointer.wait_until_finished()
    return checkpointer.restore(path, oa.checkpointable_state(target))


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.parametrize("sync", [
    "once", pytest.param("every_microbatch", marks=pytest.mark.slow)])
def test_a_mid_cycle_zero_checkpoint_resumes_bit_for_bit(tmp_path, sync):
  tx = _zero(sync)
  micro_step = helpers.deferred_micro_step(helpers.zero_mlp_loss, tx)
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = jax.device_put(_params(), P())
    batches = [jax.device_put(b, P("data")) for b in _micro_batches()]
    fresh = jax.jit(tx.init)(params)
    params, state = _run(micro_step, params, fresh, batches[:SAVE_AFTER])
    assert jax.typeof(state.grad_sum["odd"]).sharding.spec.unreduced
    saved = oa.checkpointable_state((params, state))
    assert jax.typeof(saved[1].grad_sum["odd"]).sharding.spec == P("data",
                                                                   None)
    assert saved[1].grad_sum["odd"].addressable_shards[0].data.shape == (1, 3)
    # A new process knows the shapes: the state as the loop carries it.
    restored = _save_and_restore(tmp_path / "ckpt", (params, state),
                                 jax.eval_shape(micro_step, params, fresh,
                                                batches[0]))
    resumed_params, resumed = restored[0], oa.restored_state(
        restored[1], jax.eval_shape(tx.init, params))
    assert jax.typeof(resumed.grad_sum["odd"]) == jax.typeof(
        state.grad_sum["odd"])
    straight = _run(micro_step, params, state, batches[SAVE_AFTER:])
    again = _run(micro_step, resumed_params, resumed, batches[SAVE_AFTER:])
    assert int(again[1].count) == 2  # through the next update.
    assert not _differing(oa.checkpointable_state(again),
                          oa.checkpointable_state(straight))
    # The negative control: reduced at the save, the partial sums are summed
    # in another order at the emit.
    reduced = _run(micro_step, params, jax.jit(oa.reduced_state)(state),
                   batches[SAVE_AFTER:])
    if sync == "once":
      assert _differing(reduced[0], straight[0])
    helpers.assert_trees_close(reduced[0], straight[0], rtol=1e-6)


class _Model(nnx.Module):

  def __init__(self):
    self.w1, self.w2, self.odd = (nnx.Param(p) for p in _params().values())


def _nnx_parts(model_or_state):
  return {name: getattr(model_or_state, name)[...]
          for name in ("w1", "w2", "odd")}


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
def test_an_nnx_optimizer_resumes_bit_for_bit(tmp_path):
  grad_fn = oa.value_and_grad(
      lambda model, b: helpers.zero_mlp_loss(_nnx_parts(model), b),
      num_microbatches=1,
      num_tokens_fn=helpers.num_tokens, gradient_sync="deferred")

  def make():
    model = _Model()
    return model, nnx.Optimizer(model, _zero(), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, batch):
    _, grads = grad_fn(nnx.state(model, nnx.Param), batch)
    optimizer.update(model, grads, num_tokens=helpers.num_tokens(batch))

  def carried():  # the state as a micro-step leaves it, from shapes alone.
    model, optimizer = make()
    micro_step(model, optimizer, batches[0])
    return nnx.state((model, optimizer))

  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    batches = [jax.device_put(b, P("data")) for b in _micro_batches()]
    model, optimizer = make()
    for batch in batches[:SAVE_AFTER]:
      micro_step(model, optimizer, batch)
    restored = _save_and_restore(tmp_path / "ckpt",
                                 nnx.state((model, optimizer)),
                                 jax.eval_shape(carried))
    resumed = make()
    nnx.update(resumed, oa.restored_state(restored, nnx.state(resumed)))
    for batch in batches[SAVE_AFTER:]:
      micro_step(model, optimizer, batch)
      micro_step(*resumed, batch)
    assert bool(oa.has_updated(optimizer))
    assert not _differing(oa.checkpointable_state(nnx.state(resumed)),
                          oa.checkpointable_state(nnx.state((model,
                                                             optimizer))))


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
def test_a_linen_train_state_resumes_bit_for_bit(tmp_path):
  step = helpers.deferred_micro_step(helpers.zero_mlp_loss, _zero())

  @jax.jit
  def micro_step(state, batch):
    params, opt_state = step(state.params, state.opt_state, batch)
    return state.replace(params=params, opt_state=opt_state,
                         step=state.step + 1)

  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    batches = [jax.device_put(b, P("data")) for b in _micro_batches()]
    fresh = train_state.TrainState.create(
        apply_fn=None, params=jax.device_put(_params(), P()), tx=_zero())
    state = fresh
    for batch in batches[:SAVE_AFTER]:
      state = micro_step(state, batch)
    restored = _save_and_restore(
        tmp_path / "ckpt", state, jax.eval_shape(micro_step, fresh,
                                                 batches[0]))
    resumed = oa.restored_state(restored, fresh)
    for batch in batches[SAVE_AFTER:]:
      state, resumed = micro_step(state, batch), micro_step(resumed, batch)
    assert int(resumed.opt_state.count) == 2
    assert not _differing(oa.checkpointable_state(resumed),
                          oa.checkpointable_state(state))


def test_the_save_and_the_restore_move_nothing():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    parts = jnp.arange(accumulate_parts.N * 2.0).reshape(-1, 2)
    state = oa.accumulate(optax.sgd(1.0), 2).init({"w": jnp.zeros(2)})
    state = state._replace(grad_sum={"w": accumulate_parts.unreduced_from_slots(
        jax.device_put(parts, P("data")))})
    save = jax.jit(oa.checkpointable_state).lower(state).compile()
    saved = save(state)
    np.testing.assert_array_equal(saved.grad_sum["w"], parts)
    restore = jax.jit(oa.restored_state).lower(saved, state).compile()
    helpers.assert_trees_equal(oa.checkpointable_state(restore(saved, state)),
                               saved)
  assert oa.count_collectives(save).total == {}
  assert oa.count_collectives(restore).total == {}


def test_a_state_with_nothing_unreduced_passes_as_it_is():
  """The single form (and any state between updates that is not typed
  unreduced): no mesh needed, the same leaves back."""
  tx = oa.accumulate(optax.adam(0.1), 2)
  state = tx.init({"w": jnp.ones(3)})
  _, state = tx.update({"w": jnp.ones(3)}, state, num_tokens=2.0)
  saved = oa.checkpointable_state({"opt": state, "step": 3})
  assert all(a is b for a, b in zip(jax.tree.leaves(saved),
                                    jax.tree.leaves({"opt": state,
                                                     "step": 3})))
  assert oa.restored_state(saved, saved) is saved


def _unreduced_sums():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    return accumulate_parts.unreduced_from_slots(
        jax.device_put(jnp.ones((accumulate_parts.N, 2)), P("data")))


def test_a_save_or_restore_without_the_mesh_or_elsewhere_gets_our_error():
  sums = _unreduced_sums()
  with pytest.raises(ValueError, match=r"checkpointable_state .*jax\.set_mesh"):
    oa.checkpointable_state({"w": sums})
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    saved = oa.checkpointable_state({"w": sums})
  like = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
  with pytest.raises(ValueError, match=r"restored_state .*jax\.set_mesh"):
    oa.restored_state(saved, like)
  with jax.set_mesh(accumulate_parts.explicit_mesh((2, 4), ("data", "x"))):
    with pytest.raises(ValueError, match=r"saved\['w'\] holds 8 per-device"
                       r" partial sums.*optax_accum\.reduced_state"):
      oa.restored_state(
          {"w": jax.device_put(np.ones((8, 2), np.float32), P("data"))}, like)
    with pytest.raises(ValueError, match=r"saved\['w'\] has shape \(8, 2\),"
                       r" but like's leaf has shape \(3,\)"):
      oa.restored_state(saved, {"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="the same tree structure"):
      oa.restored_state(saved, [like["w"]])
