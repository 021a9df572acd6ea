"""The layout of one call, and the tuples that pass between its stages.

A call of an entry point runs its stages in order (the code map in
:mod:`optax_accum._src`): *local*, the work on the loop's share of the batch
(the micro-batch loop, or gradient caching's two passes), gives
:class:`Partials`; *reduce*, the call's :class:`Layout`, sums them over the
data axes once (the identity without one); *finalize* gives the means, aux
and statistics as a :class:`Result`. An entry point hands the runner a
:class:`Program`: its *local* and *finalize* stages.

The runner (:mod:`runner`) decides a call's form once (:mod:`forms`; the
forms are told in ``docs/distributed.md``) and builds one :class:`Layout`
for it. The micro-batch loop (:mod:`loop`) and gradient caching
(:mod:`coupled`) hold parameters, sum gradients and reduce through it alone,
so that they read as the single-device algorithm. One implementation per
form:

* :class:`SingleLayout` (``single``): the identity; nothing to reduce;
* :class:`manual_layout.ManualLayout` (``manual`` and ``auto``): data
  axes made manual (shard_map, pmap, or the runner's shard_map over Auto
  axes); collectives written out;
* :class:`typed_layout.TypedLayout` (``typed``): Explicit data axes under
  jit; the reduction is in the types (``reduced`` parameters, ``unreduced``
  sums).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.rules import aux_reduction
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


class Partials(NamedTuple):
  """One device's partial results, and how each part is reduced over devices.

  Without a data axis the runner hands them to *finalize* as they are.
  """

  grads: Any  # the gradient sums, laid out as the layout holds them.
  sums: Any  # summed over devices, with the gradient (loss, tokens, ...).
  maxima: list[Any]  # maximum over devices.
  minima: list[Any]  # minimum over devices.
  means: Any  # floating leaves averaged over devices (model state).
  rest: Any  # kept as they are: what *finalize* needs besides (per device).
  # Per gradient leaf, the part already summed over devices (in the last
  # micro-batch's layer scan, :mod:`scanned_layers`), added to the rest
  # once that is reduced; or None for none.
  in_loop: list[Any] | None = None


class Result(NamedTuple):
  """What an entry point hands back, before it is packed for the caller."""

  loss: jax.Array
  grads: Any
  model_state: Any
  aux: aux_reduction.Parts
  stats: noise_scale.GradStats | None  # None without with_stats.


class Program(NamedTuple):
  """An entry point's own stages, run by the runner in every form.

  ``local(held, inputs, layout)`` runs on the loop's share of the batch
  (``inputs.batch``); ``held`` is what ``layout.hold(params)`` keeps, and
  ``layout`` (a :class:`Layout`) is how it sums and reduces.
  ``finalize(partials, params, layout)`` turns the reduced partials into a
  :class:`Result`.
  """

  local: Callable[..., Partials]
  finalize: Callable[..., Result]
  # Under a mesh, aux.stacked leaves are concatenated over devices along
  # this axis (a leaf with too few axes gets a new one there, or always with
  # new_aux_axis).
  aux_axis: int
  new_aux_axis: bool
  # Per parameter leaf, whether ``local`` may differentiate its shard (the
  # typed form's FSDP leaves under both policies "every_microbatch"); None:
  # none.
  shards_ok: Callable[[Any], list[bool]] | None = None


class Layout(Protocol):
  """How one call's stages hold parameters, sum gradients and reduce them.

  ``device_axis`` names the manual data axes whose device index is folded
  into each micro-batch's key (:mod:`rng`), or is None where the
  loop sees the global batch. ``num_devices`` is how many devices' losses
  gradient caching averages (1 where ``loss_fn`` sees the global batch).
  """

  device_axis: readers.AxisName | None
  num_devices: int

  def split(self, batch: Any, num_microbatches: int) -> batching.Split:
    """The batch (this device's, or the global one) cut into micro-batches."""

  def device_local(self, tree: Any) -> Any:
    """``tree`` as a value that differs by device (the loop's carry)."""

  def hold(self, params: Any) -> Any:
    """What the loop closes over: whole parameters, or shards."""

  def for_microbatch(self, held: Any, index: Any) -> Any:
    """The whole parameters that micro-batch ``index`` differentiates."""

  def zero_grads(self, held: Any, dtypes: Any) -> Any:
    """The loop's zero gradient sums, in ``dtypes`` (per leaf)."""

  def add_grads(self, total: Any, grads: Any,
                c: token_weighting.Contribution,
                rules: list[str] | None) -> Any:
    """Adds one micro-batch's gradient to the sums, by ``rules``."""

  def zero_stats(self) -> list[noise_scale.StatsSums]:
    """The noise-scale sums, one per group of leaves (``docs/noise_scale``)."""

  def add_stats(self, stats: list[noise_scale.StatsSums], grads: Any,
                c: token_weighting.Contribution, loss_reduction: str,
                count_tokens: Callable[[Any], jax.Array],
                microbatch: Any) -> list[noise_scale.StatsSums]:
    """Adds one micro-batch's small batches to the noise-scale sums."""

  def sq_norms(self, tree: Any) -> list[jax.Array]:
    """The squared norm of each stats group's leaves of a reduced gradient."""

  def after_loop(self, total: Any, rules: list[str] | None) -> Any:
    """The loop's gradient sums made ready for :meth:`reduce`."""

  def reduces_only_after_loop(self) -> bool:
    """Whether :meth:`reduce` sums gradients over devices and nothing is
    reduced in the loop: then the loop's last micro-batch may run after the
    loop (SPEC 13), so that each leaf's reduction starts as soon as its sum
    is final, beside the rest of that backward pass. Not where a leaf is
    reduced in each micro-batch (JAX's replicated fallback leaves,
    ``gradient_sync="every_microbatch"``): XLA moves such a loop's
    reductions after it as one, and the last micro-batch's own would be a
    second (8 H100s: ``oa.check_train_step`` finds the fallback leaf
    reduced twice)."""

  def reducible_in_loop(self) -> list[bool]:
    """Per parameter leaf, whether its gradient may be summed over the
    data axes inside the last micro-batch's backward pass instead of after
    it (:mod:`scanned_layers`): where :meth:`reduce` all-reduces it whole,
    once."""

  def sum_in_loop(self, running: Any, g: Any,
                  c: token_weighting.Contribution) -> Any:
    """A leaf's (or its layer slice's) running sum with the last
    micro-batch's gradient ``g`` added as ``c`` says, summed over the data
    axes, typed like the parameter (for :meth:`reducible_in_loop`'s leaves:
    :mod:`scanned_layers`)."""

  def reduce(self, partials: Partials) -> Partials:
    """The one reduction over the data axes (the identity without one).

    A leaf with a part already summed in the loop (``partials.in_loop``) has
    the rest summed and that part added.
    """

  def gather_rows(self, reps: Any, batch: Any) -> tuple[Any, Any]:
    """Gradient caching: every device's rows of ``reps``, in device order,
    and the batch the coupled loss sees."""

  def scatter_rows(self, cotangents: list[Any],
                   like: list[Any]) -> list[Any]:
    """Gradient caching: the summed cotangents of this device's rows."""

  def loss_params(self, held: Any) -> Any:
    """Gradient caching: the parameters the coupled loss differentiates."""

  def as_sums(self, tree: Any) -> Any:
    """A gradient typed like the loop's sums (gradient caching's start)."""


class SingleLayout(NamedTuple):
  """The ``single`` form: no data axis; every stage is the identity.

  Its batch split takes rows ``i, i + k, ...`` where Auto axes of the
  current mesh may shard the batch without saying how
  (:func:`batching.split`).
  """

  leaf_axes: list[int | None]
  device_axis: None = None
  num_devices: int = 1

  def split(self, batch, num_microbatches):
    return batching.split(batch, None, num_microbatches,
                          known_axes=self.leaf_axes)

  def device_local(self, tree):
    return tree

  def hold(self, params):
    return params

  def for_microbatch(self, held, index):
    del index
    return held

  def zero_grads(self, held, dtypes):
    # zeros_like keeps each parameter's sharding (model-parallel axes).
    return jax.tree.map(lambda p, dtype: jnp.zeros_like(p, dtype=dtype),
                        held, dtypes)

  def add_grads(self, total, grads, c, rules):
    return grad_reduction_lib.add_by_rule(total, grads, c, rules)

  def zero_stats(self):
    return [noise_scale.zero_sums()]

  def add_stats(self, stats, grads, c, loss_reduction, count_tokens,
                microbatch):
    del count_tokens, microbatch
    return [noise_scale.add_sq_norms(stats[0], grads, c, loss_reduction)]

  def sq_norms(self, tree):
    return [noise_scale.sq_norm(tree)]

  def after_loop(self, total, rules):
    del rules
    return total

  def reduces_only_after_loop(self):
    return False

  def reducible_in_loop(self):
    return []

  def sum_in_loop(self, running, g, c):
    raise AssertionError("no data axis: nothing is reduced in a loop.")

  def reduce(self, partials):
    return partials

  def gather_rows(self, reps, batch):
    return reps, batch

  def scatter_rows(self, cotangents, like):
    del like
    return cotangents

  def loss_params(self, held):
    return held

  def as_sums(self, tree):
    return tree
