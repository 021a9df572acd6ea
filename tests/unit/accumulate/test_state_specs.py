"""``state_specs``: the specs of a state holding per-device sums.

With ``axis_name``, the slots get the axis (beside their parameter's spec),
every subtree shaped like the parameters gets ``param_specs`` and the rest
is replicated; without it each leaf's spec is read off its type, and a sum
typed unreduced is refused in favour of ``checkpointable_state`` (or
``reduced_state``, which reduces what is unreduced and nothing else). (The
specs in a shard_map over a 2-D mesh are tested in
``tests/forms/test_distributed.py``; mid-cycle checkpoints in
``tests/forms/test_accumulate_typed.py`` and ``test_saved_state.py``.)
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import helpers
import optax_accum as oa

DIM = 3


def _slotted_state():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    return tx.init({"w": jnp.ones(DIM), "b": jnp.zeros(())})


def test_state_partition_specs_gives_params_specs_to_param_shaped_state():
  tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      oa.accumulate(optax.adam(0.1), every_k=2, axis_name="data",
                    skip_nonfinite=True),
  )
  params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
  state = jax.eval_shape(tx.init, params)
  param_specs = {"w": P(None, "model"), "b": P()}
  specs = oa.state_partition_specs(state, "data", param_specs)
  accumulate_specs = specs[1]
  assert accumulate_specs.grad_sum == {
      "w": P("data", None, "model"), "b": P("data"),
  }
  assert accumulate_specs.token_count == P("data")
  assert accumulate_specs.nonfinite_count == P("data")
  assert accumulate_specs.count == P()
  adam = accumulate_specs.inner_state[0]
  assert adam.mu == adam.nu == param_specs
  assert adam.count == P()
  # A single spec applies to every parameter.
  specs = oa.state_partition_specs(state, ("data", "fsdp"), P("model"))
  assert specs[1].grad_sum["b"] == P(("data", "fsdp"), "model")
  with pytest.raises(ValueError, match="AccumulateState"):
    oa.state_partition_specs(optax.adam(0.1).init(params), "data")


def test_state_partition_specs_name_a_bad_axis_name_or_param_specs():
  state = _slotted_state()
  with pytest.raises(TypeError, match="axis_name must be None, a str"):
    oa.state_partition_specs(state, 3)
  with pytest.raises(TypeError, match=r"param_specs must be None, a"
                     r" PartitionSpec or a tree of them.*got 'data'"):
    oa.state_partition_specs(state, "data", param_specs="data")
  with pytest.raises(ValueError, match=r"prefix of the parameters' tree"
                     r" PyTreeDef\(\{'b': \*, 'w': \*\}\)"):
    oa.state_partition_specs(state, "data", param_specs={"w": P()})
  with pytest.raises(ValueError, match=r"axis_name='model', but the state's"
                     r" running sums keep their per-device slots over"
                     r" \['data'\]"):
    oa.state_partition_specs(state, "model")
  specs = oa.state_partition_specs(state, "data", param_specs={"w": P(),
                                                                "b": P()})
  assert specs.grad_sum == {"w": P("data"), "b": P("data")}


def test_state_partition_specs_refuse_slots_a_state_does_not_have():
  state = oa.accumulate(optax.sgd(1.0), 2).init({"w": jnp.ones(DIM)})
  with pytest.raises(ValueError, match=r"axis_name='data', but the state"
                     r" holds no per-device slots \(its token_count has"
                     r" shape \(\)\)"):
    oa.state_partition_specs(state, "data")
  with pytest.raises(ValueError, match="param_specs is read only with"
                     " axis_name"):
    oa.state_partition_specs(state, param_specs=P())
  assert oa.state_partition_specs(state).grad_sum == {"w": P()}


def test_hsdp_slots_take_their_spec_from_their_type():
  """A parameter sharded over "fsdp" keeps its slots over "replica" alone:
  the spec read off the sum's type says so."""
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name=("replica", "fsdp"))
  mesh = accumulate_parts.explicit_mesh((2, 4), ("replica", "fsdp"))
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(jnp.zeros(8), P("fsdp")),
              "b": jnp.zeros(())}
    state = tx.init(params)
  specs = oa.state_partition_specs(state, ("replica", "fsdp"))
  assert specs.grad_sum == {"w": P("replica", "fsdp"),
                            "b": P(("replica", "fsdp"))}
  assert specs.token_count == P(("replica", "fsdp"))


def test_without_axis_name_each_spec_is_read_off_its_type():
  tx = oa.accumulate(optax.adam(0.1), 2)
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    state = tx.init({"w": jax.device_put(jnp.zeros((N, 2)), P("data")),
                     "b": jnp.zeros(2)})
  specs = oa.state_partition_specs(state)
  assert specs.grad_sum == {"w": P("data"), "b": P()}
  assert specs.inner_state[0].mu == {"w": P("data"), "b": P()}
  assert specs.token_count == specs.count == P()


def _typed_state():
  """A state mid-cycle whose sum is typed unreduced over "data" (the
  deferred gradients' running sum), and the sum it reduces to."""
  parts = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
  state = oa.accumulate(optax.sgd(1.0), 2).init({"w": jnp.zeros(2)})
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    unreduced = accumulate_parts.unreduced_from_slots(
        jax.device_put(parts, P("data")))
  return state._replace(grad_sum={"w": unreduced}), parts.sum(0)


@accumulate_parts.needs_unreduced_types
def test_an_unreduced_sum_has_no_spec_and_reduced_state_gives_it_one():
  state, total = _typed_state()
  with pytest.raises(ValueError, match=r"state\.grad_sum\['w'\] is typed"
                     r" .*unreduced.*Save optax_accum\.checkpointable_state"
                     r"\(state\).*optax_accum\.reduced_state\(state\)"):
    oa.state_partition_specs(state)
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    saved = jax.jit(oa.reduced_state)(state)
  assert not jax.typeof(saved.grad_sum["w"]).sharding.spec.unreduced
  np.testing.assert_array_equal(saved.grad_sum["w"], total)
  assert oa.state_partition_specs(saved).grad_sum == {"w": P()}
  helpers.assert_trees_equal(saved._replace(grad_sum=None),
                             state._replace(grad_sum=None))


def test_reduced_state_leaves_what_is_not_unreduced_as_it_is():
  state = oa.accumulate(optax.adam(0.1), 2).init({"w": jnp.ones(2)})
  reduced = oa.reduced_state({"opt": state, "step": 3})
  assert all(a is b for a, b in zip(jax.tree.leaves(reduced),
                                    jax.tree.leaves({"opt": state,
                                                     "step": 3})))
