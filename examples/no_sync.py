"""One jit call per micro-batch, one gradient reduction per update (no_sync).

The loop of PyTorch DDP with ``no_sync()``, Keras's accumulating optimizer or
the HF Trainer: each micro-batch is its own jitted call. With ``jax.grad``
on a mesh, every call all-reduces the whole gradient (``k`` per update).
``oa.value_and_grad(..., gradient_sync="deferred")`` returns the gradient
unreduced instead (typed ``{U:data}``), and ``oa.accumulate`` (no
``axis_name``: the types say which axes) adds the devices' partials across
calls and all-reduces them once, on the emitting call.

The script runs both loops on 8 simulated CPU devices over micro-batches with
uneven token counts, checks that their updates agree with the whole batch's
gradient step, and prints the gradient-sized all-reduces per update that the
compiled micro-steps hold (read with ``oa.count_collectives``).

Run it (a few seconds)::

  python examples/no_sync.py
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_accum as oa

DEVICES = 8


def loss_fn(params, batch):  # mean squared error over the unmasked tokens
  pred = batch["x"] @ params["w"]
  # The bias broadcast to the predictions' sharding (over "data") before the
  # add: so JAX types it reduced and its gradient is summed once per update
  # too. (A plain `pred + params["b"]` is exact, but reduced in every call.)
  on_mesh = not jax.sharding.get_abstract_mesh().empty
  pred = pred + jax.lax.broadcast_in_dim(
      params["b"], pred.shape, (pred.ndim - 1,),
      out_sharding=jax.typeof(pred).sharding.spec if on_mesh else None)
  err = batch["mask"] * (pred - batch["y"])
  return (err**2).sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def num_tokens(batch):
  return batch["mask"].sum()


def micro_batches(k: int, rows: int, dim: int) -> list[dict[str, jax.Array]]:
  """``k`` micro-batches of ``rows`` rows, each row with 0 to 4 tokens."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(k):
    lengths = rng.integers(0, 5, size=rows)
    out.append({
        "x": jnp.asarray(rng.normal(size=(rows, 4, dim)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, 4, 1)), jnp.float32),
        "mask": jnp.asarray(np.arange(4) < lengths[:, None],
                            jnp.float32)[..., None],
    })
  return out


def deferred_step(k: int):
  """The micro-step of the DDP ``no_sync`` loop, translated."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=k)
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1,
                              num_tokens_fn=num_tokens,
                              gradient_sync="deferred")

  @jax.jit
  def micro_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)  # unreduced: no all-reduce here
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=num_tokens(batch))
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, micro_step


def naive_step(k: int):
  """The same loop with ``jax.grad``: the gradient is reduced every call."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=k)

  @jax.jit
  def micro_step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=num_tokens(batch))
    return optax.apply_updates(params, updates), opt_state, None

  return tx, micro_step


def gradient_reductions_per_update(compiled, k: int) -> int:
  """The gradient's all-reduces per update, read off a compiled micro-step.

  Each call's all-reduces count ``k`` times, the emitting branch's once.
  All-reduces of scalars only (the loss, the token count) are left out.
  """
  counts = oa.count_collectives(compiled, include_scalars=False)
  return (k * counts.outside.get("all-reduce", 0)
          + counts.in_branch.get("all-reduce", 0))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--k", type=int, default=8,
                      help="micro-batches (jit calls) per optimizer update")
  parser.add_argument("--rows", type=int, default=32,
                      help="rows per micro-batch, split over the 8 devices")
  parser.add_argument("--dim", type=int, default=16, help="input features")
  args = parser.parse_args(argv)
  if jax.device_count() < DEVICES:
    raise SystemExit(f"Needs {DEVICES} devices, found {jax.device_count()}.")
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  batches = micro_batches(args.k, args.rows, args.dim)
  init = {"w": jnp.zeros((args.dim, 1)), "b": jnp.zeros(1)}
  results = {}
  with jax.set_mesh(mesh):
    sharded = [jax.device_put(b, P("data")) for b in batches]
    for name, make in (("jax.grad", naive_step), ("deferred", deferred_step)):
      tx, micro_step = make(args.k)
      params, opt_state = jax.device_put(init, P()), tx.init(init)
      compiled = micro_step.lower(params, opt_state, sharded[0]).compile()
      for batch in sharded:
        params, opt_state, _ = micro_step(params, opt_state, batch)
      reductions = gradient_reductions_per_update(compiled, args.k)
      results[name] = {"params": params, "reductions": reductions}
      print(f"{name:>8} loop: {reductions} gradient all-reduce(s) per update"
            f" of {args.k} micro-batches")
  whole = jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, init,
                          jax.grad(loss_fn)(init, whole))
  for r in results.values():
    r["error"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(r["params"]), jax.tree.leaves(expected)))
  print("largest difference to the whole batch's step: "
        + ", ".join(f"{name} {r['error']:.1e}" for name, r in results.items()))
  return results


if __name__ == "__main__":
  # Eight simulated CPU devices; must be set before jax starts its backends.
  jax.config.update("jax_num_cpu_devices", DEVICES)
  main()
