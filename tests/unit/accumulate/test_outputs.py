"""``outputs``: what the emitting step hands back, one kind per entry point.

Each :class:`outputs.Output` splits the cycle into what rides in the
carry and what the branches read, joins them back into the sum (and the
parameters, where it carries them), and hands back its value, made or
skipped: the updates or zeros (``Updates``, ``UpdatesInSum``, the latter
from the sum's buffer), or the parameters updated or as they were
(``Applied``). ``fits`` says where the sum's buffer holds the updates
exactly. (That every kind has the whole Protocol: ``test_sum_layout.py``.)
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import helpers
from optax_accum._src.accumulate import outputs
from optax_accum._src.accumulate import sum_layout

PARAMS = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5, jnp.bfloat16)}
UPDATES = {"w": jnp.array([-0.25, 0.5]), "b": jnp.array(-1.0, jnp.bfloat16)}
SUM = {"w": jnp.array([7.0, 8.0]), "b": jnp.array(9.0)}  # float32 both.
NAMES = ("Updates", "UpdatesInSum", "Applied")


def _output(name: str) -> Any:
  if name == "UpdatesInSum":
    return outputs.UpdatesInSum(jax.eval_shape(lambda: UPDATES))
  return getattr(outputs, name)()


def _cycle():
  return sum_layout.Cycle(SUM, jnp.float32(2.0), None, None)


def _handed_back(name: str, updated: bool) -> Any:
  if name == "Applied":
    return optax.apply_updates(PARAMS, UPDATES) if updated else PARAMS
  return UPDATES if updated else jax.tree.map(jnp.zeros_like, UPDATES)


@pytest.mark.parametrize("name", NAMES)
def test_split_and_joined_give_back_the_sum_and_the_carried_params(name):
  output = _output(name)
  carry, reads = output.split(_cycle(), PARAMS)
  grad_sum, params = output.joined(carry, reads)
  assert grad_sum is SUM
  assert params is (PARAMS if name == "Applied" else None)
  # The sum rides in one place only: XLA copies a buffer both carried and
  # read.
  if name == "UpdatesInSum":
    assert carry is SUM and reads.grad_sum is None


@pytest.mark.parametrize("updated", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_each_output_hands_back_its_value_made_or_skipped(name, updated):
  output = _output(name)
  carry, _ = output.split(_cycle(), PARAMS)
  like = jax.eval_shape(output.made, UPDATES, carry)
  out = output.made(UPDATES, carry) if updated else output.skip(carry, like)
  emitted = outputs.Emitted(out, None, jnp.bool_(updated), None,
                            jnp.float32(2.0))
  returned, kept = output.returned(emitted, SUM)
  helpers.assert_trees_equal(returned, _handed_back(name, updated))
  if name == "UpdatesInSum":  # the buffer, updates or sum, in its float32.
    assert jax.tree.map(lambda k: k.dtype, kept) == {"w": jnp.float32,
                                                     "b": jnp.float32}
  else:
    assert kept is SUM


def test_the_updates_in_the_sum_are_handed_back_in_their_own_dtype():
  """Negative control for the buffer: the bfloat16 update leaves through a
  float32 buffer, cast back, not as the buffer's float32."""
  output = _output("UpdatesInSum")
  out = output.made(UPDATES, SUM)
  assert out["b"].dtype == jnp.float32
  returned, _ = output.returned(
      outputs.Emitted(out, None, jnp.bool_(True), None, jnp.float32(1.0)),
      SUM)
  assert returned["b"].dtype == jnp.bfloat16


def _like(dtype, shape=(2,)):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("update,kept,fits", [
    (_like(jnp.float32), _like(jnp.float32), True),
    (_like(jnp.bfloat16), _like(jnp.float32), True),
    (_like(jnp.float16), _like(jnp.float32), True),
    (_like(jnp.float32), _like(jnp.bfloat16), False),  # would round.
    (_like(jnp.bfloat16), _like(jnp.float16), False),  # range.
    (_like(jnp.complex64), _like(jnp.float32), False),
    (_like(jnp.int32), _like(jnp.float32), False),
    (_like(jnp.float32, (3,)), _like(jnp.float32), False),
])
def test_fits_where_the_sum_holds_every_update_exactly(update, kept, fits):
  assert outputs.fits({"w": update}, {"w": kept}) == fits


def test_fits_needs_the_same_tree_and_a_leaf():
  f32 = _like(jnp.float32)
  assert not outputs.fits({"w": f32}, {"v": f32})
  assert not outputs.fits({}, {})
