r"""A policy-gradient loss normalised over the whole generation batch, exactly.

GRPO/DAPO-style "token-level" normalisation: the loss of a generation batch
is the sum, over every completion token of the batch, of the per-token
policy-gradient term, divided by the number of completion tokens of the
whole batch (not of each micro-batch, not of each sequence). Split into k
micro-batches, each micro-batch's loss is the SUM of its tokens' terms, and
``oa.accumulate(..., loss_reduction="sum")`` with ``num_tokens=mask.sum()``
divides the summed gradient by the batch's token count once, on the update:

  updates, state = tx.update(grads, state, params, num_tokens=mb["mask"].sum())

The script makes GRPO rollouts of a tiny bigram policy (synthetic, with a
fixed seed: nothing is downloaded), sorts them by length as loaders do, so
that the micro-batches hold very different numbers of completion tokens, and
takes a few PPO-clipped steps on them four ways: (a) the full batch, (b)
``oa.accumulate`` over k micro-batches, (c) ``oa.value_and_grad`` in one call,
(d) the naive recipe, each micro-batch's mean over its own tokens, averaged
over the k micro-batches (``optax.MultiSteps``). It prints each one's
gradient and parameters against (a): (b) and (c) agree to float32 rounding,
(d) does not. See README.md.

Run it from the repository root (a few seconds)::

  python examples/rl_token_level/main.py
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa

VOCAB = 16
DIM = 16
GOOD_TOKENS = 4  # the reward: the fraction of completion tokens below this.
EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's asymmetric ("clip-higher") PPO clip.


# The policy and its loss.


def init_policy(seed: int) -> dict[str, jax.Array]:
  """A bigram policy: the next token's logits from the previous token."""
  rng = np.random.default_rng(seed)
  return {"embed": jnp.asarray(rng.normal(size=(VOCAB, DIM)), jnp.float32),
          "w": jnp.asarray(rng.normal(size=(DIM, VOCAB)) * 0.5, jnp.float32),
          "b": jnp.zeros(VOCAB, jnp.float32)}


def log_probs(params, prev, tokens):
  """``log pi(tokens | prev)``, elementwise."""
  logits = jnp.tanh(params["embed"][prev]) @ params["w"] + params["b"]
  logp = jax.nn.log_softmax(logits)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def token_terms(params, batch):
  """Each completion token's PPO-clipped policy-gradient term, masked."""
  ratio = jnp.exp(log_probs(params, batch["prev"], batch["tokens"])
                  - batch["logp_old"])
  adv = batch["advantage"][:, None]
  clipped = jnp.clip(ratio, 1.0 - EPS_LOW, 1.0 + EPS_HIGH)
  return -jnp.minimum(ratio * adv, clipped * adv) * batch["mask"]


def num_tokens(batch):
  """A (micro-)batch's completion tokens."""
  return batch["mask"].sum()


def sum_loss(params, microbatch):
  """A micro-batch's loss: the SUM of its tokens' terms (not their mean)."""
  return token_terms(params, microbatch).sum()


def batch_loss(params, batch):
  """The whole batch's loss, token-level: sum over all tokens / all tokens."""
  return sum_loss(params, batch) / jnp.maximum(num_tokens(batch), 1.0)


def naive_mean_loss(params, microbatch):
  """The naive recipe's micro-batch loss: the mean over its own tokens."""
  return batch_loss(params, microbatch)


# The rollouts.


def make_rollouts(params, args) -> dict[str, np.ndarray]:
  """GRPO rollouts of ``params``' policy, sorted by completion length.

  ``args.prompts`` prompts (a start token each) with ``args.group``
  completions each, of lengths from 1 to ``args.max_len``; the reward is the
  fraction of completion tokens below ``GOOD_TOKENS``, and the advantage the
  reward normalised within its prompt's group (GRPO).
  """
  rng = np.random.default_rng(args.seed)
  rows, max_len = args.prompts * args.group, args.max_len
  table = jax.nn.log_softmax(
      jnp.tanh(params["embed"]) @ params["w"] + params["b"])
  probs = np.exp(np.asarray(table, np.float64))
  probs /= probs.sum(axis=1, keepdims=True)
  prev = np.zeros((rows, max_len), np.int32)
  tokens = np.zeros((rows, max_len), np.int32)
  prev[:, 0] = np.repeat(rng.integers(0, VOCAB, args.prompts), args.group)
  for t in range(max_len):
    if t:
      prev[:, t] = tokens[:, t - 1]
    cumulative = probs[prev[:, t]].cumsum(axis=1)
    tokens[:, t] = (rng.uniform(size=(rows, 1)) > cumulative).sum(axis=1)
  tokens = np.minimum(tokens, VOCAB - 1)
  lengths = rng.integers(1, max_len + 1, size=rows)
  mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.float32)
  reward = ((tokens < GOOD_TOKENS) * mask).sum(axis=1) / lengths
  groups = reward.reshape(args.prompts, args.group)
  advantage = ((groups - groups.mean(axis=1, keepdims=True))
               / (groups.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)
  batch = {"prev": prev, "tokens": tokens, "mask": mask,
           "advantage": advantage.astype(np.float32)}
  batch["logp_old"] = np.asarray(log_probs(params, prev, tokens))
  order = np.argsort(lengths, kind="stable")  # short completions first.
  return {name: value[order] for name, value in batch.items()}


def split(batch, k: int):
  """The k micro-batches: contiguous blocks of rows, as oa.value_and_grad's."""
  size = len(batch["mask"]) // k
  return [{name: value[i * size : (i + 1) * size]
           for name, value in batch.items()} for i in range(k)]


# The four runs.


def optimizer(lr: float) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))


def train_whole_batch(grad_fn, params, batch, args):
  """One gradient of the whole batch per step, from ``grad_fn``."""
  opt = optimizer(args.lr)

  @jax.jit
  def step(params, opt_state, batch):
    grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = opt.init(params)
  for _ in range(args.steps):
    params, opt_state = step(params, opt_state, batch)
  return params


def train_full_batch(params, batch, args):
  """(a): one gradient of the whole batch's token-level loss per step."""
  return train_whole_batch(jax.grad(batch_loss), params, batch, args)


def train_accumulate(params, batch, args):
  """(b): k micro-steps per update, each the gradient of a SUM of terms."""
  tx = oa.accumulate(optimizer(args.lr), every_k=args.k, loss_reduction="sum")

  @jax.jit
  def micro_step(params, state, microbatch):
    grads = jax.grad(sum_loss)(params, microbatch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=num_tokens(microbatch))
    return oa.apply_if_updated(params, updates, state), state

  state = tx.init(params)
  for _ in range(args.steps):
    for microbatch in split(batch, args.k):
      params, state = micro_step(params, state, microbatch)
  return params


def one_call_grad_fn(k: int):
  """(c)'s gradient: the k micro-batches in one lax.scan."""
  return oa.value_and_grad(sum_loss, num_microbatches=k, loss_reduction="sum",
                           num_tokens_fn=num_tokens)


def train_one_call(params, batch, args):
  """(c): oa.value_and_grad over the k micro-batches, one call per step."""
  grad_fn = one_call_grad_fn(args.k)
  return train_whole_batch(lambda p, b: grad_fn(p, b)[1], params, batch, args)


def train_naive(params, batch, args):
  """(d): each micro-batch's own mean, averaged over k (optax.MultiSteps)."""
  tx = optax.MultiSteps(optimizer(args.lr), every_k_schedule=args.k)

  @jax.jit
  def micro_step(params, state, microbatch):
    grads = jax.grad(naive_mean_loss)(params, microbatch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(args.steps):
    for microbatch in split(batch, args.k):
      params, state = micro_step(params, state, microbatch)
  return params


def first_gradients(params, batch, k: int) -> dict[str, Any]:
  """The gradient each run's optimizer receives at ``params``."""
  tx = oa.accumulate(optax.identity(), every_k=k, loss_reduction="sum")

  @jax.jit
  def accumulated(params, microbatches):  # what oa.accumulate hands inner
    state = tx.init(params)
    for microbatch in microbatches:
      grads, state = tx.update(jax.grad(sum_loss)(params, microbatch), state,
                               params, num_tokens=num_tokens(microbatch))
    return grads

  @jax.jit
  def naive(params, microbatches):  # what optax.MultiSteps hands its inner
    grads = [jax.grad(naive_mean_loss)(params, mb) for mb in microbatches]
    return jax.tree.map(lambda *g: sum(g) / k, *grads)

  microbatches = split(batch, k)
  return {
      "full_batch": jax.jit(jax.grad(batch_loss))(params, batch),
      "accumulate": accumulated(params, microbatches),
      "one_call": jax.jit(one_call_grad_fn(k))(params, batch)[1],
      "naive": naive(params, microbatches),
  }


# The report.

LABELS = {
    "full_batch": "(a) full batch: sum / all completion tokens",
    "accumulate": '(b) oa.accumulate, loss_reduction="sum"',
    "one_call": '(c) oa.value_and_grad, loss_reduction="sum"',
    "naive": "(d) naive: mean per micro-batch, / k",
}


def _max_abs(tree) -> float:
  return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))


def _diff(tree, other):
  return jax.tree.map(jnp.subtract, tree, other)


def print_report(results: dict[str, Any]) -> None:
  tokens = results["microbatch_tokens"]
  print(f"{results['rows']} completions sorted by length, k={len(tokens)}"
        f" micro-batches of {', '.join(str(int(n)) for n in tokens)}"
        f" completion tokens:\nin (d), a token of the first micro-batch weighs"
        f" {max(tokens) / min(tokens):.1f}x one of the last.")
  print(f"\n{'run':<46}{'|grad - (a)|':>14}{'|param - (a)|':>15}"
        f"{'loss':>9}")
  print("-" * 84)
  for name, label in LABELS.items():
    print(f"{label:<46}{results['grad_error'][name]:>14.2e}"
          f"{results['param_error'][name]:>15.2e}"
          f"{results['loss'][name]:>9.4f}")
  print(f"|grad - (a)|: at the start, relative to max |grad (a)|."
        f" After {results['steps']} updates:\nmax |param - (a)|, and the"
        f" batch's token-level loss (at the start:"
        f" {results['initial_loss']:.4f}).")
  print(f"\n(b) and (c) take the full batch's step: {results['exact']}."
        f" The naive recipe (d) is off by\n"
        f"{results['grad_error']['naive']:.0%} of the gradient.")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--k", type=int, default=4,
                      help="micro-batches per optimizer update")
  parser.add_argument("--prompts", type=int, default=8,
                      help="prompts in the generation batch")
  parser.add_argument("--group", type=int, default=4,
                      help="completions per prompt (GRPO's group)")
  parser.add_argument("--max-len", type=int, default=64,
                      help="the longest completion, in tokens")
  parser.add_argument("--steps", type=int, default=4,
                      help="optimizer updates on the rollouts (PPO epochs)")
  parser.add_argument("--lr", type=float, default=0.05,
                      help="AdamW's learning rate")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the policy and the rollouts")
  args = parser.parse_args(argv)
  if (args.prompts * args.group) % args.k:
    parser.error(f"--k {args.k} must divide the {args.prompts * args.group}"
                 " completions (--prompts x --group).")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains the four runs; returns their errors against the full batch."""
  args = parse_args(argv)
  params = init_policy(args.seed)
  batch = jax.tree.map(jnp.asarray, make_rollouts(params, args))
  grads = first_gradients(params, batch, args.k)
  scale = _max_abs(grads["full_batch"])
  trained = {"full_batch": train_full_batch(params, batch, args),
             "accumulate": train_accumulate(params, batch, args),
             "one_call": train_one_call(params, batch, args),
             "naive": train_naive(params, batch, args)}
  reference = trained["full_batch"]
  results = {
      "rows": len(batch["mask"]),
      "initial_loss": float(batch_loss(params, batch)),
      "steps": args.steps,
      "microbatch_tokens": [float(num_tokens(mb))
                            for mb in split(batch, args.k)],
      "grad_error": {name: _max_abs(_diff(g, grads["full_batch"])) / scale
                     for name, g in grads.items()},
      "param_error": {name: _max_abs(_diff(p, reference))
                      for name, p in trained.items()},
      "loss": {name: float(batch_loss(p, batch))
               for name, p in trained.items()},
  }
  # float32 rounding: of the gradient, and of AdamW's steps on it (which divide
  # rounding noise by its own size where a gradient is near zero).
  results["exact"] = all(
      results["grad_error"][name] < 1e-5 and results["param_error"][name] < 1e-4
      for name in ("accumulate", "one_call"))
  print_report(results)
  return results


if __name__ == "__main__":
  main()
