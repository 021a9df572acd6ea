"""The likely cause of a step that is not k-invariant, from the shape of the
difference.

Each mistake that users make at the seam between their step and gradient
accumulation leaves a shape of its own in the states after one update with
the reference split and with ``k`` micro-batches: the update scaled by
``k`` (a division missing) or by ``1/k`` (done twice), a counter advanced
``k`` times (a schedule stepping per micro-step), no update at all (a cycle
that never completes, or no tokens), replicas that differ (a reduction
missing), or a difference of no simple shape (micro-batches weighted by
something other than what the loss divides by). The first shape found, in
that order of certainty, names the hint.
"""

import math
import re
from typing import NamedTuple

from optax_accum._src.proving import leaf_diffs

LeafDiff = leaf_diffs.LeafDiff

_STATISTIC = re.compile(r"batch_stats|batchnorm|running|moving|\bmean\b|"
                        r"\bvar\b|['.]mean['.\]]|['.]var['.\]]", re.I)


def _near(value: float, target: float) -> bool:
  return math.isfinite(value) and abs(value - target) <= 1e-6 * abs(target)


def _paths(rows: list[LeafDiff], most: int = 3) -> str:
  names = [row.path for row in rows[:most]]
  return ", ".join(names) + (", ..." if len(rows) > most else "")


def no_update(rows: list[LeafDiff], k: int) -> str | None:
  """When the run with ``k`` changed none of the leaves the reference did."""
  moved = [row for row in rows if row.update > 0 and row.allowed > 0]
  if moved and all(row.clean_scale and row.scale == 0 for row in moved):
    return (
        f"with k={k} the step made no update (no leaf that the reference"
        " changed moved): the step must make exactly one optimizer update"
        f" from the batch, so make_step({k}) must build oa.accumulate(...,"
        f" every_k={k}) and feed it all {k} micro-batches, and num_tokens"
        " must count each micro-batch's tokens (micro-steps that all bring"
        " zero tokens make no update).")
  return None


def below_rounding(rows: list[LeafDiff]) -> str | None:
  """When no floating leaf's update outgrows its own rounding, and some are
  bfloat16 or float16: the comparison could not see a mistake."""
  floats = [row for row in rows if row.allowed > 0]  # integers allow none.
  if not floats or any(row.update > row.rounding for row in floats):
    return None
  coarse = [row for row in floats if row.low_precision]
  if not coarse:
    return None
  return (
      f"the update of {_paths(coarse)} is within the rounding of its dtype"
      " (its spacing near the values it holds), and no leaf's update is"
      " larger than its own rounding: a step scaled wrong, or one that"
      " rounds every update away, would look the same, so nothing was"
      " shown. Check a float32 copy of the state (cast its floating leaves"
      " with x.astype(jnp.float32)), or a larger learning rate.")


def unapplied(rows: list[LeafDiff], optimizer_states: list[str]) -> str | None:
  """When oa.accumulate emitted an update but no other leaf moved."""
  counts = {f"{path}.count" for path in optimizer_states}
  emitted = any(row.path in counts and row.update > 0 for row in rows)
  outside = [row for row in rows if row.allowed > 0 or row.update > 0
             if not any(row.path.startswith(p) for p in optimizer_states)]
  if emitted and outside and all(row.update == 0 for row in outside):
    return (
        "oa.accumulate emitted an update (its count advanced) but no"
        " parameter moved: the updates were not applied. oa.apply_if_updated"
        " takes the state that the same tx.update call returned, not the"
        " one passed into it; oa.update_and_apply needs no pairing.")
  return None


def _counter(rows: list[LeafDiff], ratio: float) -> str | None:
  counters = [row for row in rows if row.allowed == 0]
  if not counters:
    return None
  stepped = [row for row in counters if _near(row.scale, ratio)]
  if stepped:
    return (
        f"the counter {_paths(stepped)} advanced once per micro-step, not"
        " once per update: a learning-rate schedule, weight decay or"
        " optimizer runs outside oa.accumulate, or the step updates on"
        " every micro-batch. Put the whole optimizer inside:"
        " oa.accumulate(optax.chain(...), every_k=k).")
  return (f"the integer leaves {_paths(counters)} differ between the splits:"
          " a count that depends on how the batch is split (name it in"
          " ignore= if that is by design).")


class _Fit(NamedTuple):
  """A family of leaves' changes fitted as ``u_k = scale * u_ref``."""

  paths: str
  scale: float
  residual: float  # ||u_k - scale * u_ref|| / ||u_k|| over the family.


def _fits(rows: list[LeafDiff]) -> list[_Fit]:
  """One fit per family of floating leaves (the leaves of one subtree: the
  parameters, Adam's first moments, its second), from each leaf's norms."""
  families: dict[str, list[LeafDiff]] = {}
  for row in rows:
    if row.allowed > 0 and row.update > 0:
      families.setdefault(row.path.rpartition("[")[0], []).append(row)
  fits = []
  for family in families.values():
    ref2 = sum(row.update**2 for row in family)
    cross = sum(row.scale * row.update**2 for row in family)
    # ||u_k||^2 = ||u_k - u_ref||^2 + 2 <u_k - u_ref, u_ref> + ||u_ref||^2.
    own2 = sum(row.error**2 + (2 * row.scale - 1) * row.update**2
               for row in family)
    scale = cross / ref2
    left = max(own2 - cross**2 / ref2, 0.0)
    fits.append(_Fit(_paths(family), scale,
                     math.sqrt(left / own2) if own2 > 0 else 0.0))
  return fits


def _near_power(fit: _Fit, ratio: float) -> bool:
  """A fit of about ``ratio`` or ``ratio**2`` (Adam's second moment)."""
  return fit.residual < 0.5 and any(
      abs(fit.scale - t) <= 0.2 * t for t in (ratio, ratio**2))


def _scaled(rows: list[LeafDiff], ratio: float) -> str | None:
  """The update scaled by about ``ratio`` or ``1/ratio`` in some family of
  leaves, or, in every leaf, by one other constant."""
  fits = _fits(rows)
  if scaled := [fit for fit in fits if _near_power(fit, ratio)]:
    return (
        f"the update is about {ratio:g} times the reference's"
        f" ({scaled[0].paths}): a division is missing. loss_reduction='sum'"
        " is for a loss that sums its tokens; a loss that already divides"
        " by its tokens wants the default 'mean' with num_tokens, and"
        " gradients summed over micro-batches by hand must be divided by"
        " the total.")
  if shrunk := [fit for fit in fits if _near_power(fit, 1 / ratio)]:
    return (
        f"the update is about 1/{ratio:g} of the reference's"
        f" ({shrunk[0].paths}): the division is done twice. oa.accumulate"
        " and oa.value_and_grad already divide by the total tokens: do not"
        " divide the loss or the gradients by the number of micro-batches"
        " as well.")
  if fits and all(fit.residual < 1e-2 for fit in fits) and len(
      {round(fit.scale, 3) for fit in fits}) == 1:
    return (f"the update is {fits[0].scale:.4g} times the reference's"
            f" ({fits[0].paths}): each micro-batch's weight is off by a"
            " constant factor; check what num_tokens counts.")
  return None


_WEIGHTING = (
    "the micro-batches are weighted by something other than what the loss"
    " divides by. num_tokens (num_tokens_fn) must count what the loss's"
    " mean divides by: its tokens for a mean over tokens; its examples, or"
    " equal_weights=True, for a loss normalised per example and then"
    " averaged over examples (a mean of micro-batch means is exact only"
    " when the counts are equal). The same shape comes from a transformation"
    " of each micro-batch's gradient before oa.accumulate (clipping belongs"
    " inside it), a lax.pmean of the gradient beside accumulate's axis_name"
    " (a mean of device means), a layer or loss that couples the examples"
    " of a batch (BatchNorm in training normalises each micro-batch by its"
    " own statistics; in-batch negatives want oa.coupled_value_and_grad),"
    " or randomness such as dropout drawn differently for each split"
    " (check with it off).")


def hint(compared: dict[int, list[LeafDiff]], ratios: dict[int, float],
         replicas: dict[int, str]) -> str:
  """One sentence naming the likely cause of the failing leaves.

  Args:
    compared: for each split ``k`` other than the reference, every leaf
      compared.
    ratios: for each ``k``, ``k`` over the reference's number of
      micro-batches.
    replicas: for each split whose replicas differ, the worst leaf's path.
  """
  for k, rows in compared.items():
    if stalled := no_update(rows, k):
      return stalled
  failures = {k: sorted((row for row in rows if not row.ok),
                        key=lambda row: -row.excess)
              for k, rows in compared.items()}
  failures = {k: rows for k, rows in failures.items() if rows}
  for k, rows in failures.items():
    if nonfinite := [row for row in rows if row.nonfinite]:
      return (
          f"with k={k} the update made {_paths(nonfinite)} non-finite: a"
          " micro-batch's gradient or loss is NaN or infinite (a mean over"
          " zero tokens is 0/0: divide by jnp.maximum(count, 1));"
          " oa.accumulate(..., skip_nonfinite=True) drops such micro-steps.")
  for k, path in replicas.items():
    return (
        f"after the update with k={k} the copies of {path} differ between"
        " the devices that hold it: its gradient was not reduced over them"
        " (under pmap or shard_map give oa.accumulate axis_name=, or psum"
        " the gradient), so each device applied its own update.")
  rows = [row for rows in failures.values() for row in rows]
  if rows and all(_STATISTIC.search(row.path) for row in rows):
    return (
        f"only {_paths(rows)} differ: statistics of the batch (BatchNorm's"
        " running mean and variance) depend on how it is split. If that is"
        " by design, name them in ignore=.")
  for k, rows in failures.items():
    for found in (_counter(rows, ratios[k]), _scaled(rows, ratios[k])):
      if found:
        return found
  return _WEIGHTING
