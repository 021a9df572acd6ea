"""The runner: one driver of every entry point, in every parallel form.

:func:`run` takes an entry point's :class:`stages.Program` and runs it in the
form that :func:`forms.detect` finds:

* ``SINGLE``: *local* then *finalize* on the whole batch;
* ``MANUAL`` (inside shard_map or pmap): gather, *local*, reduce, *finalize*
  on this device's shard, by :func:`on_device`;
* ``TYPED`` (under jit, with Explicit data axes): no axis made manual; the
  parameters typed reduced over the data axes and the gradient sums
  unreduced, by :func:`typed_form.run`;
* ``MESH`` (under jit, with Auto data axes of a mesh): the same as
  ``MANUAL`` inside a :func:`jax.shard_map` over the data axes, by
  :func:`over_mesh`; other mesh axes stay with the model.

The gather and the gradient's reduction follow the parameters' layout over
the data axes (:mod:`fsdp`): replicated parameters are summed with one
all-reduce after the loop; parameters sharded over some data axes (FSDP,
HSDP) are reduce-scattered over those axes and summed over the others.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import aux_reduction
from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import forms
from optax_accum._src import fsdp
from optax_accum._src import loss_signature
from optax_accum._src import noise_scale
from optax_accum._src import partial_sums
from optax_accum._src import sharding
from optax_accum._src import stages
from optax_accum._src import typed_form
from optax_accum._src import unreduced_sums


class Settings(NamedTuple):
  """What the runner needs to know of an entry point's arguments."""

  axis_name: axes.AxisName | None
  num_microbatches: int
  batch_axes: Any  # an int, None, or a pytree prefix of the batch.
  param_specs: Any  # None, a PartitionSpec or a tree prefix of params.
  policy: fsdp.Policy
  grad_reduction: Any = None  # None (all "mean") or a prefix of params.


def run(program: stages.Program, settings: Settings, params: Any,
        inputs: loss_signature.Inputs) -> stages.Result:
  """Runs ``program`` on ``params`` and ``inputs`` in the form of the call."""
  form = forms.detect(settings.axis_name, params, inputs.batch,
                      batching.leaf_axes(inputs.batch, settings.batch_axes))
  with forms.entered(form):
    if form.kind == forms.SINGLE:
      if settings.policy.gradient_sync == fsdp.DEFERRED:
        raise ValueError(
            "gradient_sync='deferred' leaves the gradient unreduced over the"
            " data axes, but this call has none: the batch is not sharded"
            " over Explicit mesh axes and axis_name is None. Shard the batch"
            " (jax.device_put(batch, P('data')) under jax.set_mesh with"
            " Explicit axes) or give axis_name."
        )
      _refuse_varying_batch(inputs.batch)
      partials = program.local(params, inputs, None)
      return program.finalize(partials, params, noise_scale.sq_norm)
    if form.kind == forms.TYPED:
      return typed_form.run(program, settings, params, inputs,
                            form.axis_name)
    settings = settings._replace(axis_name=form.axis_name)
    if form.kind == forms.MANUAL:
      with fsdp.shards_need_param_specs(settings.param_specs, params,
                                        settings.axis_name):
        return on_device(program, settings, params, inputs)
    return over_mesh(program, settings, params, inputs)


def _refuse_varying_batch(batch: Any) -> None:
  """Without axis_name, a batch that differs by device (inside shard_map)
  would be weighted by each device's tokens but summed by autodiff over all:
  refused, naming the fix."""
  varying = sorted(set().union(
      *(axes.varying_axes(x) for x in jax.tree.leaves(batch))))
  if varying:
    name = varying[0] if len(varying) == 1 else tuple(varying)
    raise ValueError(
        f"The batch differs by device over the manual axes {varying} (inside"
        " jax.shard_map or jax.pmap), but axis_name is None: pass"
        f" axis_name={name!r}, so that the loop keeps each device's partial"
        " sums and reduces them once, after it."
    )


def _layout(program, settings, params) -> fsdp.Layout:
  specs = settings.param_specs
  specs = fsdp.specs_like(params, P() if specs is None else specs,
                          settings.axis_name)
  policy = fsdp.Policy() if program.coupled else settings.policy
  return fsdp.layout(specs, settings.axis_name, policy)


def reduce(partials: stages.Partials, lay: fsdp.Layout) -> stages.Partials:
  """Sums the partials over the data axes: the one reduction of a call."""
  axis_name = lay.axis_name
  grads, sums = fsdp.finish(lay, partials.grads, partials.sums)
  maxima = lax.pmax(partials.maxima, axis_name) if partials.maxima else []
  minima = lax.pmin(partials.minima, axis_name) if partials.minima else []
  means = partials.means
  if means is not None:
    means = partial_sums.model_state_over(means, axis_name)
  return partials._replace(grads=grads, sums=sums, maxima=maxima,
                           minima=minima, means=means)


def on_device(program: stages.Program, settings: Settings, params: Any,
              inputs: loss_signature.Inputs) -> stages.Result:
  """Gather, local, reduce and finalize, on one device of the data axes.

  ``params`` are this device's (shards laid out by ``settings.param_specs``,
  replicated without them) and ``inputs.batch`` its shard of the batch.
  """
  lay = _layout(program, settings, params)
  if inputs.model_state is not None:
    # Device-local, so that a leaf the loop makes differ by device (a key
    # folded with the device's index) keeps the scan carry's type.
    inputs = inputs._replace(model_state=axes.device_local(
        inputs.model_state, lay.axis_name))
  # The loop differentiates with respect to device-local whole parameters,
  # so that autodiff does not sum gradients over the axis on every micro-step.
  partials = reduce(program.local(fsdp.hold(lay, params), inputs, lay), lay)
  return program.finalize(partials, params, lambda tree: (
      sharding.sq_norm_of_shards(tree, lay.specs, noise_scale.sq_norm)))


def _batch_spec(axis: int | None, axis_name: axes.AxisName) -> P:
  return P() if axis is None else P(*([None] * axis), axis_name)


def _param_specs(params: Any, settings: Settings) -> Any:
  """The parameters' specs over the data axes: given, or read off types."""
  if settings.param_specs is not None:
    return fsdp.specs_like(params, settings.param_specs, settings.axis_name)
  return jax.tree.map(
      lambda p: sharding.spec_over(p, settings.axis_name), params)


def _stack_over_devices(program: stages.Program, stacked: Any) -> Any:
  """Gives each stacked aux leaf the axis that concatenates devices."""
  where = program.aux_axis

  def expand(a):
    if program.new_aux_axis or jnp.ndim(a) <= where:
      return jnp.expand_dims(a, where)
    return a

  return jax.tree.map(expand, stacked)


def _manual_axes_note(axis_name: axes.AxisName) -> str:
  """The hint added to an error raised inside :func:`over_mesh`'s loop."""
  return (
      f"optax_accum: on a mesh with Auto axes the micro-batch loop runs in a"
      f" jax.shard_map over the data axes {axis_name!r}, where they are"
      " Manual and loss_fn sees one device's shard. If loss_fn names them in"
      " a sharding annotation (out_sharding=, jax.sharding.reshard), make"
      " the mesh's axes Explicit (jax.make_mesh(..., axis_types="
      "(AxisType.Explicit, ...))): the loop then runs loss_fn as"
      " jax.jit(jax.value_and_grad(loss_fn)) does, annotations included."
      " Or drop the annotations that name the data axes."
  )


def over_mesh(program: stages.Program, settings: Settings, params: Any,
              inputs: loss_signature.Inputs) -> stages.Result:
  """:func:`on_device` in a shard_map over the (Auto) data axes of the mesh.

  Every device splits its own shard of the batch into micro-batches;
  parameters sharded over the data axes (``param_specs``) arrive as shards,
  the rest of ``inputs`` replicated. A stacked aux leaf comes back
  concatenated over devices along ``program.aux_axis``. Explicit data axes
  run in the typed form instead (:mod:`typed_form`).
  """
  axis_name = settings.axis_name
  if settings.policy.gradient_sync == fsdp.DEFERRED:
    unreduced_sums.check_mesh(axis_name)  # Auto axes: refused, by name.
  batch = inputs.batch
  leaf_axes = batching.leaf_axes(batch, settings.batch_axes)
  batching.check_divisible(
      batching.split_size(batch, leaf_axes), settings.num_microbatches,
      devices=forms.axis_size(axis_name),
  )
  batch_specs = jax.tree.structure(batch).unflatten(
      [_batch_spec(a, axis_name) for a in leaf_axes])
  replicated = inputs._replace(batch=None)
  param_specs = _param_specs(params, settings)
  settings = settings._replace(param_specs=param_specs)

  def body(params, batch, replicated):
    try:
      result = on_device(program, settings, params,
                         replicated._replace(batch=batch))
    except ValueError as e:  # JAX's, kept: the hint is a note.
      e.add_note(_manual_axes_note(axis_name))
      raise
    aux = result.aux._replace(
        stacked=_stack_over_devices(program, result.aux.stacked))
    return result._replace(aux=aux)

  stacked_spec = P(*([None] * program.aux_axis), axis_name)
  out_specs = stages.Result(
      loss=P(), grads=param_specs, model_state=P(),
      aux=aux_reduction.Parts(stacked_spec, P()), stats=P())
  sharded = jax.shard_map(
      body,
      in_specs=(param_specs, batch_specs, P()),
      out_specs=out_specs,
      axis_names=set(axes.axes_of(axis_name)),
  )
  return sharded(params, batch, replicated)
