"""``at_most_once.run_if``: a lax.cond written as a loop of at most one trip.

What it computes (the body where the predicate holds, the carry as it was
otherwise, under jit, vmap and shard_map), and how the readers of compiled
programs place what runs in it: in a branch, not in a loop, and not moved out
of it by XLA's loop-invariant code motion.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_accum as oa
from optax_accum._src.accumulate import at_most_once


def _double_plus(x, y):
  return {"a": 2.0 * x["a"] + y, "b": x["b"] - y}


@pytest.mark.parametrize("pred", [True, False])
def test_runs_the_body_once_where_the_predicate_holds(pred):
  x = {"a": jnp.arange(3.0), "b": jnp.ones(2)}
  got = jax.jit(lambda p, x: at_most_once.run_if(p, _double_plus, x, 1.5))(
      jnp.bool_(pred), x)
  want = _double_plus(x, 1.5) if pred else x
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_each_batch_element_by_its_own_predicate_under_vmap():
  preds = jnp.array([True, False, True])
  xs = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones((3, 2))}
  got = jax.vmap(lambda p, x: at_most_once.run_if(p, _double_plus, x, 1.0))(
      preds, xs)
  for i, pred in enumerate(preds):
    x = jax.tree.map(lambda v, i=i: v[i], xs)
    want = _double_plus(x, 1.0) if pred else x
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(lambda v, i=i: v[i], got), want)


def test_a_reduction_in_it_is_counted_in_a_branch_and_stays_there():
  """A psum of a value the loop only reads is loop-invariant: without the
  barrier, XLA hoists it out, to run on every call."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def step(pred, total, x):
    def body(total, x):
      return total + jax.lax.psum(x, "data")[0]
    return at_most_once.run_if(pred[0], body, total, x)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                             out_specs=P()))
  total, x = jnp.zeros(4), jnp.arange(32.0).reshape(8, 4)
  for pred in (True, False):
    got = fn(jnp.array([pred]), total, x)
    np.testing.assert_allclose(got, x.sum(0) if pred else total)
  counts = oa.count_collectives(
      fn.lower(jnp.array([True]), total, x).compile())
  assert counts.total == counts.in_branch == {"all-reduce": 1}, counts
  assert counts.in_loop == {} and counts.outside == {}, counts


@pytest.mark.parametrize("pred", [True, False])
def test_differentiated_as_the_conditional_in_both_modes(pred):
  """Reverse mode, which a loop lacks, through what the body closes over
  too (a scale) and what it reads."""
  scale = 3.0

  def run_if(x, y, s):
    return at_most_once.run_if(
        jnp.bool_(pred), lambda x, y: {"a": s * x["a"] * y, "b": x["b"]},
        x, y)

  def cond(x, y, s):
    return jax.lax.cond(pred, lambda x: {"a": s * x["a"] * y, "b": x["b"]},
                        lambda x: x, x)

  x, y = {"a": jnp.arange(3.0), "b": jnp.ones(2)}, 2.0
  for fn in (run_if, cond):
    def loss(x, y, s, fn=fn):
      out = fn(x, y, s)
      return jnp.sum(out["a"] ** 2) + jnp.sum(out["b"])
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, y, scale)
    if fn is run_if:
      mine = got
  jax.tree.map(np.testing.assert_allclose, mine, got)
  tangents = ({"a": jnp.ones(3), "b": jnp.ones(2)}, 1.0, 1.0)
  jax.tree.map(np.testing.assert_allclose,
               jax.jvp(run_if, (x, y, scale), tangents),
               jax.jvp(cond, (x, y, scale), tangents))


def _trajectory(inner):
  """Params and state of update_and_apply after cycles with uneven tokens,
  an empty cycle and an early flush."""
  tx = oa.accumulate(inner, every_k=3)
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3),
            "b": jnp.ones(3, jnp.bfloat16)}
  step = jax.jit(lambda params, state, grads, n, emit: oa.update_and_apply(
      tx, grads, state, params, num_tokens=n, emit=emit))
  state = tx.init(params)
  tokens = [2.0, 5.0, 1.0, 0.0, 0.0, 0.0, 3.0, 4.0]  # cycle 2: no tokens.
  for i, n in enumerate(tokens):
    grads = {"w": jax.random.normal(jax.random.key(i), (4, 3)),
             "b": jnp.full(3, 0.5 * i, jnp.bfloat16)}
    params, state = step(params, state, grads, n, i == len(tokens) - 1)
  return params, state


@pytest.mark.parametrize("inner", ["adam", "muon"])
def test_the_gpu_programs_loop_gives_the_cpu_programs_result(
    monkeypatch, inner):
  """On GPUs update_and_apply runs the inner optimizer in a loop where TPU
  and CPU programs use a conditional (at_most_once.per_compiler): forced
  here on the CPU, the same trajectory, bit for bit."""
  opt = optax.adam(0.1) if inner == "adam" else optax.contrib.muon(0.1)
  branched = _trajectory(opt)
  calls = []
  monkeypatch.setattr(at_most_once, "per_compiler",
                      lambda branched, looped: calls.append(1) or looped())
  looped = _trajectory(opt)
  assert calls  # the loop was taken.
  jax.tree.map(np.testing.assert_array_equal, looped, branched)
