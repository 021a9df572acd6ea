"""p. The first step: trace, lower and compile a donated micro-step.

What a user waits for at every start and every retrace, before the first
micro-batch runs: ``jax.jit(step).trace``, ``.lower`` and ``.compile`` of
a donated micro-step over a many-leaf tree (blocks of three leaves, as a
transformer's), with ``clip_by_global_norm`` + ``adamw`` on a cosine
schedule as the inner optimizer. Candidates: the inner optimizer alone
(``inner.update`` + ``optax.apply_updates``, no accumulation),
``optax.MultiSteps`` + ``optax.apply_updates``, ``oa.accumulate``'s
``tx.update`` + ``oa.apply_if_updated``, and ``oa.update_and_apply``. Each
repetition builds fresh transformations and clears JAX's caches, so that
nothing is reused; repetitions are interleaved. Also counted: how often
each traces ``inner.update`` (issue 49: MultiSteps 2, ours at most that).
Checked: ours never trace the inner more often than MultiSteps.
"""

import time

import jax
import jax.numpy as jnp
import optax

import harness
import optax_accum as oa
import report

KEY = "p"
TITLE = "First step: trace + lower + compile of a donated micro-step"
CONFIGS = {
    "full": {"blocks": 48, "size": 64, "reps": 9},
    "quick": {"blocks": 24, "size": 64, "reps": 3},
    "toy": {"blocks": 2, "size": 8, "reps": 1},
}
INNER, MULTI, SPLIT, FUSED = ("inner alone", "optax.MultiSteps",
                              "tx.update + oa.apply_if_updated",
                              "oa.update_and_apply")
TARGET = 1.0  # ours at most MultiSteps's first step (issue 49, item 3).


def _params(blocks, size):
  return {f"block{i}": {"w": jnp.zeros((size, size)), "b": jnp.zeros(size),
                        "scale": jnp.ones(size)} for i in range(blocks)}


def _counted(calls):
  inner = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.cosine_decay_schedule(1e-3, 100)))

  def update(updates, state, params=None, **extra_args):
    calls.append(1)
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update)


def _step(kind, calls):
  """``(init, step)``: ``step(params, state, grads) -> (params, state)``."""
  inner = _counted(calls)
  if kind == INNER:
    tx = inner
  elif kind == MULTI:
    tx = optax.MultiSteps(inner, every_k_schedule=4)
  else:
    tx = oa.accumulate(inner, every_k=4, equal_weights=True)

  def step(params, state, grads):
    if kind == FUSED:
      return oa.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    if kind == SPLIT:
      return oa.apply_if_updated(params, updates, state), state
    return optax.apply_updates(params, updates), state

  return tx.init, step


def first_step(kind, params):
  """Seconds to trace, to lower and to compile; the inner's traces."""
  jax.clear_caches()
  calls = []
  init, step = _step(kind, calls)
  state = jax.eval_shape(init, params)
  jitted = jax.jit(step, donate_argnums=(0, 1, 2))
  t0 = time.perf_counter()
  traced = jitted.trace(params, state, params)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
          "total_s": t3 - t0, "inner_traces": len(calls)}


def run(cfg):
  params = jax.eval_shape(lambda: _params(cfg["blocks"], cfg["size"]))
  kinds = (INNER, MULTI, SPLIT, FUSED)
  runs = {kind: [] for kind in kinds}
  for r in range(cfg["reps"]):
    for i in range(len(kinds)):
      kind = kinds[(r + i) % len(kinds)]
      runs[kind].append(first_step(kind, params))
  out = {"leaves": 3 * cfg["blocks"], "candidates": {}}
  for kind, measured in runs.items():
    out["candidates"][kind] = {
        part: harness.summarize([m[part] for m in measured])
        for part in ("trace_s", "lower_s", "compile_s", "total_s")}
    out["candidates"][kind]["inner_traces"] = measured[0]["inner_traces"]
  return out


def checks(result):
  c = result["candidates"]
  return [harness.Check(
      f"{kind}: inner.update traces / MultiSteps's", c[kind]["inner_traces"]
      / c[MULTI]["inner_traces"], 1.0) for kind in (SPLIT, FUSED)]


def summary_rows(result):
  c = result["candidates"]
  peer = c[MULTI]["total_s"]["median_s"]
  rows = []
  for kind in (SPLIT, FUSED):
    ours = c[kind]["total_s"]["median_s"]
    rows.append(report.Row(
        f"p. first step (trace + lower + compile), {result['leaves']} leaves,"
        f" clip + adamw + schedule, {kind} / optax.MultiSteps",
        report.ms(ours), report.ms(peer), f"{ours / peer:.2f}x",
        f"<= {TARGET}x", ours <= TARGET * peer))
  return rows


def markdown(result):
  lines = [f"{result['leaves']} leaves; medians (p25-p75) of interleaved,"
           " cache-cleared repetitions.", "",
           "| candidate | inner traces | trace | lower | compile | total |",
           "|---|---|---|---|---|---|"]
  for kind, c in result["candidates"].items():
    cells = [f"{report.ms(c[p]['median_s'])} ({report.ms(c[p]['p25_s'])}-"
             f"{report.ms(c[p]['p75_s'])})"
             for p in ("trace_s", "lower_s", "compile_s", "total_s")]
    lines.append(f"| {kind} | {c['inner_traces']} | " + " | ".join(cells)
                 + " |")
  return lines
