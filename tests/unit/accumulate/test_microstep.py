"""``microstep``: what one micro-step adds, in every form, and why not.

The incoming gradients checked against the state, the drop decisions
(``skip_nonfinite``, ``should_skip``), the token-weighted add with its lazy
reset, and the per-device add of the deferred forms, on small inputs.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import helpers
import optax_accum as oa
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.rules import token_weighting

SETTINGS = accumulate_parts.SETTINGS
NAN = float("nan")


def _state(params, k=2):
  return oa.accumulate(optax.sgd(1.0), k).init(params)


@pytest.mark.parametrize("grad,tokens,dropped", [
    (NAN, 2.0, True),  # a non-finite gradient.
    (NAN, 0.0, False),  # no tokens: a 0/0 mean is not looked at.
    (1.0, NAN, True),  # a non-finite count.
    (1.0, -1.0, True),  # a negative count.
    (1.0, 2.0, False),
])
def test_skip_nonfinite_drops_bad_gradients_and_counts(grad, tokens, dropped):
  grads = {"w": jnp.array([1.0, grad])}
  on = microstep.drops(grads, jnp.float32(tokens), None, None,
                       SETTINGS._replace(skip_nonfinite=True))
  assert bool(on.nonfinite) == dropped and not bool(on.skipped)
  # Negative control: without skip_nonfinite nothing is dropped.
  off = microstep.drops(grads, jnp.float32(tokens), None, None, SETTINGS)
  assert not bool(off.nonfinite)


def test_should_skip_decides_from_grads_state_and_params():
  seen = []

  def should_skip(grads, state, params):
    seen.append((grads, state, params))
    return grads["w"][0] > 0

  settings = SETTINGS._replace(should_skip=should_skip)
  for first, skipped in ((1.0, True), (-1.0, False)):
    grads = {"w": jnp.array([first])}
    assert bool(microstep.drops(grads, jnp.float32(1), "state", "params",
                                settings).skipped) == skipped
  assert [s[1:] for s in seen] == [("state", "params")] * 2
  with pytest.raises(TypeError, match=r"should_skip\(grads, state, params\)"
                     r" must be a bool scalar, got ArrayImpl float32\[1\]"):
    microstep.skipped(lambda g, s, p: g["w"], {"w": jnp.ones(1)}, None, None)


def test_should_skip_on_partials_keeps_jaxs_error_and_adds_our_hint():
  def should_skip(grads, state, params):
    raise TypeError("JAX's own words")

  with pytest.raises(TypeError, match="JAX's own words") as raised:
    microstep.skipped_on_partials(should_skip, {}, None, None)
  assert "replicated values" in "".join(raised.value.__notes__)
  # Negative control: the plain verdict adds no note.
  with pytest.raises(TypeError) as raised:
    microstep.skipped(should_skip, {}, None, None)
  assert not getattr(raised.value, "__notes__", None)


def test_add_to_sum_restarts_a_cycle_without_reading_the_stored_sum():
  """The call that starts a cycle adds to zeros: the stored buffer (the
  finished cycle's sum, or kept updates) is not read, NaN or not."""
  stored = {"w": jnp.array([NAN, 5.0])}
  grads = {"w": jnp.array([1.0, 2.0])}
  c = token_weighting.contribution(jnp.float32(3.0), "mean")
  restarted = microstep.add_to_sum(stored, grads, c, jnp.bool_(True), None)
  helpers.assert_trees_equal(restarted, {"w": jnp.array([3.0, 6.0])})
  continued = microstep.add_to_sum({"w": jnp.array([1.0, 5.0])}, grads, c,
                                   jnp.bool_(False), None)
  helpers.assert_trees_equal(continued, {"w": jnp.array([4.0, 11.0])})
  # A "max" leaf restarts from -inf, not from zeros.
  maxed = microstep.add_to_sum(stored, {"w": jnp.array([-1.0, -2.0])}, c,
                               jnp.bool_(True), ["max"])
  helpers.assert_trees_equal(maxed, {"w": jnp.array([-1.0, -2.0])})


@pytest.mark.parametrize("loss_reduction,weight", [("mean", 4.0),
                                                   ("sum", 1.0)])
def test_add_local_weights_by_the_loss_reduction(loss_reduction, weight):
  params = {"w": jnp.zeros(2)}
  state = _state(params)
  grads = {"w": jnp.array([1.0, -1.0])}
  step = microstep.add_local(
      grads, state, params, accumulate_parts.incoming(grads, 4),
      SETTINGS._replace(loss_reduction=loss_reduction))
  helpers.assert_trees_equal(step.cycle.grad_sum,
                             {"w": weight * grads["w"]})
  assert float(step.cycle.token_count) == 4.0  # counted either way.


def test_add_local_adds_nothing_for_a_dropped_micro_step_but_counts_it():
  params = {"w": jnp.zeros(2)}
  state = _state(params)._replace(micro_step=jnp.int32(1),
                                  grad_sum={"w": jnp.array([1.0, 2.0])},
                                  token_count=jnp.float32(1.0))
  settings = SETTINGS._replace(skip_nonfinite=True,
                               should_skip=lambda g, s, p: g["w"][0] > 9)
  for grads, counts in (({"w": jnp.array([NAN, 0.0])}, (1, 0)),
                        ({"w": jnp.array([10.0, 0.0])}, (0, 1))):
    step = microstep.add_local(grads, state, params,
                               accumulate_parts.incoming(grads, 3), settings)
    helpers.assert_trees_equal(step.cycle.grad_sum, state.grad_sum)
    assert float(step.cycle.token_count) == 1.0
    assert (int(step.nonfinite_count), int(step.skipped_count)) == counts
  # Negative control: a kept micro-step adds.
  grads = {"w": jnp.array([1.0, 0.0])}
  step = microstep.add_local(grads, state, params,
                             accumulate_parts.incoming(grads, 3), settings)
  helpers.assert_trees_equal(step.cycle.grad_sum,
                             {"w": jnp.array([4.0, 2.0])})


@pytest.mark.parametrize("bad_device", [3, None])
def test_add_on_device_drops_a_micro_step_on_every_device_or_none(
    bad_device):
  """One device's non-finite partial drops the micro-step everywhere: the
  devices' partial sums must stay parts of the same sum."""
  settings = SETTINGS._replace(skip_nonfinite=True)

  def add(grads):
    added = microstep.add_on_device([grads], [jnp.ones_like(grads)],
                                    jnp.float32(2.0), jnp.bool_(False),
                                    jnp.bool_(False), settings, "data")
    return added.sums[0], added.nonfinite[None], added.tokens[None]

  grads = jnp.arange(N, dtype=jnp.float32)
  if bad_device is not None:
    grads = grads.at[bad_device].set(NAN)
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  sums, nonfinite, tokens = jax.jit(jax.shard_map(
      add, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(grads)
  if bad_device is None:
    np.testing.assert_array_equal(sums, 1.0 + 2.0 * grads)
    assert not nonfinite.any() and (tokens == 2.0).all()
  else:
    np.testing.assert_array_equal(sums, np.ones(N))
    assert nonfinite.all() and not tokens.any()


def test_checked_grads_take_what_optax_takes_and_name_what_differs():
  grad_sum = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  checked = microstep.checked_grads({"w": np.array([1, 2]), "b": 0},
                                    grad_sum, None)
  assert jax.tree.map(lambda g: g.dtype, checked) == {"w": jnp.float32,
                                                      "b": jnp.float32}
  with pytest.raises(ValueError, match=r"updates\['w'\] has shape \(3,\),"
                     r" expected \(2,\)"):
    microstep.checked_grads({"w": jnp.zeros(3), "b": 0.0}, grad_sum, None)
  with pytest.raises(ValueError, match="updates must have the structure"):
    microstep.checked_grads({"w": jnp.zeros(2)}, grad_sum, None)
  # A sum with a leading slot axis: the gradients come without it.
  slots = {"w": jnp.zeros((1, 2)), "b": jnp.zeros((1,))}
  microstep.checked_grads({"w": jnp.ones(2), "b": 1.0}, slots, None,
                          slot_axis=True)
  with pytest.raises(ValueError, match=r"updates\['b'\] has shape \(\),"
                     r" expected \(1,\)"):
    microstep.checked_grads({"w": jnp.ones(2), "b": 1.0}, slots, None)


def test_as_inexact_keeps_floats_casts_integers_and_refuses_complex():
  grad_sum = {"f": jnp.zeros(2), "i": jnp.zeros(2), "h": jnp.zeros(2)}
  out = microstep.as_inexact(
      {"f": jnp.ones(2, jnp.bfloat16), "i": jnp.ones(2, jnp.int32),
       "h": jnp.ones(2, jnp.float16)}, grad_sum)
  assert {k: v.dtype for k, v in out.items()} == {
      "f": jnp.bfloat16, "i": jnp.float32, "h": jnp.float16}
  with pytest.raises(TypeError, match=r"updates\['c'\] is complex"
                     r" \(complex64\) but the parameters it is for are real"):
    microstep.as_inexact({"c": jnp.ones(2, jnp.complex64)},
                         {"c": jnp.zeros(2)})


def test_sum_dtype_is_complex_for_complex_parameters():
  assert sum_layout.sum_dtype(jnp.zeros(2), jnp.float32) == jnp.float32
  assert sum_layout.sum_dtype(jnp.zeros(2, jnp.complex64),
                             jnp.float32) == jnp.complex64


@pytest.mark.parametrize("num_tokens,none", [
    (None, False), (0, True), (0.0, True), (np.float32(0), True), (3, False),
])
def test_has_no_tokens_only_where_known_at_trace_time(num_tokens, none):
  assert microstep.has_no_tokens(num_tokens) == none
  # A traced count is never known to be zero.
  traced = []
  jax.jit(lambda n: traced.append(microstep.has_no_tokens(n)))(0.0)
  assert traced == [False]


def test_unreduced_gradients_refuse_what_needs_a_reduced_one():
  grads = {"w": jnp.zeros(2)}
  microstep.check_partials_settings(grads, SETTINGS)
  with pytest.raises(ValueError, match="with_stats=True cannot estimate"):
    microstep.check_partials_settings(grads,
                                      SETTINGS._replace(with_stats=True))
  with pytest.raises(ValueError, match=r"grad_reduction='max' with"
                     " unreduced gradients"):
    microstep.check_partials_settings(
        grads, SETTINGS._replace(grad_reduction="max"))


def test_counters_saturate_and_kept_weight_is_zero_when_not_kept():
  top = jnp.int32(np.iinfo(np.int32).max)
  assert int(microstep.increment_where(jnp.bool_(True), top)) == int(top)
  assert int(microstep.increment_where(jnp.bool_(False), jnp.int32(4))) == 4
  kept = token_weighting.contribution(jnp.float32(3.0), "mean")
  dropped = token_weighting.contribution(jnp.float32(3.0), "mean", drop=True)
  assert float(microstep.kept_weight(kept)) == 3.0
  assert float(microstep.kept_weight(dropped)) == 0.0
  assert bool(microstep.all_finite({"a": jnp.ones(2)}))
  assert not bool(microstep.all_finite({"a": jnp.array([1.0, NAN])}))
