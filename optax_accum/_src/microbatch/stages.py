"""What passes between the runner's stages: one NamedTuple per boundary.

A call of an entry point runs these stages in order (see
:mod:`optax_accum._src`'s code map):

1. *local*: the work on the loop's share of the batch (the micro-batch loop,
   or gradient caching's two passes) gives :class:`Partials`;
2. *reduce*: the call's :class:`layout.Layout` sums them over the data axes,
   once (the identity without one);
3. *finalize*: the means, aux and statistics, as a :class:`Result`.

An entry point hands the runner a :class:`Program`: its *local* and
*finalize* stages, taken from the modules below the runner.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from optax_accum._src.rules import aux_reduction
from optax_accum._src.rules import noise_scale


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
  ``layout`` (a :class:`layout.Layout`) is how it sums and reduces.
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
