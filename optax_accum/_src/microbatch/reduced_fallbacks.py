"""Parameters that JAX cannot type ``reduced`` in the model as written.

JAX refuses a ``reduced`` operand in an elementwise operation with an operand
sharded over the same axes (``x + bias``, ``x * scale``, ``out +=
pos_embed`` on batch-sharded activations: "Inputs cannot be sharded/varying
on the same axes that another input is reduced on"), and some operations
have no rule for reduced operands at all (``jnp.take`` in jax 0.10). The
typed loop keeps such a parameter replicated: exact, its gradient reduced by
JAX inside the loop, for each micro-batch.

:func:`find` finds them from the model as written, by tracing (never
running) the loop with subsets of the parameters reduced: a binary search
over prefixes of the leaves finds each leaf whose cast makes the trace fail,
``O(m log n)`` traces for ``m`` such leaves among ``n``. The runner calls it
only when the trace with every leaf reduced fails, so a model without such
leaves is traced once, as without this module.

:class:`Report` says which leaves they are and what the fallback costs: their
bytes, reduced in each micro-batch rather than once per call; and which
leaves ``param_specs=`` keeps whole over the data axes (those that
:func:`optax_accum.zero_specs` cannot shard, such as a bias of odd length):
all-reduced, not reduce-scattered. The runner
warns once per set of leaves where that cost is not small (:data:`WARN_ABOVE`),
and :func:`optax_accum.sharding_report` gives the report of a call on request,
small or not. The fix that needs no rewrite of Flax's or Equinox's layers is
:func:`optax_accum.reducible_layers` (:mod:`reducible_layers`).

The casts that JAX accepts and XLA compiles wrongly are refused before the
search by :mod:`cast_checks`.
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import contextvars
import math
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from optax_accum._src import caller_warnings
from optax_accum._src.microbatch import cast_checks

# The share of one whole-gradient reduction above which the fallback warns:
# the bytes the fallback leaves add to a call's all-reduces (their gradient
# reduced in every micro-batch but one, or in every deferred call), as a
# share of the gradient's bytes. Below it the first trace is quiet and
# oa.sharding_report still lists the leaves.
WARN_ABOVE = 0.1

# How to type such leaves reduced without rewriting a library's layers.
FIX_HINT = (
    "To have them reduced once without rewriting your layers, call"
    " oa.reducible_layers(model) before splitting the model: it swaps Flax"
    " NNX's and Equinox's Linear and LayerNorm for subclasses whose bias add"
    " and scale JAX types reduced. In your own code, write x + bias as"
    " oa.add_bias(x, bias) and x * scale as oa.multiply_scale(x, scale) (a"
    " jnp.einsum('...d,d->...d', x, scale), which JAX types)."
)


def _size(nbytes: float) -> str:
  for unit in ("bytes", "KiB", "MiB", "GiB"):
    if nbytes < 1024 or unit == "GiB":
      return f"{nbytes:.0f} {unit}" if unit == "bytes" else (
          f"{nbytes:.1f} {unit}")
    nbytes /= 1024
  return f"{nbytes:.1f} GiB"


class Report(NamedTuple):
  """How one traced call of the typed loop holds its parameters.

  Attributes:
    data_axes: the mesh axes the gradient is reduced over, once.
    fallback_leaves: the paths of the parameter leaves kept replicated,
      whose gradient JAX reduces in each micro-batch.
    fallback_bytes: their gradient's bytes (in the parameters' dtypes).
    total_bytes: the whole gradient's bytes.
    seconds: the time spent finding them at trace time (0 without them).
    num_microbatches: the call's micro-batches: how many times the fallback
      leaves' gradient is reduced in one call.
    deferred: whether the call defers the rest of the gradient's reduction
      (``gradient_sync="deferred"``): the fallback leaves are then reduced in
      every call, the rest once per update.
    whole_leaves: the paths of the parameter leaves that ``param_specs=``
      keeps whole over the data axes (with :func:`optax_accum.zero_specs`,
      those with no dimension that the data size divides: biases, norms,
      odd vocabularies): their gradient is all-reduced rather than
      reduce-scattered, and their optimizer state is whole on every device.
      Empty without ``param_specs=``.
    whole_bytes: their gradient's bytes.
  """

  data_axes: tuple[str, ...]
  fallback_leaves: tuple[str, ...]
  fallback_bytes: int
  total_bytes: int
  seconds: float
  num_microbatches: int = 1
  deferred: bool = False
  whole_leaves: tuple[str, ...] = ()
  whole_bytes: int = 0

  @property
  def fallback_share(self) -> float:
    """The fallback leaves' share of the gradient's bytes."""
    return self.fallback_bytes / max(self.total_bytes, 1)

  @property
  def reduced_bytes_per_call(self) -> int:
    """The bytes of the fallback leaves' gradient all-reduced in one call:
    once per micro-batch."""
    return self.fallback_bytes * self.num_microbatches

  @property
  def extra_share(self) -> float:
    """What the fallback adds to a call's all-reduces, as a share of the
    gradient's bytes: its leaves reduced ``num_microbatches - 1`` times more
    than once (in a deferred call, once where none would be)."""
    extra = 1 if self.deferred else self.num_microbatches - 1
    return extra * self.fallback_share

  @property
  def warns(self) -> bool:
    """Whether the first trace warns: :attr:`extra_share` above
    :data:`WARN_ABOVE`."""
    return bool(self.fallback_leaves) and self.extra_share > WARN_ABOVE

  def message(self) -> str:
    """The report in words."""
    return self._fallback_message() + self._whole_message()

  def _whole_message(self) -> str:
    """The leaves kept whole over the data axes in words, if any."""
    if not self.whole_leaves:
      return ""
    once = "once per update"
    if set(self.whole_leaves) & set(self.fallback_leaves):
      once += " (the fallback leaves among them as said above)"
    return (
        f" param_specs= keeps {len(self.whole_leaves)} parameter leaves"
        f" whole over {list(self.data_axes)} (no dimension of theirs is"
        " sharded over them; with oa.zero_specs, none that the data size"
        f" divides): {', '.join(self.whole_leaves)}"
        f" ({_size(self.whole_bytes)},"
        f" {self.whole_bytes / max(self.total_bytes, 1):.2%} of the"
        f" gradient's bytes); their gradient is all-reduced {once} rather"
        " than reduce-scattered, and their optimizer state is held"
        " whole on every device."
    )

  def _fallback_message(self) -> str:
    """The fallback leaves in words, or that there are none."""
    if not self.fallback_leaves:
      return (
          "Every parameter is typed reduced over"
          f" {list(self.data_axes)}: the gradient is reduced once per call,"
          " after the micro-batch loop."
      )
    if self.deferred:
      cost = (
          "JAX all-reduces their gradient in every call"
          f" ({_size(self.fallback_bytes)} per call), where the rest of the"
          " gradient stays unreduced until the update"
      )
    else:
      cost = (
          "JAX all-reduces their gradient inside the loop, in each of the"
          f" {self.num_microbatches} micro-batches"
          f" ({_size(self.reduced_bytes_per_call)} per call where once would"
          f" be {_size(self.fallback_bytes)}), the rest of the gradient once"
          " after it"
      )
    return (
        f"{len(self.fallback_leaves)} parameter leaves cannot be typed"
        f" reduced over {list(self.data_axes)} in the model as written"
        f" ({_size(self.fallback_bytes)}, {self.fallback_share:.2%} of the"
        f" gradient's bytes): {', '.join(self.fallback_leaves)}. They stay"
        f" replicated and exact, but {cost}: {self.extra_share:.1%} more"
        " bytes all-reduced than one reduction of the gradient. XLA's CPU"
        " backend keeps these reductions in the loop; its TPU compiler was"
        " seen to move them out of it by itself. The first trace warns only"
        f" above {WARN_ABOVE:.0%}; oa.sharding_report lists them always."
        f" {FIX_HINT}"
    )


def _nbytes(leaf: Any) -> int:
  return math.prod(jnp.shape(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize


def check_attempt(attempt: Callable[[frozenset[int]], Any],
          reduced: frozenset[int]) -> None:
  """Traces ``attempt(reduced)`` without running it and checks its casts:
  raises if it fails to trace or would not compile right."""
  traced = jax.make_jaxpr(lambda: attempt(reduced) and None)()
  cast_checks.check_casts(traced.jaxpr)


def traces(attempt: Callable[[frozenset[int]], Any],
           reduced: frozenset[int]) -> bool:
  """Whether ``attempt(reduced)`` traces (into a jaxpr, nothing bound)."""
  try:
    check_attempt(attempt, reduced)
  except Exception:  # any refusal of the cast counts.
    return False
  return True


def find(attempt: Callable[[frozenset[int]], Any],
         candidates: list[int]) -> list[int]:
  """The candidates that cannot be typed reduced, by tracing ``attempt``.

  ``attempt(reduced)`` traces the loop with the leaves ``reduced`` cast.
  Raises the loop's own error if it fails with none of them reduced.
  """
  if not traces(attempt, frozenset()):
    check_attempt(attempt, frozenset())  # raises the model's own error.
  bad: list[int] = []
  good_upto = 0  # candidates[:good_upto] minus bad trace together.
  while True:
    kept = [c for c in candidates if c not in bad]
    if traces(attempt, frozenset(kept)):
      return bad
    # The shortest prefix of candidates whose cast fails ends with a leaf
    # that cannot be cast (with the ones before it).
    low, high = good_upto, len(candidates)
    while high - low > 1:
      mid = (low + high) // 2
      prefix = frozenset(c for c in candidates[:mid] if c not in bad)
      if traces(attempt, prefix):
        low = mid
      else:
        high = mid
    bad.append(candidates[high - 1])
    good_upto = high


def report(params: Any, fallback: list[int], data_axes: tuple[str, ...],
           seconds: float, num_microbatches: int = 1,
           deferred: bool = False, whole: Sequence[int] = ()) -> Report:
  """The :class:`Report` of leaves ``fallback`` of ``params``, with leaves
  ``whole`` kept whole over the data axes by ``param_specs=``."""
  leaves = jax.tree_util.tree_leaves_with_path(params)

  def paths(indices: Sequence[int]) -> tuple[str, ...]:
    return tuple(
        f"params{jax.tree_util.keystr(leaves[i][0])}" for i in indices)

  def nbytes(indices: Sequence[int]) -> int:
    return sum(_nbytes(leaves[i][1]) for i in indices)

  return Report(
      data_axes=data_axes,
      fallback_leaves=paths(fallback),
      fallback_bytes=nbytes(fallback),
      total_bytes=sum(_nbytes(leaf) for _, leaf in leaves),
      seconds=seconds,
      num_microbatches=num_microbatches,
      deferred=deferred,
      whole_leaves=paths(whole),
      whole_bytes=nbytes(whole),
  )


_collected: contextvars.ContextVar[list[Report] | None] = (
    contextvars.ContextVar("optax_accum_sharding_reports", default=None))
_warned: set[tuple[str, ...]] = set()
# publish runs only while a loop is traced, and jax.jit's caches skip the
# trace of a step called (or reported on) before. This context is part of
# their keys: a new value in each sharding_report makes every jit inside
# trace again, where jax.clear_caches would drop the step's compiled calls
# too. Each report leaves one trace per jit in the caches.
_report_trace = jax.make_user_context(None)


def publish(found: Report) -> None:
  """Hands a traced call's report to :func:`collecting`, or warns once
  per set of leaves where :attr:`Report.warns`."""
  reports = _collected.get()
  if reports is not None:
    reports.append(found)
    return
  if found.warns and found.fallback_leaves not in _warned:
    _warned.add(found.fallback_leaves)
    caller_warnings.warn(found.message(), UserWarning)


@contextlib.contextmanager
def collecting() -> Iterator[list[Report]]:
  """Collects the reports of the typed loops traced inside, without warning."""
  reports: list[Report] = []
  token = _collected.set(reports)
  try:
    yield reports
  finally:
    _collected.reset(token)


def sharding_report(fn: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Report:
  """Which parameters the typed micro-batch loop keeps replicated, and why.

  Under :func:`jax.jit` with Explicit data axes,
  :func:`optax_accum.value_and_grad` (and
  :func:`optax_accum.coupled_value_and_grad`) type the parameters
  ``reduced`` over the data axes, so that the gradient is reduced once,
  after the micro-batch loop. A parameter that the model uses elementwise
  with batch-sharded activations (``x + bias``, ``x * scale``) cannot be
  typed so; it stays replicated, exact, and JAX reduces its gradient in
  every micro-batch. The first trace warns once where that adds more than
  :data:`WARN_ABOVE` (10%) of the gradient's bytes to the call's
  reductions; this traces ``fn`` (never runs it) and returns the report,
  whatever the cost, also for a step that has already run (its jits trace
  again, their cached traces for the step's calls kept).
  :func:`optax_accum.reducible_layers` removes the fallback of Flax's and
  Equinox's Linear and LayerNorm layers.

  Args:
    fn: a function that calls an optax_accum entry point: the function it
      returns, or a train step around it (jitted or not, run or not).
    *args: the arguments to trace ``fn`` with (arrays or
      :class:`jax.ShapeDtypeStruct`, carrying their shardings); call this
      under the same :func:`jax.set_mesh` as ``fn``.
    **kwargs: its keyword arguments (``rng=`` and so on).

  Returns:
    The :class:`Report` of the last typed loop that ``fn`` traced:
    ``fallback_leaves`` (their paths), ``fallback_bytes`` and
    ``fallback_share`` of the gradient's bytes, ``reduced_bytes_per_call``
    (once per micro-batch), ``extra_share`` (what that adds to one
    reduction of the gradient), ``warns``, ``whole_leaves`` and
    ``whole_bytes`` (the leaves that ``param_specs=`` keeps whole over the
    data axes, e.g. those :func:`optax_accum.zero_specs` cannot shard), and
    ``message()``.

  Raises:
    ValueError: if ``fn`` traced no typed loop (no Explicit data axes).

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((2,), ('data',), axis_types=(AxisType.Explicit,),
    ...                      devices=jax.devices()[:2])
    >>> def loss_fn(params, mb):
    ...   h = jnp.einsum('bi,io->bo', mb['x'], params['w'],
    ...                  out_sharding=P('data', None))
    ...   return jnp.mean((h + params['b']) ** 2)  # the bias: elementwise
    >>> fn = oa.value_and_grad(loss_fn, num_microbatches=2, axis_name='data',
    ...                        equal_weights=True)
    >>> with jax.set_mesh(mesh):
    ...   params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}
    ...   batch = {'x': jax.device_put(jnp.ones((4, 3)), P('data'))}
    ...   report = oa.sharding_report(fn, params, batch)
    >>> report.fallback_leaves
    ("params['b']",)
    >>> report.reduced_bytes_per_call, f'{report.extra_share:.0%}', report.warns
    (16, '25%', True)
  """
  with _report_trace(object()), collecting() as reports:
    jax.eval_shape(fn, *args, **kwargs)
  if not reports:
    raise ValueError(
        f"fn={fn!r} traced no typed micro-batch loop: an optax_accum entry"
        " point types parameters reduced only under jax.jit with Explicit"
        " data axes (a batch sharded over them, or axis_name naming them)."
        " Call sharding_report under the same jax.set_mesh as the step, on"
        " a sharded batch."
    )
  return reports[-1]
