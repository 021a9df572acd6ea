"""Scanned layers whose stacked gradients are reduced inside the backward loop.

A model that stacks its layers into one leaf per weight and runs them with
:func:`jax.lax.scan` has that leaf's gradient final only when the whole
backward loop ends: the one reduction over devices starts after it, even
with the last micro-batch run after the micro-batch loop
(``overlap_reduction=True``). :func:`scan_layers` is a drop-in for that
``lax.scan``. Inside the last micro-batch of ``oa.value_and_grad(...,
overlap_reduction=True)`` under manual data axes (``shard_map``, ``pmap``,
or ``axis_name`` naming Auto axes), its backward loop adds each layer's
running sum of the earlier micro-batches to that layer's gradient and sums
it over the devices right there, one layer at a time, so that XLA can run
each layer's reduction beside the next layer's backward. Everywhere else it
is ``lax.scan``.

How the sums reach the model's scan: the last micro-batch is differentiated
(:func:`differentiate`) with respect to the parameters and, beside them, one
*probe* per reducible leaf (zeros the loss never reads). While ``loss_fn``
runs, a table maps each parameter leaf it was handed to its running sum and
probe; :func:`scan_layers` looks its ``xs`` up there, and its backward
returns each layer's reduced total as the probe's cotangent. A leaf's other
uses in the loss (a penalty, a tied weight) keep their gradient, reduced
after the loop as every other leaf's. Where XLA sees that gradient is zero
(no other use) it drops its reduction: the count of reductions per update
is unchanged.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import layer_sums


def scan_layers(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any,
                length: int | None = None, reverse: bool = False,
                unroll: int | bool = 1) -> tuple[Any, Any]:
  """:func:`jax.lax.scan` over a model's stacked layers.

  A drop-in for ``lax.scan(f, init, xs)`` where ``xs`` holds the stacked
  weights of the layers (one leaf per weight, the layers along its first
  axis), as the model receives them from ``loss_fn``'s parameters. In the
  last micro-batch of :func:`optax_accum.value_and_grad` with
  ``overlap_reduction=True`` under manual data axes, the backward loop sums
  each layer's gradient (with its running sum of the earlier micro-batches)
  over the devices inside the loop, one layer at a time, so that the
  reduction of the stack runs beside the rest of the backward pass instead
  of after it. The gradient is the same sum, exactly; everywhere else this
  is ``lax.scan``.

  A leaf of ``xs`` is reduced in the loop only if it is a parameter leaf
  exactly as ``loss_fn`` received it (not cast, sliced or copied), whose
  gradient is summed once per call and not sharded over the data axes (not
  with ``with_stats``, FSDP, ``gradient_sync`` other than ``"once"`` or a
  ``grad_reduction`` rule other than ``"mean"``), and where every leaf of
  ``init`` and ``xs`` is floating. Other leaves and uses are differentiated
  as ``lax.scan`` would. Inside a transformation that ``loss_fn`` applies
  itself (a ``jax.grad`` of a penalty, ``jax.vmap``, ``jax.checkpoint``
  around the scan) it is ``lax.scan``; remat inside ``f`` keeps the
  reduction in the loop.

  Args:
    f: the layer, ``f(carry, x) -> (carry, y)``, as for ``lax.scan``.
    init: the initial carry (the activations entering the first layer).
    xs: the stacked per-layer inputs (the layers' weights, and anything
      else stacked along the first axis).
    length, reverse, unroll: as for ``lax.scan``.

  Returns:
    ``(carry, ys)``, as ``lax.scan`` returns.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_accum as oa
    >>> w = jnp.full((3, 2, 2), 0.5)
    >>> h, _ = oa.scan_layers(lambda h, w: (jnp.tanh(h @ w), None),
    ...                       jnp.ones((1, 2)), w)
    >>> h.shape
    (1, 2)
  """
  table = layer_sums.current()
  leaves = jax.tree.leaves(xs)
  found = {}
  # No layer (a stack of zero): lax.scan's, with no layer slice to trace.
  empty = length == 0 or any(jnp.shape(x)[:1] == (0,) for x in leaves)
  if table is not None and not empty and all(
      layer_sums.is_float(x) for x in jax.tree.leaves((init, xs))):
    for p, leaf in enumerate(leaves):
      hit = table.by_id.get(id(leaf))
      # Each leaf's running sum is added once: a leaf given twice (or to a
      # second scan) is reduced there, and its second use after the loop.
      taken = {i for i, _ in found.values()}
      if hit is not None and hit[0] not in table.used | taken:
        found[p] = hit
  if found and table.watch is not None:  # the loop's trace: noted only.
    table.watch.hits.update(i for i, _ in found.values())
    found = {}
  if not found:
    return lax.scan(f, init, xs, length=length, reverse=reverse,
                    unroll=unroll)
  table.used.update(i for i, _ in found.values())
  return _reducing_scan(f, init, xs, found, table,
                        dict(length=length, reverse=reverse, unroll=unroll))


def _source(r: Any, x: list[Any], consts: list[Any]) -> tuple[str, int]:
  """Where a residual of one layer's backward comes from: an input of the
  layer (not stacked again: ``lax.scan`` does not either), or its own."""
  for j, leaf in enumerate(x):
    if r is leaf:
      return "x", j
  for j, leaf in enumerate(consts):
    if r is leaf:
      return "k", j
  return "s", -1


def _zero_cotangent(x: Any) -> Any:
  """Zeros typed as the cotangent of ``x``: unreduced where ``x`` is typed
  reduced, varying where it varies."""
  spec = readers.full_spec(x)
  if getattr(spec, "reduced", None):
    return jnp.zeros(jnp.shape(x), jnp.result_type(x), out_sharding=P(
        *readers.partitions(spec), unreduced=spec.reduced))
  return axes.varying_like(jnp.zeros_like(x), x)


def _float0_like(x: Any) -> np.ndarray:
  return np.zeros(np.shape(x), jax.dtypes.float0)


class _Plan(NamedTuple):
  """One reducing scan: the layer, its leaves and the sums it reduces."""

  layer: Callable[..., Any]  # layer(carry, x_leaves, consts) -> (carry, y).
  positions: list[int]  # the reduced leaves' positions in xs's leaves.
  table: layer_sums.Table
  init: Any  # the initial carry (its cotangent's type).
  opts: dict[str, Any]  # length, reverse, unroll.


class _Saved:
  """What tracing one layer's backward pass in the forward loop told: its
  residuals' structure and sources, and the per-layer outputs' types."""

  def __init__(self):
    self.tdef: Any = None  # the residuals' structure (a vjp function's).
    self.where: list[tuple[str, int]] = []  # each residual's _source.
    self.out: Any = None  # the per-layer outputs' ShapeDtypeStructs.


def _reducing_scan(f, init, xs, found, table, opts):
  """``lax.scan(f, init, xs)`` whose backward reduces the found leaves'
  layers in its loop (:func:`scan_layers`)."""
  x_def = jax.tree.structure(xs)
  fn, consts = jax.closure_convert(f, init, jax.tree.map(lambda x: x[0], xs))
  layer = lambda c, x, k: fn(c, x_def.unflatten(x), *k)
  plan = _Plan(layer, sorted(found), table, init, opts)
  saved = _Saved()

  @jax.custom_vjp
  def run(init, x_leaves, consts, probes, runs):
    del probes, runs  # read by the backward only.
    return lax.scan(lambda c, x: layer(c, x, consts), init, x_leaves, **opts)

  def fwd(init, x_leaves, consts, probes, runs):
    del probes
    return _forward(plan, saved, init, x_leaves, consts, runs)

  run.defvjp(fwd, lambda res, cts: _backward(plan, saved, res, cts))
  return run(init, jax.tree.leaves(xs), consts,
             [found[p][1] for p in plan.positions],
             [table.runs[found[p][0]] for p in plan.positions])


def _forward(plan: _Plan, saved: _Saved, init, x_leaves, consts, runs):
  """The layers, each one's backward residuals stacked but those that are
  its inputs (the layer's weights, the closed-over values)."""

  def body(c, x):
    out, vjp_fn = jax.vjp(plan.layer, c, x, consts)
    res, saved.tdef = jax.tree.flatten(vjp_fn)
    saved.where = [_source(r, x, consts) for r in res]
    saved.out = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)),
        out[1])
    return out[0], (out[1], [r for r, w in zip(res, saved.where)
                             if w[0] == "s"])

  carry, (ys, stacked) = lax.scan(body, init, x_leaves, **plan.opts)
  return (carry, ys), (stacked, x_leaves, consts, runs)


def _backward(plan: _Plan, saved: _Saved, res, cts):
  """The layers' backward loop: each reduced leaf's layer slice, its
  running sum added, summed over the devices in the loop body (the probes'
  cotangents); the other leaves' cotangents as ``lax.scan``'s."""
  stacked, x_leaves, consts, runs = res
  g_carry, g_ys = cts
  y_leaves, y_def = jax.tree.flatten(saved.out)
  y_float = [layer_sums.is_float(y) for y in y_leaves]
  k_float = [layer_sums.is_float(k) for k in consts]
  reduced = set(plan.positions)

  def body(carry, sl):
    g_c, g_k = carry
    st, x, run, g_y = sl
    st, g_y = iter(st), iter(g_y)
    vjp_fn = saved.tdef.unflatten([
        next(st) if kind == "s" else x[j] if kind == "x" else consts[j]
        for kind, j in saved.where])
    g_prev, g_x, g_kk = vjp_fn((g_c, y_def.unflatten([
        next(g_y) if fl else _float0_like(y)
        for y, fl in zip(y_leaves, y_float)])))
    totals = [plan.table.combine(r, g_x[p])
              for r, p in zip(run, plan.positions)]
    kept = [g for p, g in enumerate(g_x) if p not in reduced]
    g_k = [a + b for a, b in zip(
        g_k, [g for g, fl in zip(g_kk, k_float) if fl])]
    return (axes.varying_like(g_prev, plan.init), g_k), (kept, totals)

  zero_k = [axes.varying_like(jnp.zeros_like(k), k)
            for k, fl in zip(consts, k_float) if fl]
  (g_init, g_k), (kept, totals) = lax.scan(
      body, (axes.varying_like(g_carry, plan.init), zero_k),
      (stacked, x_leaves, runs,
       [g for g, fl in zip(jax.tree.leaves(g_ys), y_float) if fl]),
      length=plan.opts["length"], reverse=not plan.opts["reverse"],
      unroll=plan.opts["unroll"])
  kept, g_k = iter(kept), iter(g_k)
  g_x = [_zero_cotangent(x) if p in reduced
         else next(kept) for p, x in enumerate(x_leaves)]
  g_consts = [next(g_k) if fl else _float0_like(k)
              for k, fl in zip(consts, k_float)]
  return g_init, g_x, g_consts, totals, [None] * len(runs)
