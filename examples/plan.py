"""Pick the number of micro-batches for a memory budget, before anything runs.

A small decoder-only transformer whose weights are sharded over the data axis
of 8 simulated CPU devices (FSDP). ``oa.plan_microbatches`` compiles candidate
train steps ahead of time and reads, from XLA, the memory each device needs
and the collectives each update makes; at each budget it prints every
candidate it compiled and the one it chose: the fewest micro-batches that
fit, with the FSDP policy (``gradient_sync``, ``gather_params``) that
communicates least. Then it runs the chosen step once and checks it against
``jax.value_and_grad`` of the whole batch.

Run it (about a minute on 2 CPU cores)::

  python examples/plan.py
  python examples/plan.py --budgets-mib 40 12 9.5 6
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import optax_accum as oa

DEVICES = 8


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--budgets-mib", type=float, nargs="+",
                      default=[12.0, 9.5],
                      help="memory budgets to plan for, MiB per device")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks")
  parser.add_argument("--dim", type=int, default=128,
                      help="model width (a multiple of 8: weights are"
                      " sharded over 8 devices)")
  parser.add_argument("--vocab", type=int, default=256,
                      help="vocabulary size (a multiple of 8)")
  parser.add_argument("--seq-len", type=int, default=64,
                      help="tokens per sequence")
  parser.add_argument("--batch-size", type=int, default=128,
                      help="sequences per step, over all devices")
  parser.add_argument("--max-microbatches", type=int, default=8,
                      help="largest number of micro-batches to consider")
  return parser.parse_args(argv)


def init_params(seed: int, args: argparse.Namespace) -> dict[str, Any]:
  """Embedding, blocks and final norm; matrices scaled by 1/sqrt(fan-in)."""
  rng = np.random.default_rng(seed)
  d = args.dim
  normal = lambda shape: (rng.normal(size=shape) / shape[0] ** 0.5).astype(
      np.float32)
  ones = np.ones(d, np.float32)
  blocks = [{
      "norm1": ones, "norm2": ones,
      "wq": normal((d, d)), "wk": normal((d, d)), "wv": normal((d, d)),
      "wo": normal((d, d)), "w1": normal((d, 4 * d)), "w2": normal((4 * d, d)),
  } for _ in range(args.layers)]
  return {"embed": normal((args.vocab, d)), "blocks": blocks, "norm": ones}


def fsdp_specs(params: dict[str, Any]) -> dict[str, Any]:
  """Every matrix sharded over "data" along its first axis; norms replicated."""
  return jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), params)


def _norm(x, scale):
  return scale * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _block(p, x):
  h = _norm(x, p["norm1"])
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  scores = q @ k.swapaxes(-1, -2) / q.shape[-1] ** 0.5
  causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
  scores = jnp.where(causal, scores, -1e9)
  x = x + jax.nn.softmax(scores) @ v @ p["wo"]
  h = _norm(x, p["norm2"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def loss_fn(params, batch):
  """Next-token cross-entropy, mean over the unmasked target tokens."""
  # Written for jax.jit with Explicit axes: on the mesh the gather says
  # where its rows go (with the batch, sharded over "data").
  on_mesh = not jax.sharding.get_abstract_mesh().empty
  x = params["embed"].at[batch["tokens"][:, :-1]].get(
      out_sharding=P("data", None, None) if on_mesh else None)
  for block in params["blocks"]:
    x = _block(block, x)
  logits = _norm(x, params["norm"]) @ params["embed"].T
  logp = jax.nn.log_softmax(logits)
  targets = batch["tokens"][:, 1:]
  nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  mask = batch["mask"][:, 1:]
  return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def num_tokens(batch):
  return batch["mask"][:, 1:].sum()


def make_batch(args: argparse.Namespace) -> dict[str, np.ndarray]:
  """Random tokens; sequences of uneven length (the rest is padding)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, args.vocab, (args.batch_size, args.seq_len))
  lengths = rng.integers(2, args.seq_len + 1, args.batch_size)
  mask = np.arange(args.seq_len)[None] < lengths[:, None]
  return {"tokens": tokens.astype(np.int32), "mask": mask.astype(np.float32)}


def _divisors_up_to(n: int, most: int) -> list[int]:
  return [k for k in range(1, min(n, most) + 1) if n % k == 0]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Plans at each budget; returns the plans (None where nothing fits)."""
  args = parse_args(argv)
  if jax.device_count() < DEVICES:
    raise SystemExit(f"Needs {DEVICES} devices, found {jax.device_count()}.")
  mesh = jax.make_mesh((DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  host_params = init_params(0, args)
  host_batch = make_batch(args)
  rows = args.batch_size // DEVICES
  plans = {}
  with jax.set_mesh(mesh):
    params = jax.device_put(host_params, fsdp_specs(host_params))
    batch = jax.device_put(host_batch, P("data"))
    for budget_mib in args.budgets_mib:
      print(f"\nmemory_budget = {budget_mib:g} MiB per device")
      try:
        plan = oa.plan_microbatches(
            loss_fn, params, batch, memory_budget=int(budget_mib * 2**20),
            candidates=_divisors_up_to(rows, args.max_microbatches),
            num_tokens_fn=num_tokens, axis_name="data")
      except ValueError as e:
        print(e)
        plans[budget_mib] = None
        continue
      print(plan.table)
      print(f"-> num_microbatches={plan.num_microbatches},"
            f" gradient_sync={plan.gradient_sync!r},"
            f" gather_params={plan.gather_params!r}:"
            f" {plan.memory_bytes / 2**20:.2f} MiB per device,"
            f" {plan.collectives_per_update} collectives per update")
      plans[budget_mib] = plan
    chosen = [p for p in plans.values() if p is not None]
    if chosen:
      loss, grads = jax.jit(chosen[-1].value_and_grad)(params, batch)
  if chosen:
    expected_loss, expected = jax.jit(jax.value_and_grad(loss_fn))(
        host_params, host_batch)
    error = max(np.abs(np.asarray(g) - np.asarray(e)).max() for g, e in zip(
        jax.tree.leaves(grads), jax.tree.leaves(expected)))
    sharded = grads["embed"].sharding.is_equivalent_to(
        params["embed"].sharding, 2)
    print(f"\nThe last plan's step: loss {float(loss):.4f} (whole batch"
          f" {float(expected_loss):.4f}), largest gradient difference"
          f" {error:.1e}; gradient sharded like the parameters: {sharded}")
  return {"plans": plans}


if __name__ == "__main__":
  # Eight simulated CPU devices; must be set before jax starts its backends.
  jax.config.update("jax_num_cpu_devices", DEVICES)
  main()
