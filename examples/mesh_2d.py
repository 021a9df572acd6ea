r"""Data x model parallelism on a 2-D mesh, exactly equal to the full batch.

A two-layer MLP is trained on a ``data`` x ``model`` mesh (4 x 2 devices):
the batch is split over ``data``, the weights over ``model`` (the first layer by
columns, the second by rows, as in Megatron-LM). Each step computes the gradient
of the whole batch with ``oa.value_and_grad(..., axis_name="data")``: every
device runs ``--k`` micro-batches of its share of the batch, and the gradient
is summed over ``data`` once, after the loop. The examples have uneven numbers
of tokens, and the loss is the mean over all the batch's tokens.

The same steps run on a single device on the whole batch at once, and the
script checks that both give the same losses and parameters, and counts the
collectives of the compiled step: in the micro-batch loop only the model's
own sum over ``model``, none over ``data``; a naive ``lax.scan`` over
micro-batches has one more all-reduce in its loop, run once per micro-batch.

Run it (it simulates 8 CPU devices)::

  python examples/mesh_2d.py
  python examples/mesh_2d.py --k 4 --steps 10
  python examples/mesh_2d.py --axis-types explicit

With Explicit axes the results are the same, but jax 0.10 all-gathers the
``model``-sharded parameters and gradients at the boundary of the
``shard_map`` that runs the loop (once per step, outside the loop); with Auto
axes (the default here) it does not.
"""

import argparse
import os
from collections.abc import Sequence
from typing import Any

# Eight simulated CPU devices, set before jax starts (no effect if it has).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

import optax_accum as oa  # pylint: disable=g-import-not-at-top,wrong-import-position

DATA, MODEL = 4, 2  # the mesh: 4-way data parallel, 2-way tensor parallel.
SEQ, DIM, HIDDEN = 8, 16, 32
# Megatron-style: the first layer split by columns, the second by rows.
PARAM_SPECS = {"w1": P(None, "model"), "w2": P("model")}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--k", type=int, default=2,
                      help="micro-batches per device and step")
  parser.add_argument("--batch", type=int, default=32, help="global batch")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--lr", type=float, default=0.02)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--axis-types", choices=("auto", "explicit"),
                      default="auto", help="the mesh axes' types")
  return parser.parse_args(argv)


def make_data(batch_size: int, seed: int) -> dict[str, np.ndarray]:
  """Sequences of random lengths: uneven token counts across devices."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, SEQ + 1, size=batch_size)
  return {
      "x": rng.normal(size=(batch_size, SEQ, DIM)).astype(np.float32),
      "y": rng.normal(size=(batch_size, SEQ)).astype(np.float32),
      "mask": (np.arange(SEQ) < lengths[:, None]).astype(np.float32),
  }


def init_params(seed: int) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "w1": jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
      "w2": jax.random.normal(k2, (HIDDEN,)) / np.sqrt(HIDDEN),
  }


def loss_fn(params, batch):
  """Mean squared error over the unmasked tokens of ``batch``."""
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  # Sums over "model" (the model's own collective); out_sharding says where
  # the sum goes, which Explicit axes require.
  pred = jnp.einsum("bsh,h->bs", hidden, params["w2"], out_sharding=P())
  errors = batch["mask"] * (pred - batch["y"]) ** 2
  return errors.sum() / batch["mask"].sum()


def num_tokens(batch):
  return batch["mask"].sum()


def naive_value_and_grad(params, batch, k):
  """A plain lax.scan of jax.value_and_grad, for comparison (not exact)."""
  microbatches = jax.tree.map(
      lambda x: x.reshape((-1, k) + x.shape[1:]).swapaxes(0, 1), batch)

  def step(total, microbatch):
    return jax.tree.map(
        jnp.add, total, jax.value_and_grad(loss_fn)(params, microbatch)
    ), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
  return jax.lax.scan(step, zeros, microbatches)[0]


def in_loop(counts: oa.CollectiveCounts) -> int:
  return sum(counts.in_loop.values())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains on the 2-D mesh and on one device; returns both and the counts."""
  args = parse_args(argv)
  if jax.device_count() < DATA * MODEL:
    raise RuntimeError(
        f"Needs {DATA * MODEL} devices, got {jax.device_count()}: set"
        " XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )
  data = make_data(args.batch, args.seed)
  tx = optax.adamw(args.lr, weight_decay=1e-2)
  value_and_grad = oa.value_and_grad(
      loss_fn, num_microbatches=args.k, num_tokens_fn=num_tokens,
      axis_name="data",
  )

  def train_step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  def full_batch_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  axis_types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[
      args.axis_types]

  def make_mesh(data, model):
    return jax.make_mesh((data, model), ("data", "model"),
                         axis_types=(axis_types, axis_types),
                         devices=jax.devices()[:data * model])

  # The reference: one device, the whole batch, no accumulation.
  with jax.set_mesh(make_mesh(1, 1)):
    params = init_params(args.seed)
    opt_state = tx.init(params)
    reference_step = jax.jit(full_batch_step)
    reference_losses, reference_grads = [], None
    for _ in range(args.steps):
      params, opt_state, loss, grads = reference_step(params, opt_state, data)
      reference_losses.append(float(loss))
      reference_grads = reference_grads or grads
    reference_params = params

  with jax.set_mesh(make_mesh(DATA, MODEL)):
    params = jax.device_put(init_params(args.seed), PARAM_SPECS)
    opt_state = tx.init(params)  # moments sharded like the parameters.
    batch = jax.device_put(data, P("data"))
    step = jax.jit(train_step, donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, batch).compile()
    counts = oa.count_collectives(compiled)
    naive = oa.count_collectives(jax.jit(
        lambda p, b: naive_value_and_grad(p, b, args.k)).lower(
            params, batch).compile())
    losses, first_grads = [], None
    for _ in range(args.steps):
      params, opt_state, loss, grads = compiled(params, opt_state, batch)
      losses.append(float(loss))
      first_grads = first_grads or grads
    grad_specs = {name: g.sharding.spec for name, g in first_grads.items()}

  # What the model itself needs: its loop on the "model" axis alone.
  with jax.set_mesh(make_mesh(1, MODEL)):
    model_only = oa.count_collectives(jax.jit(
        lambda p, b: naive_value_and_grad(p, b, args.k)).lower(
            jax.device_put(init_params(args.seed), PARAM_SPECS),
            jax.device_put(data, P("data"))).compile())

  max_abs_diff = lambda a, b: max(
      float(jnp.max(jnp.abs(x - y)))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  results = {
      "losses": losses,
      "reference_losses": reference_losses,
      "grad_max_abs_diff": max_abs_diff(
          jax.device_get(first_grads), reference_grads),
      "param_max_abs_diff": max_abs_diff(
          jax.device_get(params), reference_params),
      "grad_specs": grad_specs,
      "collectives": counts,
      "naive_collectives": naive,
      "model_only_collectives": model_only,
  }
  print(f"{'step':>4} {'2-D mesh loss':>14} {'1 device loss':>14}")
  for i, (a, b) in enumerate(zip(losses, reference_losses)):
    print(f"{i:>4} {a:>14.6f} {b:>14.6f}")
  print(f"max |grad - full batch grad|     {results['grad_max_abs_diff']:.2e}")
  print(f"max |params - 1 device params|   {results['param_max_abs_diff']:.2e}")
  print(f"gradient shardings               {grad_specs}")
  print("collectives in the micro-batch loop (run once per micro-batch):")
  print(f"  optax_accum                    {counts.in_loop}")
  print(f"  the model alone (model axis)   {model_only.in_loop}")
  print(f"  naive lax.scan                 {naive.in_loop}")
  print(f"collectives after the loop       {counts.outside}")
  return results


if __name__ == "__main__":
  main()
