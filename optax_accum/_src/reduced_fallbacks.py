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

:class:`Report` says which leaves they are and their share of the gradient's
bytes; the runner warns once per set of leaves, and
:func:`optax_accum.sharding_report` gives the report of a call on request.
"""

from collections.abc import Callable, Iterator
import contextlib
import contextvars
import math
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from optax_accum._src import caller_warnings
from optax_accum._src import sharding

# How a parameter used elementwise with batch-sharded activations can be
# written so that JAX types it reduced: an einsum whose output sharding
# names the batch axes.
EINSUM_HINT = (
    "write its elementwise use so that JAX types it reduced: a scale as an"
    " einsum that names the batch axes, jnp.einsum('btd,d->btd', x, scale,"
    " out_sharding=P('data', None, None)); a bias or a positional embedding"
    " broadcast to the activations' sharding first, x +"
    " jax.lax.broadcast_in_dim(bias, x.shape, (x.ndim - 1,),"
    " out_sharding=jax.typeof(x).sharding.spec)"
)


class Report(NamedTuple):
  """How one traced call of the typed loop holds its parameters.

  Attributes:
    data_axes: the mesh axes the gradient is reduced over, once.
    fallback_leaves: the paths of the parameter leaves kept replicated,
      whose gradient JAX reduces for each micro-batch.
    fallback_bytes: their gradient's bytes (in the parameters' dtypes).
    total_bytes: the whole gradient's bytes.
    seconds: the time spent finding them at trace time (0 without them).
  """

  data_axes: tuple[str, ...]
  fallback_leaves: tuple[str, ...]
  fallback_bytes: int
  total_bytes: int
  seconds: float

  @property
  def fallback_share(self) -> float:
    """The fallback leaves' share of the gradient's bytes."""
    return self.fallback_bytes / max(self.total_bytes, 1)

  def message(self) -> str:
    """The report in words."""
    if not self.fallback_leaves:
      return (
          "Every parameter is typed reduced over"
          f" {list(self.data_axes)}: the gradient is reduced once per call,"
          " after the micro-batch loop."
      )
    return (
        f"{len(self.fallback_leaves)} parameter leaves cannot be typed"
        f" reduced over {list(self.data_axes)} in the model as written:"
        f" {', '.join(self.fallback_leaves)} ({self.fallback_share:.2%} of"
        " the gradient's bytes). They stay replicated and exact, but JAX"
        " reduces their gradient in every micro-batch, not once per call."
        f" To avoid it, {EINSUM_HINT}."
    )


def _nbytes(leaf: Any) -> int:
  return math.prod(jnp.shape(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize


class UnsafeCast(TypeError):
  """A cast that JAX accepts at trace time and XLA gets wrong."""


def _partitions(aval: Any) -> tuple[Any, ...]:
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  return () if spec is None else sharding.partitions(spec)


def _unreduced(aval: Any) -> frozenset[str]:
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  return frozenset(getattr(spec, "unreduced", None) or ())


def _sub_jaxprs(value: Any) -> list[Any]:
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jax.extend.core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  return []


def _literal(var: Any) -> Any:
  """The value of a jaxpr literal, or None for a variable."""
  return getattr(var, "val", None) if type(var).__name__ == "Literal" else None


def _scattered_dims(eqn: Any) -> tuple[int, ...]:
  """The operand dimensions a scatter-add indexes into (its rows)."""
  numbers = eqn.params.get("dimension_numbers")
  return tuple(getattr(numbers, "scatter_dims_to_operand_dims", ()) or ())


def _resharded_rows(producer: Any, source: Any, target: Any) -> bool:
  """Whether a scatter-add's rows get a new sharding in ``target``."""
  if producer is None or producer.primitive.name not in (
      "scatter-add", "scatter_add"):
    return False
  old, new = _partitions(source), _partitions(target)
  return any(d < len(new) and new[d] is not None
             and (d >= len(old) or old[d] != new[d])
             for d in _scattered_dims(producer))


def check_casts(jaxpr: Any) -> None:
  """Raises :class:`UnsafeCast` where XLA would compile a cast wrongly.

  Two reshards that make a replicated value ``unreduced``, which JAX
  accepts:

  * of a non-zero constant: autodiff writes one where a reduced parameter
    reaches the loss other than through the batch (``scale * mean(...)``:
    the loss is then typed reduced and the seed cotangent 1.0 is cast).
    XLA has been seen to give every device the value, so that the sum
    counts it once per device: silently wrong gradients;
  * of a scatter-add's result whose rows it shards anew (the cotangent of a
    gather from a table sharded over a model axis along its rows, read with
    an ``out_sharding`` that drops the batch axes): Shardy aborts the
    process ("the result has unreduced axes while the operand has
    incompatible sharding along reduction factors").
  """
  producers = {}
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      producers[id(var)] = eqn
    if eqn.primitive.name == "reshard":
      var = eqn.invars[0]
      source, target = var.aval, eqn.outvars[0].aval
      if _unreduced(target) and not _unreduced(source):
        constant = _literal(var)
        if ((constant is not None and bool(jnp.any(jnp.asarray(constant))))
            or _resharded_rows(producers.get(id(var)), source, target)):
          raise UnsafeCast(
              f"a reshard from {source} to {target} would not compile right")
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        check_casts(sub)


def check(attempt: Callable[[frozenset[int]], Any],
          reduced: frozenset[int]) -> None:
  """Traces ``attempt(reduced)`` without running it and checks its casts:
  raises if it fails to trace or would not compile right."""
  check_casts(jax.make_jaxpr(lambda: attempt(reduced) and None)().jaxpr)


def _traces(attempt: Callable[[frozenset[int]], Any],
            reduced: frozenset[int]) -> bool:
  try:
    check(attempt, reduced)
  except Exception:  # any refusal of the cast counts.
    return False
  return True


def find(attempt: Callable[[frozenset[int]], Any],
         candidates: list[int]) -> list[int]:
  """The candidates that cannot be typed reduced, by tracing ``attempt``.

  ``attempt(reduced)`` traces the loop with the leaves ``reduced`` cast.
  Raises the loop's own error if it fails with none of them reduced.
  """
  if not _traces(attempt, frozenset()):
    check(attempt, frozenset())  # raises the model's own error.
  bad: list[int] = []
  good_upto = 0  # candidates[:good_upto] minus bad trace together.
  while True:
    kept = [c for c in candidates if c not in bad]
    if _traces(attempt, frozenset(kept)):
      return bad
    # The shortest prefix of candidates whose cast fails ends with a leaf
    # that cannot be cast (with the ones before it).
    low, high = good_upto, len(candidates)
    while high - low > 1:
      mid = (low + high) // 2
      prefix = frozenset(c for c in candidates[:mid] if c not in bad)
      if _traces(attempt, prefix):
        low = mid
      else:
        high = mid
    bad.append(candidates[high - 1])
    good_upto = high


def report(params: Any, fallback: list[int], data_axes: tuple[str, ...],
           seconds: float) -> Report:
  """The :class:`Report` of leaves ``fallback`` of ``params``."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return Report(
      data_axes=data_axes,
      fallback_leaves=tuple(
          f"params{jax.tree_util.keystr(leaves[i][0])}" for i in fallback),
      fallback_bytes=sum(_nbytes(leaves[i][1]) for i in fallback),
      total_bytes=sum(_nbytes(leaf) for _, leaf in leaves),
      seconds=seconds,
  )


_collected: contextvars.ContextVar[list[Report] | None] = (
    contextvars.ContextVar("optax_accum_sharding_reports", default=None))
_warned: set[tuple[str, ...]] = set()


def publish(found: Report) -> None:
  """Hands a traced call's report to :func:`collecting`, or warns once."""
  reports = _collected.get()
  if reports is not None:
    reports.append(found)
    return
  if found.fallback_leaves and found.fallback_leaves not in _warned:
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
  every micro-batch. The first trace warns once; this traces ``fn`` (never
  runs it) and returns the report.

  Args:
    fn: a function that calls an optax_accum entry point: the function it
      returns, or a train step around it (jitted or not).
    *args: the arguments to trace ``fn`` with (arrays or
      :class:`jax.ShapeDtypeStruct`, carrying their shardings); call this
      under the same :func:`jax.set_mesh` as ``fn``.
    **kwargs: its keyword arguments (``rng=`` and so on).

  Returns:
    The :class:`Report` of the last typed loop that ``fn`` traced:
    ``fallback_leaves`` (their paths), ``fallback_bytes`` and
    ``fallback_share`` of the gradient's bytes, and ``message()``.

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
  """
  target = fn.__wrapped__ if hasattr(fn, "lower") and hasattr(
      fn, "__wrapped__") else fn
  with collecting() as reports:
    jax.eval_shape(target, *args, **kwargs)
  if not reports:
    raise ValueError(
        f"fn={fn!r} traced no typed micro-batch loop: an optax_accum entry"
        " point types parameters reduced only under jax.jit with Explicit"
        " data axes (a batch sharded over them, or axis_name naming them)."
        " Call sharding_report under the same jax.set_mesh as the step, on"
        " a sharded batch."
    )
  return reports[-1]
