"""``reduced_fallbacks``: the leaves JAX cannot type reduced, and the report.

The report says what the fallback costs (the leaves, their bytes reduced in
each micro-batch), warns only where that adds more than ``WARN_ABOVE`` of
the gradient's bytes to a call's reductions, and always lists the leaves on
request. The XLA workarounds refuse the casts XLA gets wrong.
"""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import cast_checks
from optax_accum._src.microbatch import reduced_fallbacks


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
  """Forgets which leaves were warned about (the warning comes once)."""
  monkeypatch.setattr(reduced_fallbacks, "_warned", set())


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _loss(params, mb):
  """A weight used through a matmul (typed reduced), a bias added."""
  return jnp.mean(jnp.tanh(mb @ params["w"] + params["b"]) ** 2)


def _step(num_microbatches, **kwargs):
  fn = oa.value_and_grad(_loss, num_microbatches=num_microbatches,
                         equal_weights=True, **kwargs)

  @jax.jit
  def step(params, batch):
    return fn(params, batch)  # the caller's line the warning names.

  return fn, step


def _batch(width):
  rng = np.random.default_rng(1)
  return jnp.asarray(rng.normal(size=(64, width)), jnp.float32)


def test_a_costly_fallback_warns_with_its_cost_at_the_callers_line():
  """b is 1/5 of the gradient's bytes (width 4): 4 micro-batches add 60%."""
  _, step = _step(4)
  with jax.set_mesh(_mesh()):
    batch = jax.device_put(_batch(4), P("data"))
    with pytest.warns(UserWarning) as caught:
      step(helpers.dense_params(4), batch)
  (warning,) = [w for w in caught if "cannot be typed" in str(w.message)]
  message = str(warning.message)
  assert warning.filename == __file__
  assert "1 parameter leaves cannot be typed reduced over ['data']" in message
  assert "params['b'] " in message or "params['b']." in message
  assert "(16 bytes, 20.00% of the gradient's bytes)" in message
  assert "in each of the 4 micro-batches (64 bytes per call" in message
  assert "60.0% more bytes all-reduced" in message
  assert "CPU backend" in message and "oa.reducible_layers(model)" in message


@pytest.mark.slow
def test_a_small_fallback_is_quiet_and_still_reported():
  """b is 1/65 of the gradient's bytes (width 64): 2 micro-batches add 1.5%,
  below WARN_ABOVE; 8 add 10.8%, above it. Failed before: every fallback
  warned, whatever it cost."""
  fn, step = _step(2)
  with jax.set_mesh(_mesh()):
    batch = jax.device_put(_batch(64), P("data"))
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      step(helpers.dense_params(64), batch)
    report = oa.sharding_report(fn, helpers.dense_params(64), batch)
    assert report.fallback_leaves == ("params['b']",)
    assert report.reduced_bytes_per_call == 2 * 64 * 4
    assert report.extra_share == pytest.approx(1 / 65)
    assert not report.warns
    _, costly = _step(8)
    with pytest.warns(UserWarning, match=r"each of the 8 micro-batches"):
      costly(helpers.dense_params(64), batch)


def test_the_report_of_a_step_that_ran_and_a_second_report():
  """jit's trace cache skipped the loop, and its report: failed before with
  "traced no typed micro-batch loop" after a call, or after one report."""
  fn, _ = _step(2)
  traces = []
  grad_fn = jax.jit(fn)  # a jit inside the step, met in its cache too.

  @jax.jit
  def step(params, batch):
    traces.append(1)
    return grad_fn(params, batch)

  with jax.set_mesh(_mesh()):
    batch = jax.device_put(_batch(64), P("data"))
    step(helpers.dense_params(64), batch)
    reports = [oa.sharding_report(f, helpers.dense_params(64), batch)
               for f in (step, step, fn, fn, grad_fn)]
    assert len(traces) == 3  # the call's and both reports'.
    # The call's trace (and compilation) kept.
    step(helpers.dense_params(64), batch)
  assert len(traces) == 3
  assert {r.fallback_leaves for r in reports} == {("params['b']",)}


def test_the_report_of_a_deferred_call_counts_every_call():
  fn, _ = _step(1, gradient_sync="deferred")
  with jax.set_mesh(_mesh()):
    report = oa.sharding_report(
        fn, helpers.dense_params(4), jax.device_put(_batch(4), P("data")))
  assert report.deferred and report.extra_share == pytest.approx(0.2)
  assert report.warns and "in every call (16 bytes per call)" in (
      report.message())


def test_the_fallback_stays_exact():
  fn, _ = _step(4)
  with jax.set_mesh(_mesh()):
    got = jax.jit(fn)(helpers.dense_params(4),
                      jax.device_put(_batch(4), P("data")))
  expected = jax.value_and_grad(_loss)(helpers.dense_params(4), _batch(4))
  helpers.assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def _cast_jaxpr(constant):
  with jax.set_mesh(_mesh()):
    return jax.make_jaxpr(lambda: jax.sharding.reshard(
        jnp.float32(constant), P(unreduced={"data"})))().jaxpr


def test_a_nonzero_constant_cast_to_unreduced_is_refused():
  with pytest.raises(cast_checks.UnsafeCast, match="reshard from"):
    cast_checks.check_casts(_cast_jaxpr(1.0))
  cast_checks.check_casts(_cast_jaxpr(0.0))  # zeros are safe.
