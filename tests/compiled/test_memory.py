"""Peak memory: the micro-batch loop keeps one micro-batch's activations alive.

A deep, wide MLP on a big batch is compiled, never run, and XLA's memory
analysis reports the memory it needs per device, read as the planner reads
it (``memory_analysis.device_memory``): ``peak_memory_in_bytes``, each
buffer once.
XLA:CPU's peak leaves out the temporaries (jaxlib 0.10.2), so on this
backend the figure is temp + arguments + outputs - aliased; what a program
needs beyond its operands (arguments and unaliased outputs) is then its
temporaries. Full-batch backpropagation keeps every layer's activations for
the whole batch; ``oa.value_and_grad`` keeps them for one micro-batch at a
time, so its peak must fall with the number of micro-batches. Splitting the
batch without a sequential loop (``vmap`` over the micro-batches) saves
nothing, and the test says so.
"""

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import optax_accum as oa
from optax_accum._src.compiled import memory_analysis

DEPTH, WIDTH, BATCH = 8, 256, 8192  # 8 MiB of activations per layer
MiB = 2**20


def _params():
  layer = {
      "w": jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32),
      "b": jax.ShapeDtypeStruct((WIDTH,), jnp.float32),
  }
  return [layer] * DEPTH


def _batch():
  return {
      "x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
      "y": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
  }


def _loss(params, batch):
  h = batch["x"]
  for layer in params:
    h = jnp.tanh(h @ layer["w"] + layer["b"])
  return jnp.mean((h - batch["y"]) ** 2)


class _Peak(NamedTuple):
  """A program's peak per device, and that peak beyond its operands."""
  peak: int
  beyond_operands: int  # the peak - arguments - outputs + aliased.


def _peak(compiled):
  m = memory_analysis.device_memory(compiled)
  return _Peak(m.memory_bytes, m.memory_bytes - m.argument_bytes
               - m.output_bytes + m.alias_bytes)


def _peak_of(fn):
  return _peak(jax.jit(fn).lower(_params(), _batch()).compile())


@functools.cache
def _full_batch_peak():
  return _peak_of(jax.value_and_grad(_loss))


def test_peak_memory_falls_with_num_microbatches():
  peaks = {
      k: _peak_of(oa.value_and_grad(_loss, num_microbatches=k,
                                    equal_weights=True))
      for k in (1, 2, 4, 8)
  }
  report = {k: f"{p.peak / MiB:.1f} MiB" for k, p in peaks.items()}
  assert peaks[1].peak > peaks[2].peak > peaks[4].peak > peaks[8].peak, report
  full = _full_batch_peak()
  report["full batch"] = f"{full.peak / MiB:.1f} MiB"
  # One micro-batch is the full batch: no more memory than plain autodiff
  # (give or take the gradient accumulator, one copy of the parameters).
  param_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
  assert peaks[1].peak <= full.peak + param_bytes, report
  # Beyond the parameters, the batch and the gradient (the same in every
  # program), eight micro-batches need about an eighth of the activations.
  assert peaks[8].beyond_operands <= 0.5 * peaks[1].beyond_operands, report
  assert peaks[8].beyond_operands <= 0.25 * full.beyond_operands, report


def test_vmapped_micro_batches_do_not_save_memory():
  """The same split done in parallel keeps every activation: a control."""
  k = 8

  def vmapped(params, batch):
    micro_batches = jax.tree.map(
        lambda x: x.reshape((k, -1) + x.shape[1:]), batch
    )
    losses, grads = jax.vmap(jax.value_and_grad(_loss), in_axes=(None, 0))(
        params, micro_batches
    )
    return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)

  full = _full_batch_peak()
  assert _peak_of(vmapped).beyond_operands > 0.5 * full.beyond_operands


def _update_peak(tx, params):
  """Peak of a donated ``tx.update`` (state and gradients donated)."""
  state = jax.eval_shape(tx.init, params)
  update = jax.jit(tx.update, donate_argnums=(0, 1))
  return _peak(update.lower(params, state, params).compile())


def test_micro_step_needs_no_copy_of_the_sum_or_the_inner_state():
  """A micro-step updates the sum in place and passes the inner state through.

  XLA cannot write an output of a ``lax.cond`` in place over a donated input:
  a sum reset inside the emitting branch, or a sum computed inside the
  conditional, costs a temporary copy of the parameters' size on every
  micro-step (MultiSteps, which selects over its whole state, needs three).
  SPEC 11: its peak is no higher than MultiSteps's.
  """
  import optax  # pylint: disable=import-outside-toplevel

  params = {f"w{i}": jax.ShapeDtypeStruct((512, 512), jnp.float32)
            for i in range(4)}
  param_bytes = 4 * 512 * 512 * 4
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  ours = _update_peak(oa.accumulate(inner, 4, equal_weights=True), params)
  multi_steps = _update_peak(optax.MultiSteps(inner, 4), params)
  report = {"ours": ours, "MultiSteps": multi_steps}
  assert ours.peak <= multi_steps.peak, report
  # Beyond the state and gradients passed in and the updates handed back:
  assert ours.beyond_operands < 0.1 * param_bytes, report
  assert multi_steps.beyond_operands >= param_bytes, report


def _param_sized_copies(hlo_text, shape):
  """How many ``copy`` instructions of a parameter's shape a program runs."""
  dims = ",".join(map(str, shape))
  return len(re.findall(rf"= f32\[{dims}\]\S* copy\(", hlo_text))


def test_zero_updates_are_written_once_not_copied():
  """A non-emitting train step writes each zero update once, in place.

  XLA merges identical zero broadcasts of same-shaped leaves into one buffer
  and then copies it into every update leaf (ten leaves: ten parameter-sized
  copies per call); each leaf's zeros must stay distinct. (A bfloat16 sum
  cannot hold float32 updates, so they leave the conditional as zeros here;
  where it can, they are kept in its buffer and no zeros are written.)
  """
  import optax  # pylint: disable=import-outside-toplevel

  shape = (256, 256)
  params = {f"w{i}": jnp.zeros(shape) for i in range(4)}
  tx = oa.accumulate(optax.adamw(1e-3), 1 << 30, equal_weights=True,
                     accumulator_dtype=jnp.bfloat16)

  def train_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return oa.apply_if_updated(params, updates, state), state

  step = jax.jit(train_step, donate_argnums=(0, 1))
  text = step.lower(params, tx.init(params), params).compile().as_text()
  assert _param_sized_copies(text, shape) == 0


@pytest.mark.slow
def test_donated_micro_steps_peak_no_higher_than_multisteps():
  """SPEC 11 (issue 38, item 3) on CPU: a donated micro-step of ours, applied
  in the emitting branch (oa.update_and_apply), by oa.apply_if_updated or by
  optax.apply_updates, against optax.MultiSteps's micro-step and
  apply_updates, all with adamw."""
  import optax  # pylint: disable=import-outside-toplevel

  params = {f"w{i}": jax.ShapeDtypeStruct((512, 512), jnp.float32)
            for i in range(4)}
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  ours = oa.accumulate(inner, 4, equal_weights=True)
  theirs = optax.MultiSteps(inner, 4)

  def multi_step(params, state, grads):
    updates, state = theirs.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def split(apply):
    def step(params, state, grads):
      updates, state = ours.update(grads, state, params)
      return apply(params, updates, state), state
    return step

  peaks = {}
  for name, tx, fn in (
      ("ours", ours, lambda p, s, g: oa.update_and_apply(ours, g, s, p)),
      ("apply_if_updated", ours, split(oa.apply_if_updated)),
      ("apply_updates", ours,
       split(lambda p, u, s: optax.apply_updates(p, u))),
      ("MultiSteps", theirs, multi_step)):
    state = jax.eval_shape(tx.init, params)
    peaks[name] = _peak(jax.jit(fn, donate_argnums=(0, 1, 2)).lower(
        params, state, params).compile())
  for name in ("ours", "apply_if_updated", "apply_updates"):
    assert peaks[name].peak <= peaks["MultiSteps"].peak, (name, peaks)
    assert peaks[name].beyond_operands <= (
        peaks["MultiSteps"].beyond_operands), (name, peaks)
