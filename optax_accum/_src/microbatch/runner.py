"""The runner: one driver of every entry point, in every parallel form.

:func:`run` finds the form of the call (:func:`forms.detect_form`; the four
forms,
``single``, ``manual``, ``auto`` and ``typed``, are told in
``docs/distributed.md``), builds the one :class:`layout.Layout` of that
form, and runs the entry point's stages through it:

1. *hold*: ``layout.hold(params)``, what the loop closes over;
2. *local*: ``Program.local`` (the micro-batch loop, or gradient caching) on
   this device's batch, or the global one;
3. *reduce*: ``layout.reduce``, the one reduction over the data axes;
4. *finalize*: ``Program.finalize``, the means, aux and statistics.

The ``auto`` form runs the same stages inside a :func:`jax.shard_map` over
the Auto data axes (:func:`over_mesh`); the ``typed`` form's layout is built
from a trace of *local* (:func:`typed_trace.build_typed`).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import names
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import forms
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import loss_signature
from optax_accum._src.microbatch import manual_layout
from optax_accum._src.microbatch import typed_trace
from optax_accum._src.rules import aux_reduction


class Settings(NamedTuple):
  """What the runner needs to know of an entry point's arguments."""

  axis_name: readers.AxisName | None
  num_microbatches: int
  batch_axes: Any  # an int, None, or a pytree prefix of the batch.
  param_specs: Any  # None, a PartitionSpec or a tree prefix of params.
  policy: fsdp.Policy
  grad_reduction: Any = None  # None (all "mean") or a prefix of params.


def run(program: layout.Program, settings: Settings, params: Any,
        inputs: loss_signature.Inputs) -> layout.Result:
  """Runs ``program`` on ``params`` and ``inputs`` in the form of the call."""
  form = forms.detect_form(settings.axis_name, params, inputs.batch,
                      batching.leaf_axes(inputs.batch, settings.batch_axes))
  with forms.entered(form):
    _check(form, settings, params, inputs)
    if form.kind == forms.TYPED:
      lay, partials = typed_trace.build_typed(
          lambda lay: _local(program, lay, params, inputs), params,
          settings.param_specs, settings.grad_reduction, settings.policy,
          form.axis_name, form.leaf_axes, settings.num_microbatches,
          None if program.shards_ok is None else program.shards_ok(params))
      return program.finalize(lay.reduce(partials), params, lay)
    if form.kind == forms.AUTO:
      return over_mesh(program, settings, form, params, inputs)
    if form.kind == forms.MANUAL:
      with manual_layout.noting_shards(settings.param_specs, params,
                                       form.axis_name):
        return on_device(program, manual_layout.build_manual(
            params, settings.param_specs, form.axis_name, settings.policy,
            form.leaf_axes), params, inputs)
    return on_device(program, layout.SingleLayout(form.leaf_axes), params,
                     inputs)


def _check(form: forms.Form, settings: Settings, params: Any,
           inputs: loss_signature.Inputs) -> None:
  """What each form refuses (or warns of), before anything is traced."""
  deferred = settings.policy.gradient_sync == names.DEFERRED
  if form.kind != forms.SINGLE:
    fsdp.check_fits_mesh(params, settings.param_specs, form.axis_name,
                         whole=form.kind in (forms.TYPED, forms.AUTO))
    if settings.policy.gradient_sync == names.EVERY_MICROBATCH:
      fsdp.warn_if_sync_unused(
          _param_specs(params, settings.param_specs, form.axis_name),
          form.axis_name)
  if form.kind == forms.SINGLE and settings.param_specs is not None:
    # Unused on one device, but a tree that cannot fit params is named here,
    # not first on the mesh.
    fsdp.specs_like(params, settings.param_specs, None)
  if form.kind == forms.SINGLE:
    # Without data parallelism (no mesh, a mesh of one device, data axes of
    # size 1) there is nothing to defer: "deferred" is the plain gradient,
    # so the README's no_sync recipe runs on a laptop. A batch left
    # unsharded (or sharded over Auto axes) on a multi-device mesh is refused.
    if deferred and not _no_data_parallelism(settings.axis_name, inputs.batch,
                                             form.leaf_axes):
      raise ValueError(
          "gradient_sync='deferred' leaves the gradient unreduced over the"
          " data axes, but this call has none: the batch is not sharded"
          " over Explicit mesh axes and axis_name is None. Shard the batch"
          " (jax.device_put(batch, P('data')) under jax.set_mesh with"
          " Explicit axes) or give axis_name."
      )
    _refuse_varying_batch(inputs.batch)
  if form.kind == forms.AUTO and deferred:
    raise ValueError(
        "gradient_sync='deferred' returns the gradient typed unreduced over"
        f" axis_name={form.axis_name!r}, which needs AxisType.Explicit mesh"
        f" axes; the current mesh is {jax.sharding.get_abstract_mesh()}."
        " Make the mesh with jax.make_mesh(..., axis_types="
        "(AxisType.Explicit, ...)), or use gradient_sync='once'."
    )
  if form.kind in (forms.TYPED, forms.AUTO):
    batching.check_divisible(
        batching.split_size(inputs.batch, form.leaf_axes),
        settings.num_microbatches, devices=forms.axis_size(form.axis_name))


def _no_data_parallelism(axis_name: readers.AxisName | None, batch: Any,
                         leaf_axes: list[int | None]) -> bool:
  """Whether a single-form call has no data axis of size > 1 to defer over:
  one device, axis_name's axes all of size 1, or a batch sharded (Explicit)
  only over axes of size 1."""
  mesh = jax.sharding.get_abstract_mesh()  # set, or entered from the inputs.
  if axis_name is not None or mesh.empty or mesh.size == 1:
    return True
  named = set()
  for leaf, axis in zip(jax.tree.leaves(batch), leaf_axes):
    spec = readers.explicit_spec(leaf)
    if axis is not None and spec is not None and axis < len(spec):
      named |= set(readers.axes_of(spec[axis])) if spec[axis] else set()
  return bool(named) and all(readers.axis_sizes(mesh)[n] == 1 for n in named)


def _local(program: layout.Program, lay: layout.Layout, params: Any,
           inputs: loss_signature.Inputs) -> layout.Partials:
  """*hold* and *local*: the program's partials under ``lay``."""
  return program.local(lay.hold(params), inputs, lay)


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


def on_device(program: layout.Program, lay: layout.Layout, params: Any,
              inputs: loss_signature.Inputs) -> layout.Result:
  """Hold, local, reduce and finalize under ``lay``.

  Under manual axes ``params`` are this device's (shards laid out by the
  layout's specs, replicated without them) and ``inputs.batch`` its shard
  of the batch.
  """
  if inputs.model_state is not None:
    # Device-local, so that a leaf the loop makes differ by device (a key
    # folded with the device's index) keeps the scan carry's type.
    inputs = inputs._replace(
        model_state=lay.device_local(inputs.model_state))
  partials = _local(program, lay, params, inputs)
  return program.finalize(lay.reduce(partials), params, lay)


def _batch_spec(axis: int | None, axis_name: readers.AxisName) -> P:
  return P() if axis is None else P(*([None] * axis), axis_name)


def _param_specs(params: Any, param_specs: Any,
                 axis_name: readers.AxisName) -> Any:
  """The parameters' specs over the data axes: given, or read off types."""
  if param_specs is not None:
    return fsdp.specs_like(params, param_specs, axis_name)
  return jax.tree.map(lambda p: readers.spec_over(p, axis_name), params)


def _stack_over_devices(program: layout.Program, stacked: Any) -> Any:
  """Gives each stacked aux leaf the axis that concatenates devices."""
  where = program.aux_axis

  def expand(a):
    if program.new_aux_axis or jnp.ndim(a) <= where:
      return jnp.expand_dims(a, where)
    return a

  return jax.tree.map(expand, stacked)


def _manual_axes_note(axis_name: readers.AxisName) -> str:
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


def over_mesh(program: layout.Program, settings: Settings, form: forms.Form,
              params: Any, inputs: loss_signature.Inputs) -> layout.Result:
  """:func:`on_device` in a shard_map over the (Auto) data axes of the mesh.

  Every device splits its own shard of the batch into micro-batches;
  parameters sharded over the data axes (``param_specs``) arrive as shards,
  the rest of ``inputs`` replicated. A stacked aux leaf comes back
  concatenated over devices along ``program.aux_axis``.
  """
  axis_name = form.axis_name
  batch = inputs.batch
  batch_specs = jax.tree.structure(batch).unflatten(
      [_batch_spec(a, axis_name) for a in form.leaf_axes])
  replicated = inputs._replace(batch=None)
  param_specs = _param_specs(params, settings.param_specs, axis_name)

  # Non-array leaves of *args (an Equinox model's static part) cannot cross
  # the shard_map boundary: closed over, the arrays passed.
  flat, treedef = jax.tree.flatten(replicated)
  is_array = [loss_signature.is_array(x) for x in flat]
  arrays = [x for x, a in zip(flat, is_array) if a]

  def body(params, batch, arrays):
    it = iter(arrays)
    replicated = treedef.unflatten(
        [next(it) if a else x for x, a in zip(flat, is_array)])
    lay = manual_layout.build_manual(params, param_specs, axis_name,
                              settings.policy, form.leaf_axes)
    try:
      result = on_device(program, lay, params,
                         replicated._replace(batch=batch))
    except (ValueError, NotImplementedError) as e:  # JAX's, with a note.
      e.add_note(_manual_axes_note(axis_name))
      raise
    aux = result.aux._replace(
        stacked=_stack_over_devices(program, result.aux.stacked))
    return result._replace(aux=aux)

  stacked_spec = P(*([None] * program.aux_axis), axis_name)
  out_specs = layout.Result(
      loss=P(), grads=param_specs, model_state=P(),
      aux=aux_reduction.Parts(stacked_spec, P()), stats=P())
  sharded = manual.shard_map(
      body,
      in_specs=(param_specs, batch_specs, P()),
      out_specs=out_specs,
      axis_names=set(readers.axes_of(axis_name)),
  )
  return sharded(params, batch, arrays)
