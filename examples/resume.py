"""Checkpoint in the middle of an accumulation cycle, resume in a new process.

``oa.AccumulateState`` is a pytree of arrays: the running gradient sum, the
token count, the position in the cycle and the wrapped optimizer's state.
Saving it with the parameters (here with orbax) captures everything, even
halfway through a cycle, so a run that stops and restarts is bit-for-bit the
run that never stopped. This script:

1. trains ``--micro-steps`` micro-steps in one go (the reference run);
2. trains again, stops after ``--save-at`` micro-steps (mid-cycle: the partial
   gradient sum is in the optimizer state), saves a checkpoint and exits that
   loop;
3. starts a NEW Python process that restores the checkpoint, finishes the run
   and saves the result;
4. checks that the resumed result equals the reference bit for bit.

Run it::

  python examples/resume.py
  python examples/resume.py --micro-steps 40 --save-at 17 --k 4

To restore, give orbax the state's structure (``jax.eval_shape`` of the
initialisation), so that the ``AccumulateState`` and the optax states inside it
come back as the same NamedTuples::

  abstract = jax.eval_shape(init_train_state)
  state = ocp.StandardCheckpointer().restore(path, abstract)
"""

import argparse
from collections.abc import Sequence
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum as oa

MICROBATCH = 16  # rows per micro-batch; a random number of them are padding


def make_optimizer(k: int) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
  return oa.accumulate(
      optax.chain(optax.clip_by_global_norm(1.0),
                  optax.adamw(schedule, weight_decay=1e-2)),
      every_k=k)


def init_train_state(k: int) -> dict[str, Any]:
  """Parameters, optimizer state and micro-step counter, all arrays."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": 0.3 * jax.random.normal(k1, (8, 32)), "b1": jnp.zeros(32),
            "w2": 0.3 * jax.random.normal(k2, (32, 1)), "b2": jnp.zeros(1)}
  return {"params": params, "opt_state": make_optimizer(k).init(params),
          "micro_step": jnp.zeros([], jnp.int32)}


def microbatch(micro_step: jax.Array) -> dict[str, jax.Array]:
  """The data of a micro-step: a pure function of its index, so resumable."""
  key = jax.random.fold_in(jax.random.key(1), micro_step)
  kx, kn = jax.random.split(key)
  x = jax.random.normal(kx, (MICROBATCH, 8))
  num_real = jax.random.randint(kn, (), 1, MICROBATCH + 1)  # uneven tokens
  mask = (jnp.arange(MICROBATCH) < num_real).astype(jnp.float32)
  return {"x": x, "y": jnp.sin(x.sum(1, keepdims=True)), "mask": mask[:, None]}


def loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  err = batch["mask"] * (hidden @ params["w2"] + params["b2"] - batch["y"])
  return (err**2).sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def make_train_micro_step(k: int):
  tx = make_optimizer(k)

  @jax.jit
  def train_micro_step(state):
    batch = microbatch(state["micro_step"])
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"],
                                   num_tokens=batch["mask"].sum())
    return {"params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "micro_step": state["micro_step"] + 1}, loss

  return train_micro_step


def train(state: dict[str, Any], until: int, k: int) -> dict[str, Any]:
  train_micro_step = make_train_micro_step(k)
  while int(state["micro_step"]) < until:
    state, _ = train_micro_step(state)
  return state


def save(path: pathlib.Path, state: dict[str, Any]) -> None:
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path.absolute(), state)
  checkpointer.wait_until_finished()
  checkpointer.close()


def restore(path: pathlib.Path, k: int) -> dict[str, Any]:
  abstract = jax.eval_shape(lambda: init_train_state(k))
  checkpointer = ocp.StandardCheckpointer()
  state = checkpointer.restore(path.absolute(), abstract)
  checkpointer.close()
  return state


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--micro-steps", type=int, default=30,
                      help="micro-steps in the whole run")
  parser.add_argument("--save-at", type=int, default=13,
                      help="micro-step after which to checkpoint")
  parser.add_argument("--k", type=int, default=4,
                      help="micro-steps per optimizer update")
  parser.add_argument("--dir", default=None,
                      help="checkpoint folder (None: a temporary one)")
  # Internal: what the new process is asked to do.
  parser.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--save-to", default=None, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def resume_in_this_process(args: argparse.Namespace) -> None:
  state = restore(pathlib.Path(args.resume_from), args.k)
  print(f"[new process] restored at micro-step {int(state['micro_step'])},"
        f" micro-step {int(state['opt_state'].micro_step)} of the cycle")
  save(pathlib.Path(args.save_to), train(state, args.micro_steps, args.k))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the experiment; returns whether the resumed run is bit-identical."""
  args = parse_args(argv)
  if args.resume_from:
    resume_in_this_process(args)
    return {}
  if not 0 < args.save_at < args.micro_steps:
    raise ValueError(f"--save-at must be in (0, --micro-steps), got"
                     f" {args.save_at} and {args.micro_steps}.")
  with tempfile.TemporaryDirectory() as tmp:
    folder = pathlib.Path(args.dir or tmp)
    reference = train(init_train_state(args.k), args.micro_steps, args.k)

    stopped = train(init_train_state(args.k), args.save_at, args.k)
    cycle = oa.find_accumulate_state(stopped["opt_state"])
    print(f"saving at micro-step {args.save_at}: micro-step"
          f" {int(cycle.micro_step)} of {args.k} in the cycle,"
          f" {float(cycle.token_count):.0f} tokens accumulated,"
          f" {int(cycle.count)} updates so far")
    save(folder / f"step_{args.save_at}", stopped)
    del stopped

    subprocess.run(
        [sys.executable, __file__,
         "--micro-steps", str(args.micro_steps), "--k", str(args.k),
         "--resume-from", str(folder / f"step_{args.save_at}"),
         "--save-to", str(folder / "resumed")],
        check=True)
    resumed = restore(folder / "resumed", args.k)

  leaves = zip(jax.tree.leaves(reference), jax.tree.leaves(resumed))
  pairs = [(np.asarray(a), np.asarray(b)) for a, b in leaves]
  same_structure = (jax.tree.structure(reference)
                    == jax.tree.structure(resumed))
  bitwise_equal = same_structure and all(
      a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
      for a, b in pairs)
  max_diff = max(float(np.max(np.abs(a.astype(np.float64) - b)))
                 if a.size else 0.0 for a, b in pairs)
  updates = int(oa.find_accumulate_state(resumed["opt_state"]).count)
  print(f"resumed run == uninterrupted run, bit for bit: {bitwise_equal}"
        f" (max |diff| {max_diff:g}; {args.micro_steps} micro-steps,"
        f" {updates} optimizer updates)")
  return {"bitwise_equal": bitwise_equal, "max_abs_diff": max_diff,
          "saved_micro_step_in_cycle": int(cycle.micro_step),
          "optimizer_updates": updates}


if __name__ == "__main__":
  main()
