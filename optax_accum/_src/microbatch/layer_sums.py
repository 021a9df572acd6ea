"""How the micro-batch loop hands its running sums to a model's layer scan.

The last micro-batch is differentiated (:func:`differentiate`) with respect
to the parameters and, beside them, one *probe* per reducible leaf (zeros
the loss never reads). While ``loss_fn`` runs, a :class:`Table` maps each
parameter leaf it was handed to its running sum and probe; the layer scan
(:mod:`scanned_layers`) looks its ``xs`` up there (:func:`current`), and
its backward returns each layer's reduced total as the probe's cotangent.
The loop's own trace only notes which leaves a scan takes
(:class:`LoopLayers`), so that only a model that runs its layers by
``oa.scan_layers`` has its last micro-batch differentiated so.
"""

from collections.abc import Callable
import contextlib
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import borrowing
from optax_accum._src.microbatch import empty_safe
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import token_weighting

# Whether this JAX's compiler drops the reduction of a zero gradient (of a
# leaf used only by the scan that reduced it): with jax 0.9.1 it kept it,
# and the stack was reduced twice (measured on 8 CPU devices); there the
# last micro-batch runs lax.scan.
REDUCES_IN_LOOP = jax.__version_info__ >= (0, 10)
_ACTIVE = threading.local()


class Watch:
  """What the micro-batch loop's trace of ``loss_fn`` showed: the parameter
  leaves it handed to :func:`scan_layers`, and whether its loss's dtype
  holds a seed (float32, float64: :func:`differentiate`)."""

  def __init__(self):
    self.hits: set[int] = set()  # leaf indices.
    self.seeds = True


class Table:
  """The reducible leaves of one differentiation of the last micro-batch;
  or, with ``watch``, those of the loop's, only noted."""

  def __init__(self, runs: dict[int, jax.Array], watch: Watch | None = None):
    self.runs = runs  # leaf index -> this device's running sum.
    self.watch = watch
    self.by_id: dict[int, tuple[int, Any]] = {}  # id(leaf) -> (index, probe).
    self.combine: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    self.used: set[int] = set()  # leaf indices a scan reduced.


# jax.core's name warns of its deprecation since jax 0.10.
_get_trace_state = getattr(jax.extend.core, "get_opaque_trace_state", None) or (
    jax.core.get_opaque_trace_state)


def _trace() -> Any:
  """The JAX trace the caller runs in, comparable by ``==``."""
  return _get_trace_state(convention="optax_accum")


@contextlib.contextmanager
def active(table: Table):
  stack = getattr(_ACTIVE, "stack", [])
  _ACTIVE.stack = stack + [(table, _trace())]
  try:
    yield
  finally:
    _ACTIVE.stack = stack


def current() -> Table | None:
  """The active table, where the caller runs in its trace: not inside a
  transformation ``loss_fn`` applies itself (a ``jax.grad`` of a penalty,
  ``jax.vmap``, ``jax.checkpoint``), whose backward is not the one the
  table's sums reach; there :func:`scan_layers` is ``lax.scan``."""
  stack = getattr(_ACTIVE, "stack", [])
  if not stack or stack[-1][1] != _trace():
    return None
  return stack[-1][0]


def is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class Differentiated(NamedTuple):
  """The last micro-batch differentiated by :func:`differentiate`."""

  value: jax.Array
  rest: Any  # loss_fn's (model state, aux).
  grads: Any  # the parameters' gradient, weighted as ``added`` says.
  added: token_weighting.Contribution  # to add ``grads`` with.
  totals: dict[int, jax.Array]  # leaf index -> its sum over micro-batches
  # and devices, reduced in the scan's backward loop (invariant).


def reducible_leaves(with_stats: bool, lay: Any, rules: list[str] | None,
                     n: int) -> list[int]:
  """The leaves whose layers may be reduced in the last micro-batch: summed
  once over the data axes, not sharded over them (``lay``'s
  ``reducible_in_loop``), by the "mean" rule, not read per device
  (``with_stats``), with a JAX whose compiler drops a zero's reduction."""
  ok = lay.reducible_in_loop()
  if with_stats or not any(ok) or not REDUCES_IN_LOOP:
    return []
  mean = grad_reduction_lib.MEAN
  return [i for i in range(n)
          if ok[i] and (rules is None or rules[i] == mean)]


class LoopLayers:
  """One micro-batch loop's part in it: the loop's trace notes which of the
  ``reducible`` leaves ``loss_fn`` hands to :func:`scan_layers`, so that only
  a model that runs its layers by it has its last micro-batch differentiated
  by :func:`differentiate`; the sums that reduced are kept per leaf."""

  def __init__(self, loss: Callable[..., Any], reducible: list[int]):
    self.watch = Watch()
    self.totals: dict[int, jax.Array] = {}
    self.loss = loss
    self.in_loop = watching(loss, self.watch, reducible) if reducible else loss

  def loss_for(self, runs: Any) -> Callable[..., Any]:
    """The loop's loss (noted), or the last micro-batch's with ``runs``."""
    return self.loss if runs else self.in_loop

  def for_last(self) -> list[int]:
    """The leaves the last micro-batch reduces in its layer scan."""
    return sorted(self.watch.hits) if self.watch.seeds else []

  def added(self, new_grads: Any, grads: Any, totals: dict[int, Any] | None,
            keep: Any, lay: Any) -> Any:
    """``new_grads`` with each leaf a scan reduced (``totals``) replaced by
    the rest of its gradient (another use of the leaf in the loss), kept
    where the micro-batch counts: with a ``+0``, so that where that gradient
    is zero XLA sees the sum is, and drops its reduction
    (``token_weighting.weighted`` writes ``-0``)."""
    if not totals:
      return new_grads
    self.totals.update(totals)
    leaves, treedef = jax.tree.flatten(new_grads)
    parts = treedef.flatten_up_to(grads)
    for i in totals:
      rest = parts[i].astype(leaves[i].dtype).reshape(jnp.shape(leaves[i]))
      leaves[i] = lay.device_local(
          jnp.where(keep, rest, jnp.zeros([], leaves[i].dtype)))
    return treedef.unflatten(leaves)

  def per_leaf(self, n: int) -> list[Any] | None:
    """Each of the ``n`` leaves' reduced sum, or None; None without any."""
    return [self.totals.get(i) for i in range(n)] if self.totals else None


def watching(loss: Callable[..., Any], watch: Watch,
             leaves: list[int]) -> Callable[..., Any]:
  """``loss(params, *args)``, noting in ``watch`` which of the parameter
  leaves ``leaves`` (flattened indices) it hands to :func:`scan_layers`,
  and its value's dtype."""

  def watched(params, *args):
    table = Table({}, watch)
    seen = jax.tree.leaves(params)
    table.by_id = {id(seen[i]): (i, None) for i in leaves}
    with active(table):
      out = loss(params, *args)
    watch.seeds = watch.seeds and jnp.result_type(out[0]) in borrowing.SEEDS
    return out

  return watched


def differentiate(loss: Callable[..., Any], args: tuple[Any, ...],
                  params: Any, runs: dict[int, jax.Array],
                  c: token_weighting.Contribution,
                  reduce: Callable[..., jax.Array],
                  own_data: bool = False) -> Differentiated:
  """``loss(params, *args)`` (a value and its aux) differentiated, its
  scanned layers reduced.

  ``runs`` maps the index of each reducible parameter leaf (flattened) to
  this device's running sum of the earlier micro-batches; ``reduce(running,
  g, c)`` adds a gradient as ``c`` says and sums it over the data axes
  (``layout.Layout.sum_in_loop``). The loss (float32 or float64:
  :class:`Watch`) is differentiated with the seed ``c``'s weight: the
  gradient leaves the backward weighted, so that a leaf used only by the
  scan has a gradient XLA sees is zero, and drops its reduction (a zero
  multiplied by the weight after it would be reduced all the same).

  With ``own_data`` the micro-batch runs its own data, which may hold no
  tokens (its loss 0/0, dropped by the loop's select): differentiated in
  turn (a meta-gradient through the step), the result is what
  :mod:`empty_safe` gives, the layers' scan then ``lax.scan``.
  """
  if not own_data:
    out = _reduced(loss, args, params, runs, c, reduce)
  else:
    leaves, treedef = jax.tree.flatten(args)
    at = [i for i, x in enumerate(leaves) if empty_safe.is_array(x)]

    def with_arrays(arrays):  # other leaves (a function) stay static.
      full = list(leaves)
      for i, x in zip(at, arrays):
        full[i] = x
      return treedef.unflatten(full)

    out = _dropped_if_empty(
        lambda p, a, r, c: _reduced(loss, with_arrays(a), p, r, c, reduce),
        lambda keys, p, a, r, c: _safe(loss, with_arrays(a), p, r, c,
                                       reduce, keys),
        params, [leaves[i] for i in at], runs, c)
  value, rest, grads, totals = out
  return Differentiated(value, rest, grads, _weight_one(c), totals)


def _weight_one(c: token_weighting.Contribution
                ) -> token_weighting.Contribution:
  """``c`` for a gradient that left the backward weighted by its seed."""
  return c._replace(weight=jnp.ones([], c.weight.dtype))


def _reduced(loss, args, params, runs, c, reduce):
  """``(value, rest, grads, totals)``: :func:`differentiate`'s program."""
  table = Table(runs)
  probes = {i: jnp.zeros(jnp.shape(r), jnp.result_type(r),
                        out_sharding=_plain(r))
            for i, r in runs.items()}

  def with_table(p, probes):
    seen = jax.tree.leaves(p)
    table.by_id = {id(seen[i]): (i, probes[i]) for i in runs}
    with active(table):
      return loss(p, *args)

  value, vjp_fn, rest = jax.vjp(with_table, params, probes, has_aux=True)
  seed = borrowing.seed(c)  # the weight where the micro-batch counts.
  seed = axes.varying_like(seed.astype(jnp.result_type(value)), value)
  table.combine = lambda run, g: reduce(run, g, _weight_one(c))
  grads, totals = vjp_fn(seed)
  return value, rest, grads, {i: totals[i] for i in sorted(table.used)}


def _safe(loss, args, params, runs, c, reduce, keys):
  """:func:`_reduced`'s results computed as :mod:`empty_safe` does: where
  the micro-batch is dropped its loss has no derivative. Each of ``keys``
  is summed whole with its running sum, its rest zero."""
  (value, rest), grads = empty_safe.value_and_grad(loss, c.keep, params,
                                                   *args)
  seed = borrowing.seed(c)
  leaves, treedef = jax.tree.flatten(grads)
  leaves = [g * seed.astype(g.dtype) if is_float(g) else g for g in leaves]
  totals = {i: reduce(runs[i], leaves[i], _weight_one(c)) for i in keys}
  for i in keys:
    leaves[i] = axes.varying_like(jnp.zeros_like(leaves[i]), leaves[i])
  return value, rest, treedef.unflatten(leaves), totals


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _dropped_if_empty(program, safe, params, arrays, runs, c):
  """``program(params, arrays, runs, c)``; differentiated, ``safe``'s
  derivative (given the leaves ``program`` reduced in its scan)."""
  del safe
  return program(params, arrays, runs, c)


@_dropped_if_empty.defjvp
def _dropped_if_empty_jvp(program, safe, primals, tangents):
  out = _dropped_if_empty(program, safe, *primals)
  keys = sorted(out[3])
  _, dots = jax.jvp(functools.partial(safe, keys), primals, tangents)
  return out, dots


def _plain(x: Any) -> P | None:
  """``x``'s type's spec without its reduced and unreduced axes; None
  where its type names no mesh axes (manual ones: inside shard_map)."""
  spec = readers.full_spec(x)
  if not readers.spec_names(spec) and not getattr(spec, "unreduced", None):
    return None
  return P(*readers.partitions(spec))
