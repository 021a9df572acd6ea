"""Whether the user's own train step gives the full batch's update at any k.

Gradient accumulation is correct exactly when splitting a batch into more
micro-batches changes nothing but rounding. That is a property of the whole
step (the loss, what ``num_tokens`` counts, where clipping and the schedule
sit, how devices reduce), not of the library alone, so the check runs the
user's step: once per split, each from a copy of one state, then compares
the states leaf by leaf (``leaf_diffs``), checks the replicas on a mesh
(``replicas``), and names the likely mistake (``hints``).
"""

from collections.abc import Callable, Sequence
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._src.mesh import readers
from optax_accum._src.proving import hints
from optax_accum._src.proving import leaf_diffs
from optax_accum._src.proving import replicas as replicas_lib
from optax_accum._src.proving import state_leaves

LeafDiff = leaf_diffs.LeafDiff


class KInvarianceReport(NamedTuple):
  """What :func:`optax_accum.check_k_invariance` found.

  Attributes:
    ok: every compared leaf after each split is within its allowance of the
      reference split's (the first of ``num_microbatches``), no step raised,
      and every replicated leaf's copies agree.
    worst: the path of the leaf furthest outside (or, when ``ok``, closest
      to) its allowance; None where nothing was compared.
    hint: the likely cause when not ``ok`` (the shape of the difference:
      the update scaled by k or 1/k, a counter advanced per micro-step,
      micro-batches weighted by something other than what the loss divides
      by, a reduction missing); "" when ``ok``.
    num_microbatches: the splits run, the reference first.
    leaves: every comparison, worst first (:class:`LeafDiff` rows: path,
      split, largest difference, ``error``, ``allowed``, ...).
    ignored: the leaves not compared, each with why: named in ``ignore``, or
      split-dependent by design (oa.accumulate's running sums, a Flax
      optimizer's call counter, random streams).
    replicas: for each split run on a mesh, its :class:`ReplicaReport`.
    errors: for each split whose step raised, the exception's text.
  """

  ok: bool
  worst: str | None
  hint: str
  num_microbatches: tuple[int, ...]
  leaves: tuple[LeafDiff, ...]
  ignored: tuple[tuple[str, str], ...]
  replicas: dict[int, replicas_lib.ReplicaReport]
  errors: dict[int, str]

  def __str__(self) -> str:
    splits = " vs ".join(str(k) for k in self.num_microbatches)
    lines = [f"k-invariance ({splits} micro-batches):"
             f" {'ok' if self.ok else 'FAILED'}"]
    if self.hint:
      lines.append(f"hint: {self.hint}")
    lines += [f"k={k} raised: {text}" for k, text in self.errors.items()]
    if self.leaves:
      lines.append(f"{'leaf':<48} {'k':>3} {'max |diff|':>11}"
                   f" {'|diff|':>10} {'allowed':>10}  ok")
      shown = self.leaves[:20] + tuple(
          row for row in self.leaves[20:] if row.zero_gradient)
      lines += [f"{row.path[-48:]:<48} {row.num_microbatches:>3}"
                f" {row.max_abs:>11.3g} {row.error:>10.3g}"
                f" {row.allowed:>10.3g}  {_verdict(row)}"
                for row in shown]
      if len(self.leaves) > len(shown):
        lines.append(f"... and {len(self.leaves) - len(shown)} more leaves")
    lines += [str(report) for report in self.replicas.values()
              if not report.ok]
    lines += [f"ignored: {path} ({why})" for path, why in self.ignored]
    return "\n".join(lines)


def _verdict(row: LeafDiff) -> str:
  if row.zero_gradient:
    return "yes (a gradient of rounding noise, scaled by the optimizer)"
  return "yes" if row.ok else "NO"


def _check_splits(num_microbatches: Any) -> tuple[int, ...]:
  if isinstance(num_microbatches, (str, bytes)) or not isinstance(
      num_microbatches, Sequence):
    raise TypeError(
        "num_microbatches must be a sequence of at least two positive ints,"
        f" the reference split first (e.g. (1, 4)), got {num_microbatches!r}.")
  splits = tuple(num_microbatches)
  if len(splits) < 2 or len(set(splits)) != len(splits) or not all(
      isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1
      for k in splits):
    raise ValueError(
        "num_microbatches must hold at least two distinct positive ints, the"
        f" reference split first (e.g. (1, 4)), got {num_microbatches!r}.")
  return tuple(int(k) for k in splits)


def _run(make_step: Callable[[int], Any], k: int, state: Any,
         batch: Any) -> Any:
  """The state after one update with ``k`` micro-batches, from a copy."""
  step = make_step(k)
  return jax.block_until_ready(step(state_leaves.copied(state), batch))


def _on_mesh(state: Any) -> bool:
  return any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
             for x in jax.tree.leaves(state))


def _compare(k: int, start: dict, reference: dict, result: Any,
             skipped: list[str], rtol: float) -> list[LeafDiff] | str:
  """Every leaf of ``result`` against ``reference``; or what differs."""
  got = {leaf.path: leaf.value for leaf in state_leaves.leaves(result)}
  if missing := sorted(set(reference) ^ set(got)):
    return (f"with k={k} the step returned a state whose leaves differ from"
            f" the reference's: {missing[:5]} (make_step(k) must return a"
            " step that returns a state shaped like the one it was given).")
  leaves = {}
  for path, ref in reference.items():
    if (state_leaves.under(path, skipped)
        or not isinstance(ref, (jax.Array, np.ndarray, numbers.Number))
        or readers.unreduced_axes(ref)):
      continue  # skipped, not an array, or partial sums by design.
    res = got[path]
    if (getattr(res, "shape", ()), getattr(res, "dtype", None)) != (
        getattr(ref, "shape", ()), getattr(ref, "dtype", None)):
      return (f"with k={k} the leaf {path} came back as"
              f" {jax.typeof(res)}, not {jax.typeof(ref)} as with the"
              " reference split.")
    leaves[path] = (start[path], ref, res)
  return leaf_diffs.rounding_gradients(leaf_diffs.compare(k, leaves, rtol))


def _outcome_hint(errors: dict[int, str], mismatch: str | None,
                  reference_moved: bool, reference_k: int, unseen: str | None,
                  ignored: tuple) -> str:
  """The hint when the runs could not be compared at all, or showed nothing
  (``unseen``: updates within their dtype's rounding); "" otherwise."""
  if errors:
    k, text = next(iter(errors.items()))
    return (f"the step raised with k={k} ({text}); check_k_invariance calls"
            " make_step(k)(state, batch) and expects the state after exactly"
            " one optimizer update from the whole batch.")
  if mismatch:
    return mismatch
  hint = unseen or ""
  if not reference_moved:
    hint = hint or (
        f"the reference step (k={reference_k}) changed no floating-point"
        " leaf, so nothing was shown: it made no update (num_tokens that"
        " count nothing, a cycle longer than the micro-batches fed, or a"
        " step that returns the state it was given).")
    if named := [path for path, why in ignored if why == "named in ignore"]:
      hint += (" Or ignore= skips the leaves it changes (it skips"
               f" {', '.join(named[:5])}).")
  return hint


def check_k_invariance(
    make_step: Callable[[int], Callable[[Any, Any], Any]],
    state: Any,
    batch: Any,
    num_microbatches: Sequence[int] = (1, 4),
    *,
    ignore: Sequence[str] = (),
    rtol: float = leaf_diffs.RTOL,
) -> KInvarianceReport:
  """Whether the user's train step gives the full batch's update at any k.

  Runs ``make_step(k)(state, batch)`` once for each ``k`` in
  ``num_microbatches``, each from its own copy of ``state`` (nothing is
  donated or changed), and compares every leaf of the states they return
  with the first split's, the reference. A correct step differs only in
  float32 rounding; a floating leaf passes when

    ``||x_k - x_ref|| <= rtol * ||x_ref - x_0|| + 4 * eps * ||x_ref||``

  (``x_0`` the leaf given, ``eps`` its dtype's; ``rtol`` defaults to
  ``sqrt(float32 eps)``, about 3.5e-4), integer leaves must be equal. On a
  mesh, every replicated leaf must also hold the same values on each device
  (:func:`check_replicas`). When a step is not k-invariant, ``hint`` names
  the likely cause. A wrong step is reported, never raised.

  The batch should have uneven token counts across the micro-batches
  (sequences of different lengths): with equal counts a mean of
  micro-batch means is exact too, and the check cannot tell. Nor can it
  where every update is within the rounding of bfloat16 or float16
  parameters (SGD with a small step): the report says so, not ``ok``.

  Args:
    make_step: ``make_step(k)`` returns ``step(state, batch) -> state`` that
      makes exactly one optimizer update from ``batch``, split into ``k``
      micro-batches the way the user's code splits it: one call of a step
      built on ``oa.value_and_grad(..., num_microbatches=k)``, or ``k``
      calls of a per-call step with ``oa.accumulate(..., every_k=k)``.
    state: any pytree the step takes and returns (parameters, optimizer
      state, model state; Flax NNX modules and optimizers), on one device
      or on a mesh.
    batch: the batch of one update.
    num_microbatches: the splits to run, the reference first.
    ignore: leaves that depend on the split by design (BatchNorm
      statistics, an MoE's dropped tokens), by their paths as
      ``jax.tree_util.keystr`` writes them; a path names its subtree.
    rtol: the allowance relative to each leaf's update.

  Returns:
    A :class:`KInvarianceReport`; ``print`` it for a table.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_accum as oa
    >>> def loss_fn(w, mb):  # a mean over each micro-batch's tokens.
    ...   return (mb['mask'] * (mb['x'] @ w) ** 2).sum() / mb['mask'].sum()
    >>> def make_step(k):
    ...   grad_fn = oa.value_and_grad(
    ...       loss_fn, num_microbatches=k,
    ...       num_tokens_fn=lambda mb: mb['mask'].sum())
    ...   def step(state, batch):
    ...     w, opt_state = state
    ...     _, g = grad_fn(w, batch)
    ...     updates, opt_state = optax.sgd(0.1).update(g, opt_state, w)
    ...     return optax.apply_updates(w, updates), opt_state
    ...   return jax.jit(step)
    >>> mask = (jnp.arange(4)[None, :] < jnp.array([[1], [4], [2], [3]]))
    >>> batch = {'x': jnp.ones((4, 4, 3)), 'mask': mask.astype(jnp.float32)}
    >>> w = jnp.ones(3)
    >>> oa.check_k_invariance(make_step, (w, optax.sgd(0.1).init(w)),
    ...                       batch).ok
    True
  """
  if not callable(make_step):
    raise TypeError("make_step must be a function of k returning"
                    f" step(state, batch) -> state, got {make_step!r}.")
  splits = _check_splits(num_microbatches)
  if not (isinstance(rtol, numbers.Real) and rtol >= 0):
    raise ValueError(f"rtol must be a non-negative number, got {rtol!r}.")
  ignore = state_leaves.check_ignore(ignore, state)
  start = {leaf.path: leaf.value for leaf in state_leaves.leaves(state)}
  results, errors = {}, {}
  for k in splits:
    try:
      results[k] = _run(make_step, k, state, batch)
    except Exception as e:  # pylint: disable=broad-except
      errors[k] = f"{type(e).__name__}: {e}"
  by_design = state_leaves.by_design(state)
  ignored = tuple([(p, "named in ignore") for p in ignore]
                  + sorted(by_design.items()))
  skipped = list(ignore) + list(by_design)
  compared, mismatch = _compare_all(splits, start, results, skipped, rtol)
  return _report(splits, results, errors, ignored, compared, mismatch)


def _compare_all(splits: tuple[int, ...], start: dict, results: dict,
                 skipped: list[str], rtol: float) -> tuple[dict, str | None]:
  """Each split's leaves against the reference's, or what differs."""
  compared, mismatch = {}, None
  if splits[0] not in results:
    return compared, mismatch
  reference = {leaf.path: leaf.value
               for leaf in state_leaves.leaves(results[splits[0]])}
  if unusable := _unusable_reference(splits[0], start, reference, skipped):
    return compared, unusable
  for k in splits[1:]:
    if k in results:
      rows = _compare(k, start, reference, results[k], skipped, rtol)
      if isinstance(rows, str):
        mismatch = mismatch or rows
      else:
        compared[k] = rows
  return compared, mismatch


def _unusable_reference(k: int, start: dict, reference: dict,
                        skipped: list[str]) -> str | None:
  """Why the reference split's state cannot be compared, or None: it is
  not shaped like the state given (a ``(state, metrics)`` pair), or its
  update made a leaf NaN or infinite."""
  if differ := sorted(set(start) ^ set(reference)):
    return (f"with k={k} the step returned a pytree whose leaves differ from"
            f" the state it was given: {', '.join(differ[:5])} (make_step(k)"
            " must return a step that returns the state alone, shaped like"
            " the one given: return metrics such as the loss some other"
            " way).")
  if reshaped := _reshaped(start, reference, skipped):
    path, given, got = reshaped
    return (f"with k={k} the step returned the leaf {path} as {got}, not"
            f" {given} as given: make_step(k) must return a step that"
            " returns a state shaped like the one it was given.")
  bad = [path for path, ref in reference.items()
         if not state_leaves.under(path, skipped) and _float(ref)
         and not readers.unreduced_axes(ref)
         and _float(start[path]) and not bool(jnp.isfinite(ref).all())
         and bool(jnp.isfinite(start[path]).all())]
  if bad:
    return (f"the reference step (k={k}) made {', '.join(bad[:5])}"
            " non-finite, so nothing can be compared: a gradient or loss is"
            " NaN or infinite on this batch (a mean over zero tokens is 0/0:"
            " divide by jnp.maximum(count, 1);"
            " oa.accumulate(..., skip_nonfinite=True) drops such micro-steps),"
            " or the update overflows.")
  return None


def _reshaped(start: dict, reference: dict,
              skipped: list[str]) -> tuple[str, Any, Any] | None:
  """The first array leaf the reference split returned in another shape
  than the state's: ``(path, given type, returned type)``. (Not another
  dtype: a jitted step returns a float64 NumPy leaf as float32.)"""
  arrays = (jax.Array, np.ndarray)
  for path, ref in reference.items():
    given = start[path]
    if (state_leaves.under(path, skipped) or not isinstance(ref, arrays)
        or not isinstance(given, arrays)):
      continue
    if ref.shape != given.shape:
      return path, jax.typeof(given), jax.typeof(ref)
  return None


def _float(x: Any) -> bool:
  return (isinstance(x, (jax.Array, np.ndarray))
          and jnp.issubdtype(x.dtype, jnp.inexact))


def _report(splits: tuple[int, ...], results: dict, errors: dict,
            ignored: tuple, compared: dict,
            mismatch: str | None) -> KInvarianceReport:
  """The verdict, the worst leaf and the hint."""
  reference_k = splits[0]
  replicas = {k: replicas_lib.check_replicas(result)
              for k, result in results.items() if _on_mesh(result)}
  rows = sorted((row for rows in compared.values() for row in rows),
                key=lambda row: -row.excess)
  moved = any(row.update > 0 and row.allowed > 0 for row in rows)
  # oa.accumulate's float count of tokens moves however small the update.
  counted = state_leaves.field_paths(results.get(reference_k), ("tokens_seen",))
  unseen = hints.below_rounding(
      [row for row in rows if not state_leaves.under(row.path, counted)])
  hint = _outcome_hint(errors, mismatch, moved, reference_k, unseen, ignored)
  if not hint and rows:
    hint = hints.unapplied(
        next(iter(compared.values())),
        state_leaves.accumulate_paths(results[reference_k])) or ""
  differing = {k: report.worst[0] for k, report in replicas.items()
               if not report.ok}
  ok = (not hint and all(row.ok for row in rows) and not differing)
  if not hint and not ok:
    hint = hints.hint(compared, {k: k / reference_k for k in compared},
                      differing)
  return KInvarianceReport(
      ok=ok, worst=rows[0].path if rows else None, hint=hint,
      num_microbatches=splits, leaves=tuple(rows), ignored=ignored,
      replicas=replicas, errors=errors)
