"""The step that ``plan_microbatches`` compiles, but for its settings.

A :class:`Step` holds one ``plan_microbatches`` call's loss function,
operands and :func:`optax_accum.value_and_grad` arguments, checked; this
module reads from it the size of each device's share of the batch, the
numbers of micro-batches that divide it and whether FSDP policies apply,
and builds the value-and-grad function of one candidate's settings (``k``
and an FSDP policy). It compiles nothing: ``planner`` compiles, measures
and chooses.
"""

from collections.abc import Callable, Iterable
import math
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from optax_accum._src import validation
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import coupled
from optax_accum._src.microbatch import forms
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import value_and_grad as value_and_grad_lib


class Step(NamedTuple):
  """The step a plan compiles, but for its planned settings."""

  loss_fn: Callable[..., Any]
  encode_fn: Callable[..., Any] | None  # gradient caching: coupled.
  wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None
  vg_kwargs: dict[str, Any]
  operands: tuple[Any, ...]  # (params, batch, *args), or with model state.
  call_kwargs: dict[str, Any]  # rng= and loss_fn's keyword arguments.


def checked_step(loss_fn, operands, rng, loss_kwargs, encode_fn, wrap,
                 vg_kwargs) -> Step:
  """The checked :class:`Step` of one ``plan_microbatches`` call."""
  for name, f in (("encode_fn", encode_fn), ("wrap", wrap)):
    if f is not None and not callable(f):
      raise TypeError(f"{name} must be callable or None, got {f!r}.")
  if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
    raise TypeError(
        "loss_kwargs must be a dict of loss_fn's keyword arguments, got"
        f" {loss_kwargs!r}."
    )
  if vg_kwargs.get("has_state") and len(operands) < 3:
    raise TypeError(
        "With has_state=True, call plan_microbatches(loss_fn, params,"
        " model_state, batch, *args, ...), as you call the step."
    )
  call_kwargs = dict(loss_kwargs or {})
  if "num_real_microbatches" in {**vg_kwargs, **call_kwargs}:
    raise TypeError(
        "plan_microbatches plans for all num_microbatches micro-batches;"
        " num_real_microbatches, a keyword of each call, does not change the"
        " memory a step needs. Plan without it and pass it to"
        " plan.value_and_grad(..., num_real_microbatches=n)."
    )
  if "rng" in call_kwargs:
    raise TypeError("Pass the key as plan_microbatches(..., rng=key), not in"
                    " loss_kwargs.")
  if rng is not None:
    call_kwargs["rng"] = rng
  if encode_fn is not None and call_kwargs.keys() - {"rng"}:
    raise TypeError(
        "coupled_value_and_grad (encode_fn=) takes no keyword arguments"
        f" for its functions but rng=, got loss_kwargs={loss_kwargs!r}."
    )
  return Step(loss_fn, encode_fn, wrap, vg_kwargs, operands, call_kwargs)


def build_step(step: Step, k: int, chosen: fsdp.Policy) -> Callable:
  """The value-and-grad function of a candidate's settings."""
  if step.encode_fn is not None:
    return coupled.coupled_value_and_grad(
        step.encode_fn, step.loss_fn, num_microbatches=k, **step.vg_kwargs)
  return value_and_grad_lib.value_and_grad(
      step.loss_fn, num_microbatches=k, gradient_sync=chosen.gradient_sync,
      gather_params=chosen.gather_params, **step.vg_kwargs)


def _batch_of(step: Step) -> Any:
  """The batch among the operands (after the model state with has_state)."""
  return step.operands[2 if step.vg_kwargs.get("has_state") else 1]


def has_fsdp_params(step: Step) -> bool:
  """Whether some parameter is sharded over ``axis_name``: policies apply."""
  axis_name = step.vg_kwargs.get("axis_name")
  if axis_name is None or step.encode_fn is not None:
    return False
  params = step.operands[0]
  specs = step.vg_kwargs.get("param_specs")
  if specs is None:
    specs = jax.tree.map(
        lambda p: readers.explicit_spec(p) or P(), params
    )
  specs = fsdp.specs_like(params, specs, axis_name)
  return any(readers.sharded_dims(s) for s in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P)))


def rows_per_device(step: Step) -> int:
  """The size of each device's share of the split axis of the batch."""
  axis_name = step.vg_kwargs.get("axis_name")
  batch = _batch_of(step)
  rows = batching.split_size(batch, batching.leaf_axes(
      batch, batching.check_batch_axes(step.vg_kwargs.get("batch_axes", 0))))
  if axis_name is None:
    return rows
  mesh, _ = forms.current_mesh(step.operands)
  if step.wrap is not None and mesh is None:
    return _rows_seen_inside(step)
  sizes = {} if mesh is None else readers.axis_sizes(mesh)
  if any(a not in sizes for a in readers.axes_of(axis_name)):
    raise ValueError(
        f"axis_name={axis_name!r} is not an axis of the current mesh:"
        " plan_microbatches compiles the step under jax.jit, so call it"
        " under jax.set_mesh(mesh), or pass inputs (arrays or"
        " jax.ShapeDtypeStructs) sharded over that mesh's Explicit axes."
    )
  devices = math.prod(sizes[a] for a in readers.axes_of(axis_name))
  batching.check_divisible(rows, 1, devices=devices)
  return rows // devices


def _rows_seen_inside(step: Step) -> int:
  """The rows per device that ``step.wrap`` hands the loop, by tracing it.

  A step wrapped in a shard_map brings its own mesh: the loop (with one
  micro-batch) sees the device's share of the batch.
  """
  seen = []
  fn = step.encode_fn if step.encode_fn is not None else step.loss_fn
  axes_ = batching.check_batch_axes(step.vg_kwargs.get("batch_axes", 0))

  at = 2 if step.vg_kwargs.get("has_state") and step.encode_fn is None else 1

  def probe(*args, **kwargs):
    microbatch = args[at]
    seen.append(batching.split_size(
        microbatch, batching.leaf_axes(microbatch, axes_)))
    return fn(*args, **kwargs)

  if step.encode_fn is not None:
    probed = build_step(step._replace(encode_fn=probe), 1, fsdp.Policy())
  else:
    probed = build_step(step._replace(loss_fn=probe), 1, fsdp.Policy())
  jax.eval_shape(step.wrap(probed), *step.operands, **step.call_kwargs)
  return seen[0]


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def check_candidates(candidates: Iterable[int] | None, rows: int) -> list[int]:
  """The numbers of micro-batches to try, in order, for ``rows`` per device.

  ``candidates`` checked (each must divide ``rows``), or by default every
  divisor of ``rows``.
  """
  if candidates is None:
    return _divisors(rows)
  if isinstance(candidates, (str, bytes)) or not isinstance(
      candidates, Iterable):
    raise TypeError(
        "candidates must be None or an iterable of positive ints (the numbers"
        f" of micro-batches to try), got {candidates!r} of type"
        f" {type(candidates).__name__}: pass [{candidates!r}] to try one."
    )
  given = list(candidates)
  ks = sorted({validation.check_positive_int("candidates[i]", k)
               for k in given})
  if not ks:
    raise ValueError(
        "candidates must name at least one number of micro-batches, got"
        f" {given}; pass None to try every divisor of the per-device"
        f" batch size {rows}."
    )
  if any(rows % k for k in ks):
    raise ValueError(
        f"candidates must be divisors of the per-device batch size {rows},"
        f" got {given}."
    )
  return ks
