"""The train step on the data x fsdp x tensor mesh, its checks and counts.

The model lives on a 2 x 2 x 2 mesh of Explicit axes, its parameters sharded
by the logical rules of ``model.py``. Each step computes the token-weighted
gradient of the whole batch with ``oa.value_and_grad(loss_fn,
num_microbatches=k, ...)`` under ``jax.jit``: the data axes are read off the
batch's sharding (``P(("data", "fsdp"))``), ``loss_fn`` runs on a global
micro-batch as the model is written for ``jax.jit``, the parameters are
gathered over ``fsdp`` once before the loop and typed ``reduced`` over the
data axes, and the gradient is reduced over ``data`` and ``fsdp`` once after
the loop, back to the parameters' sharding. Dropout draws a new mask per
micro-batch from the key ``rng=`` hands it.
"""

import argparse
from typing import Any

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax

import optax_accum as oa

import data as data_lib
import model as model_lib

AXES = ("data", "fsdp", "tensor")
DATA_AXES = ("data", "fsdp")  # the batch is split over both; "tensor" not.
SHAPE = (2, 2, 2)


def make_mesh(shape: tuple[int, ...]) -> jax.sharding.Mesh:
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Explicit,) * 3)


def make_model(args: argparse.Namespace) -> model_lib.Transformer:
  """The transformer, each parameter created sharded by the logical rules.

  Call it under ``jax.set_mesh``: flax maps each parameter's logical axes
  through the rules to the mesh's axes and shards it as it is created.
  """
  with nn.logical_axis_rules(model_lib.LOGICAL_RULES):
    return model_lib.Transformer(
        vocab_size=data_lib.VOCAB_SIZE, seq_len=args.seq_len, dim=args.dim,
        num_heads=args.heads, mlp_dim=4 * args.dim, num_layers=args.layers,
        dropout=args.dropout, rngs=nnx.Rngs(params=args.seed, dropout=1))


def make_loss(graphdef):
  """``loss_fn(params, microbatch, rest, rng=)`` as oa.value_and_grad wants.

  ``rest`` is the model's state other than its parameters: here only the
  dropout stream, which each micro-batch reseeds with the key ``rng=`` hands
  it, so there is nothing to carry from one micro-batch to the next and
  ``rest`` goes in as an extra argument (replicated), not as threaded state.
  A model with BatchNorm statistics would use ``has_state=True`` instead.
  """
  def loss_fn(params, microbatch, rest, *, rng):
    model = nnx.merge(graphdef, params, rest, copy=True)
    nnx.reseed(model, dropout=rng)  # this micro-batch's own dropout mask.
    return model_lib.token_loss(model, microbatch)
  return loss_fn


def make_value_and_grad(graphdef, k: int):
  return oa.value_and_grad(
      make_loss(graphdef), num_microbatches=k,
      num_tokens_fn=data_lib.num_tokens)


def make_train_step(graphdef, tx: optax.GradientTransformation, k: int):
  value_and_grad = make_value_and_grad(graphdef, k)

  def train_step(params, rest, opt_state, batch, rng):
    loss, grads = value_and_grad(params, batch, rest, rng=rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def check_gradient(args, batch) -> dict[str, Any]:
  """The mesh's accumulated gradient against one device's full batch.

  Dropout is switched off (``model.eval()``) for this check, so that both
  sides compute the same function; training below runs with it on. The
  reference takes the same parameters, whole, on one device.
  """
  rng = jax.random.key(args.seed)
  with jax.set_mesh(make_mesh(SHAPE)):
    model = make_model(args)
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    value_and_grad = jax.jit(make_value_and_grad(graphdef, args.k))
    loss, grads = value_and_grad(
        params, jax.device_put(batch, P(DATA_AXES)), rest, rng=rng)
  one_device = make_mesh((1, 1, 1))
  with jax.set_mesh(one_device):
    whole = jax.NamedSharding(one_device, P())
    reference_loss, reference_grads = jax.jit(
        jax.value_and_grad(make_loss(graphdef)))(
            jax.device_put(params, whole), jax.device_put(batch, whole),
            jax.device_put(rest, whole), rng=rng)
  return {
      "loss_diff": abs(float(loss) - float(reference_loss)),
      "grad_max_abs_diff": max(
          float(jnp.max(jnp.abs(g - r))) for g, r in zip(
              jax.tree.leaves(jax.device_get(grads)),
              jax.tree.leaves(jax.device_get(reference_grads)))),
      "grads_sharded_like_params": all(
          g.sharding.spec == p.sharding.spec for g, p in zip(
              jax.tree.leaves(grads), jax.tree.leaves(params))),
      "grad_specs": sorted({str(p.sharding.spec)
                            for p in jax.tree.leaves(params)}),
  }


def train(args, batch) -> dict[str, Any]:
  """A few steps with dropout on; the collectives of the compiled step."""
  mesh = make_mesh(SHAPE)
  tx = optax.adamw(args.lr, weight_decay=1e-2)
  with jax.set_mesh(mesh):
    model = make_model(args)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)  # moments sharded like the parameters.
    on_devices = jax.device_put(batch, P(DATA_AXES))
    step = jax.jit(make_train_step(graphdef, tx, args.k),
                   donate_argnums=(0, 2))
    compiled = step.lower(params, rest, opt_state, on_devices,
                          jax.random.key(0)).compile()
    # The same model's full-batch gradient, for its collectives: the ones
    # over "tensor" are the model's own, which the loop should not add to.
    full_batch = jax.jit(jax.value_and_grad(make_loss(graphdef))).lower(
        params, on_devices, rest, rng=jax.random.key(0)).compile()
    report = oa.sharding_report(make_value_and_grad(graphdef, args.k),
                                params, on_devices, rest,
                                rng=jax.random.key(0))
    losses = []
    for i in range(args.steps):
      params, opt_state, loss = compiled(
          params, rest, opt_state, on_devices, jax.random.key(i))
      losses.append(float(loss))
  return {
      "losses": losses,
      "collectives": oa.count_collectives(compiled, mesh=mesh),
      "full_batch_collectives": oa.count_collectives(full_batch, mesh=mesh),
      "report": report,
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  """The gradient check, then training; returns both's results."""
  if jax.device_count() < 8:
    raise RuntimeError(
        f"Needs 8 devices, got {jax.device_count()}: call"
        " jax.config.update('jax_num_cpu_devices', 8) right after importing"
        " jax, as main.py does."
    )
  batch = data_lib.load_batch(args.batch, args.seq_len, args.seed)
  return {**check_gradient(args, batch), **train(args, batch),
          "tokens": int(batch["mask"].sum())}
