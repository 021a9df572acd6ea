"""The train step on the 2-D mesh, its single-device reference, and counts.

Each step computes the gradient of the whole batch with
``oa.value_and_grad(..., axis_name="data")``: every device runs ``k``
micro-batches of its share of the batch, and the gradient is summed over
``data`` once, after the loop. The reference runs the same steps on one device
on the whole batch at once, with ``jax.value_and_grad``.
"""

import argparse
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax

import optax_accum as oa

import data as data_lib
import model

DATA, MODEL = 4, 2  # the mesh: 4-way data parallel, 2-way tensor parallel.
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(num_data: int, num_model: int, axis_types: str):
  kind = AXIS_TYPES[axis_types]
  return jax.make_mesh((num_data, num_model), ("data", "model"),
                       axis_types=(kind, kind),
                       devices=jax.devices()[: num_data * num_model])


def naive_value_and_grad(params, batch, k):
  """A plain lax.scan of jax.value_and_grad, for comparison (not exact)."""
  microbatches = jax.tree.map(
      lambda x: x.reshape((-1, k) + x.shape[1:]).swapaxes(0, 1), batch)

  def step(total, microbatch):
    return jax.tree.map(
        jnp.add, total, jax.value_and_grad(model.loss_fn)(params, microbatch)
    ), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
  return jax.lax.scan(step, zeros, microbatches)[0]


def make_train_step(tx, value_and_grad):
  def train_step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads
  return train_step


def run_reference(args, tx, batch) -> tuple[list[float], Any, Any]:
  """One device, the whole batch, no accumulation: (losses, grads, params)."""
  with jax.set_mesh(make_mesh(1, 1, args.axis_types)):
    params = model.init_params(args.seed)
    opt_state = tx.init(params)
    step = jax.jit(make_train_step(tx, jax.value_and_grad(model.loss_fn)))
    losses, first_grads = [], None
    for _ in range(args.steps):
      params, opt_state, loss, grads = step(params, opt_state, batch)
      losses.append(float(loss))
      first_grads = first_grads or grads
  return losses, first_grads, params


def run_on_mesh(args, tx, batch) -> dict[str, Any]:
  """The steps on the data x model mesh, and the collectives they compile to."""
  value_and_grad = oa.value_and_grad(
      model.loss_fn, num_microbatches=args.k,
      num_tokens_fn=data_lib.num_tokens, axis_name="data",
  )
  mesh = make_mesh(DATA, MODEL, args.axis_types)
  with jax.set_mesh(mesh):
    params = jax.device_put(model.init_params(args.seed), model.PARAM_SPECS)
    opt_state = tx.init(params)  # moments sharded like the parameters.
    batch = jax.device_put(batch, P("data"))
    step = jax.jit(make_train_step(tx, value_and_grad), donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, batch).compile()
    naive = jax.jit(lambda p, b: naive_value_and_grad(p, b, args.k)).lower(
        params, batch).compile()
    losses, first_grads = [], None
    for _ in range(args.steps):
      params, opt_state, loss, grads = compiled(params, opt_state, batch)
      losses.append(float(loss))
      first_grads = first_grads or grads
  return {
      "losses": losses, "first_grads": first_grads, "params": params,
      # The gradient-sized collectives (with Explicit axes the loss's and
      # token count's scalars are summed over "data" in each micro-batch).
      "collectives": oa.count_collectives(compiled, include_scalars=False),
      "collectives_by_axis": oa.count_collectives(
          compiled, mesh=mesh, include_scalars=False).by_axes,
      "naive_collectives": oa.count_collectives(
          naive, include_scalars=False),
      "naive_collectives_by_axis": oa.count_collectives(
          naive, mesh=mesh, include_scalars=False).by_axes,
  }


def count_model_only(args, batch) -> oa.CollectiveCounts:
  """What the model itself needs: its loop on the "model" axis alone."""
  with jax.set_mesh(make_mesh(1, MODEL, args.axis_types)):
    return oa.count_collectives(jax.jit(
        lambda p, b: naive_value_and_grad(p, b, args.k)).lower(
            jax.device_put(model.init_params(args.seed), model.PARAM_SPECS),
            jax.device_put(batch, P("data"))).compile(),
                                include_scalars=False)


def max_abs_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def train_and_compare(args: argparse.Namespace) -> dict[str, Any]:
  """Trains on the 2-D mesh and on one device; returns both and the counts."""
  if jax.device_count() < DATA * MODEL:
    raise RuntimeError(
        f"Needs {DATA * MODEL} devices, got {jax.device_count()}: call"
        f" jax.config.update('jax_num_cpu_devices', {DATA * MODEL}) right"
        " after importing jax, as main.py does."
    )
  batch = data_lib.make_data(args.batch, args.seed)
  tx = optax.adamw(args.lr, weight_decay=1e-2)
  reference_losses, reference_grads, reference_params = run_reference(
      args, tx, batch)
  mesh_run = run_on_mesh(args, tx, batch)
  first_grads = mesh_run.pop("first_grads")
  return {
      **mesh_run,
      "params": jax.device_get(mesh_run["params"]),
      "reference_losses": reference_losses,
      "grad_max_abs_diff": max_abs_diff(
          jax.device_get(first_grads), reference_grads),
      "param_max_abs_diff": max_abs_diff(
          jax.device_get(mesh_run["params"]), reference_params),
      "grad_specs": {name: g.sharding.spec for name, g in first_grads.items()},
      "model_only_collectives": count_model_only(args, batch),
  }
