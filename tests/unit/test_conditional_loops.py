"""conditional_loops: conditionals written as while loops.

``run_if``, a lax.cond as a loop of at most one trip: what it computes (the
body where the predicate holds, the carry as it was otherwise, under jit,
vmap and shard_map), and how the readers of compiled programs place what
runs in it: in a branch, not in a loop, and not moved out of it by XLA's
loop-invariant code motion. ``scan_if``: n trips as one scan, differentiated
as n trips or none.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_accum as oa
from optax_accum._src import conditional_loops


def _double_plus(x, y):
  return {"a": 2.0 * x["a"] + y, "b": x["b"] - y}


@pytest.mark.parametrize("pred", [True, False])
def test_runs_the_body_once_where_the_predicate_holds(pred):
  x = {"a": jnp.arange(3.0), "b": jnp.ones(2)}
  got = jax.jit(lambda p, x: conditional_loops.run_if(p, _double_plus, x, 1.5))(
      jnp.bool_(pred), x)
  want = _double_plus(x, 1.5) if pred else x
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_each_batch_element_by_its_own_predicate_under_vmap():
  preds = jnp.array([True, False, True])
  xs = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones((3, 2))}
  got = jax.vmap(lambda p, x: conditional_loops.run_if(
      p, _double_plus, x, 1.0))(preds, xs)
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
    return conditional_loops.run_if(pred[0], body, total, x)

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
    return conditional_loops.run_if(
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


def _split(tx, grads, state, params, **kwargs):
  updates, state = tx.update(grads, state, params, **kwargs)
  return oa.apply_if_updated(params, updates, state), state


def _trajectory(inner, call=oa.update_and_apply):
  """Params and state of ``call`` (update_and_apply, or tx.update, which
  keeps its updates in the sum's buffer, + apply_if_updated) after cycles
  with uneven tokens, an empty cycle and an early flush."""
  tx = oa.accumulate(inner, every_k=3)
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3),
            "b": jnp.ones(3, jnp.bfloat16)}
  step = jax.jit(lambda params, state, grads, n, emit: call(
      tx, grads, state, params, num_tokens=n, emit=emit))
  state = tx.init(params)
  tokens = [2.0, 5.0, 1.0, 0.0, 0.0, 0.0, 3.0, 4.0]  # cycle 2: no tokens.
  for i, n in enumerate(tokens):
    grads = {"w": jax.random.normal(jax.random.key(i), (4, 3)),
             "b": jnp.full(3, 0.5 * i, jnp.bfloat16)}
    params, state = step(params, state, grads, n, i == len(tokens) - 1)
  return params, state


@pytest.mark.parametrize("call", [oa.update_and_apply, _split],
                         ids=["update_and_apply", "split"])
@pytest.mark.parametrize("inner", [
    "adam", pytest.param("muon", marks=pytest.mark.slow)])
def test_the_gpu_programs_loop_gives_the_cpu_programs_result(
    monkeypatch, inner, call):
  """On GPUs the emit choices are loops where TPU and CPU programs use
  conditionals (conditional_loops.per_compiler): forced here on the CPU,
  the same trajectory, bit for bit."""
  opt = optax.adam(0.1) if inner == "adam" else optax.contrib.muon(0.1)
  branched = _trajectory(opt, call)
  calls = []
  monkeypatch.setattr(conditional_loops, "per_compiler",
                      lambda branched, looped, cpu=None: calls.append(1)
                      or looped())
  looped = _trajectory(opt, call)
  assert calls  # the loop was taken.
  jax.tree.map(np.testing.assert_array_equal, looped, branched)


def _trips_or_none(pred, x, w, n=3):
  return conditional_loops.scan_if(
      pred, lambda c, i: c * w + jnp.sin(c) * i, n, x)


@pytest.mark.parametrize("pred", [True, False])
def test_scan_if_runs_every_trip_as_one_scan(pred):
  """``scan_if``: the n trips of a scan, whatever pred says (the caller
  drops them where it fails); no while loop, no conditional."""
  x, w = jnp.arange(3.0), jnp.float32(0.7)
  scanned = jax.lax.scan(lambda c, i: (c * w + jnp.sin(c) * i, None), x,
                         jnp.arange(3))[0]
  got = jax.jit(_trips_or_none)(jnp.bool_(pred), x, w)
  np.testing.assert_allclose(got, scanned, rtol=1e-6)
  jaxpr = str(jax.make_jaxpr(_trips_or_none)(jnp.bool_(pred), x, w))
  assert "scan[" in jaxpr and "while[" not in jaxpr and "cond[" not in jaxpr


@pytest.mark.parametrize("pred", [True, False])
def test_scan_if_differentiates_as_a_cond_around_a_scan(pred):
  """Reverse mode (a loop of dynamic trip count has none): the gradients,
  with respect to the carry and to what the body closes over, are the
  scan's where pred holds and the identity's where it does not."""
  x, w = jnp.arange(3.0), jnp.float32(0.7)

  def reference(x, w):
    if not pred:
      return jnp.sum(x ** 2)
    out = jax.lax.scan(lambda c, i: (c * w + jnp.sin(c) * i, None), x,
                       jnp.arange(3))[0]
    return jnp.sum(out ** 2)

  got = jax.grad(lambda x, w: jnp.sum(_trips_or_none(
      jnp.bool_(pred), x, w) ** 2), argnums=(0, 1))(x, w)
  expected = jax.grad(reference, argnums=(0, 1))(x, w)
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=1e-5)
