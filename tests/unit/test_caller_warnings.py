"""Every warning we give names the caller's line, not ours.

Each warning is checked for its ``filename`` (this file) and ``lineno`` (the
line that called us): eagerly, and under ``jax.jit``, where the warning is
given at trace time and the caller's line is the jitted function's line that
calls us.
"""

import inspect
import re

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import reduced_fallbacks

_NO_COUNT = "got no token counts"


def _line() -> int:
  """The line of the caller of this function."""
  return inspect.currentframe().f_back.f_lineno


def _loss(w, mb):
  return jnp.mean((mb["x"] @ w - mb["y"]) ** 2)


def _batch(rows=8):
  x = jnp.arange(rows * 3, dtype=jnp.float32).reshape(rows, 3) / 10
  return {"x": x, "y": jnp.ones(rows)}


def _at_caller(record, line):
  assert len(record) == 1, [str(w.message) for w in record]
  assert (record[0].filename, record[0].lineno) == (__file__, line), (
      record[0].filename, record[0].lineno, str(record[0].message)[:80])


def test_value_and_grad_warns_at_the_callers_line():
  fn = oa.value_and_grad(_loss, num_microbatches=2)
  with pytest.warns(UserWarning, match=_NO_COUNT) as record:
    line = _line(); fn(jnp.ones(3), _batch())  # noqa: E702
  _at_caller(record, line)


def test_value_and_grad_under_jit_warns_at_the_jitted_functions_line():
  fn = oa.value_and_grad(_loss, num_microbatches=2)
  lines = []

  @jax.jit
  def step(w, batch):
    lines.append(_line()); return fn(w, batch)  # noqa: E702

  with pytest.warns(UserWarning, match=_NO_COUNT) as record:
    step(jnp.ones(3), _batch())
  _at_caller(record, lines[0])


@pytest.mark.parametrize("jit", [False, True])
def test_accumulate_warns_at_the_callers_line(jit):
  tx = oa.accumulate(optax.sgd(0.1), every_k=2)
  params = jnp.ones(3)
  state = tx.init(params)
  lines = []

  def update(grads, state):
    lines.append(_line()); return tx.update(grads, state, params)  # noqa: E702

  with pytest.warns(UserWarning, match=_NO_COUNT) as record:
    (jax.jit(update) if jit else update)(jnp.ones(3), state)
  _at_caller(record, lines[0])


def test_an_nnx_optimizer_warns_at_the_callers_line():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, oa.accumulate(optax.sgd(0.1), every_k=2),
                            wrt=nnx.Param)
  grads = nnx.state(model, nnx.Param)
  with pytest.warns(UserWarning, match=_NO_COUNT) as record:
    line = _line(); optimizer.update(model, grads)  # noqa: E702
  _at_caller(record, line)


@pytest.mark.skipif(not hasattr(P(), "unreduced"),
                    reason="needs jax's unreduced types (jax >= 0.8.2)")
def test_the_fallback_warning_is_at_the_callers_line():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

  def loss(params, mb):  # x + bias: the bias cannot be typed reduced.
    pred = mb["x"] @ params["w"] + params["caller_line_bias"]
    return jnp.mean((pred - mb["y"]) ** 2)

  fn = oa.value_and_grad(loss, num_microbatches=2, equal_weights=True)
  lines = []

  @jax.jit
  def step(params, batch):
    lines.append(_line()); return fn(params, batch)  # noqa: E702

  reduced_fallbacks._warned.clear()
  with jax.set_mesh(mesh):
    batch = jax.device_put(_batch(16), P("data"))
    params = {"w": jnp.ones(3), "caller_line_bias": jnp.float32(0.5)}
    with pytest.warns(UserWarning, match="caller_line_bias") as record:
      step(params, batch)
  _at_caller(record, lines[0])



def test_every_warning_of_ours_goes_through_caller_warnings():
  """A ``warnings.warn`` elsewhere would name our line, not the caller's."""
  src = helpers.ROOT / "optax_accum"
  offenders = [
      f"{path.relative_to(helpers.ROOT)}:{number}"
      for path in sorted(src.rglob("*.py"))
      if path.name != "caller_warnings.py"
      for number, line in enumerate(path.read_text().splitlines(), 1)
      if re.search(r"(?<!caller_)warnings\.warn\(", line)
  ]
  assert not offenders, offenders
