"""Where :func:`optax_accum.accumulate`'s running sums live: the Protocol.

Where a cycle's running sum lives, and so how a micro-step is added to it
and how the emitting branch reduces it, depends on where ``update`` runs and
on what it is given. ``update_call.layout_for`` decides it, for ``init``
and once per ``update`` call, and hands on one :class:`SumLayout`, which
lays the first state out (``init``) and adds to it; nothing below asks
again. Each form's layout lives beside its own logic:

======== ============================================ =========================
form     when                                         the running sum
======== ============================================ =========================
single   no ``axis_name``, gradients reduced          one array like the param
         (:mod:`local_sums`)
manual   ``axis_name`` bound (shard_map, pmap)        this device's slot, psum
         (:mod:`local_sums`)                          on emit
typed    under jit, gradients typed unreduced         unreduced like the
         (:mod:`typed_sums`)                          gradient, reduced on emit
slots    under jit, a state built with ``axis_name``  a slot per device,
         (:mod:`slot_sums`), unreduced gradients      resharded on emit
ZeRO     under jit, ``shard_optimizer`` given, or     typed's (ZeRO-1), or in
         ``inner``'s state sharded by Flax's          shards (ZeRO-2)
         ``optimizer_sharding`` (:mod:`zero_sums`)
======== ============================================ =========================

The tuples that cross module lines (:class:`UpdateSettings`,
:class:`Start`, :class:`Cycle`, :class:`MicroStep`) live here, at the
bottom, with the first state's parts that every form shares
(:func:`start`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import flax_nnx
from optax_accum._src import validation
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import readers
from optax_accum._src.rules import noise_scale


class UpdateSettings(NamedTuple):
  """``accumulate``'s settings, fixed at construction: those a micro-step
  is added under, and those ``init`` lays the state out by."""

  loss_reduction: str
  axis_name: readers.AxisName | None
  skip_nonfinite: bool
  should_skip: Callable[[Any, Any, Any], Any] | None
  grad_reduction: Any  # the checked grad_reduction: a prefix of the grads.
  with_stats: bool
  accumulator_dtype: Any = None  # the checked accumulator_dtype.
  zero: Any = None  # zero_sums.Zero (shard_optimizer's), or None.


class Cycle(NamedTuple):
  """The running sums of a cycle: what the emitting branch reads."""

  grad_sum: Any  # like params; per device under axis_name.
  token_count: jax.Array  # per device under axis_name.
  stats_sums: noise_scale.StatsSums | None  # None without with_stats.
  value_sums: window_args.ValueSums  # the window's value; per device too.


class Start(NamedTuple):
  """A form's first state: its running sums (zeros) and ``inner``'s state."""

  cycle: Cycle
  nonfinite_count: jax.Array
  skipped_count: jax.Array
  inner_state: Any


def scalar_zeros(dtype: Any) -> jax.Array:
  return jnp.zeros([], dtype)


def start(inner_state: Any, grad_sum: Any, settings: UpdateSettings,
          count_zeros: Callable[[Any], jax.Array] = scalar_zeros) -> Start:
  """The first state around ``grad_sum``, each count made by
  ``count_zeros(dtype)`` (a scalar, or per device behind a slot axis)."""
  stats_sums = noise_scale.StatsSums(
      count_zeros(jnp.float32), count_zeros(jnp.float32)
  ) if settings.with_stats else None
  cycle = Cycle(grad_sum, count_zeros(jnp.float32), stats_sums,
                window_args.zeros(count_zeros))
  return Start(cycle, count_zeros(jnp.int32), count_zeros(jnp.int32),
               inner_state)


def sum_dtype(param: Any, accumulator_dtype: Any) -> Any:
  """The running sum's dtype: complex parameters get a complex sum."""
  if jnp.iscomplexobj(param):
    return jnp.result_type(accumulator_dtype, jnp.complex64)
  return accumulator_dtype


def sums_like(params: Any, settings: UpdateSettings,
              zeros: Callable[[Any, Any], Any]) -> Any:
  """``zeros(param, dtype)`` for each parameter, in its sum's dtype."""
  return jax.tree.map(
      lambda p, d: zeros(p, sum_dtype(p, d)), params,
      validation.per_leaf_dtypes(settings.accumulator_dtype, params))


def whole(inner_state: Any, params: Any, settings: UpdateSettings) -> Start:
  """The first state of a form whose sums are shaped and sharded like the
  parameters (as optax's zeros_like): single, typed and ZeRO's."""
  return start(inner_state, sums_like(
      params, settings, lambda p, dtype: jnp.zeros_like(p, dtype=dtype)),
               settings)


def flax_zero_axes(params: Any) -> frozenset[str]:
  """The Explicit mesh axes that some Variable's ``optimizer_sharding``
  shards the state over while its parameter is not sharded over them."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return frozenset()
  values = jax.tree.leaves(flax_nnx.unwrap_variables(params))
  named = {a for axes, value in zip(flax_nnx.optimizer_sharding_axes(params),
                                    values)
           for a in axes if a not in readers.spec_names(
               readers.plain_spec(value))}
  return frozenset(a for a in named if a in mesh.axis_names
                   and readers.are_explicit(mesh, (a,)))


def unreduced_where_flax_shards(
    grad_sum: Any, params: Any, shard_optimizer: tuple[str, ...] = ()) -> Any:
  """The first running sums: unreduced over ZeRO's axes where Variables of
  ``params`` carry an ``optimizer_sharding`` over them (with those of
  ``shard_optimizer``), else ``grad_sum``.

  Each leaf is handed back as a plain array, which ``nnx.Optimizer`` keeps
  as it is (a Variable would be resharded to its ``optimizer_sharding``). A
  leaf already sharded over the axes (ZeRO-2's, a slot) stays so.
  """
  data_axes = flax_zero_axes(params)
  if not data_axes:
    return grad_sum
  data_axes |= set(shard_optimizer)

  def unreduced(s):
    over = data_axes - set(readers.spec_names(readers.plain_spec(s)))
    if not over:
      return s
    return jax.sharding.reshard(
        s, P(*readers.partitions(readers.full_spec(s)), unreduced=over))

  return jax.tree.map(unreduced, flax_nnx.unwrap_variables(grad_sum))


class MicroStep(NamedTuple):
  """A micro-step added to the running sums, before the emit decision."""

  grads: Any  # the incoming gradients, checked and floating.
  leaf_rules: list[str] | None  # each leaf's rule; None: all "mean".
  cycle: Cycle
  nonfinite_count: jax.Array  # like state.nonfinite_count.
  skipped_count: jax.Array  # like state.skipped_count.


class Incoming(NamedTuple):
  """One ``update`` call's micro-step, as the caller gave it."""

  grads: Any  # as given (checked by the layout's add).
  num_tokens: Any  # as given: None, a number or a traced scalar.
  tokens: jax.Array  # shape=(), float32: the count it adds.
  value: jax.Array | None  # the ``value`` extra argument, or None.


class SumLayout(Protocol):
  """Where a cycle's sums live: one implementation per form."""

  # Whether the emitting branch reads the sums as they are (no reduction):
  # the emitted updates may then be kept in the sum's buffer (emit.py).
  local: bool

  def init(self, inner: Any, params: Any,
           settings: UpdateSettings) -> Start:
    """The first state's sums and ``inner``'s state, laid out for this form
    (what ``tx.init`` returns around them: ``state.first_state``)."""

  def add(self, incoming: Incoming, state: Any, params: Any,
          settings: UpdateSettings) -> MicroStep:
    """Checks a micro-step's gradients and adds them (and its ``value``)
    to the running sums."""

  def reduced(self, cycle: Cycle, rules: list[str] | None) -> Cycle:
    """The sums over every device: the one reduction, when emitting."""

  def check_emit(self, emit: jax.Array) -> None:
    """Checks a traced ``emit`` (the same on every device where needed)."""
