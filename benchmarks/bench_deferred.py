"""l. The deferred micro-step loop without axis_name, on data x tensor.

``zoo/typed_model.py``'s cookbook-style decoder on a ``data x tensor``
mesh of 8 CPU devices (4 x 2, Explicit axes), one optimizer update over
``k`` micro-batches, four ways, against the full batch:

* ``full batch``: one ``jax.jit`` call of ``jax.value_and_grad`` and sgd;
* ``one call``: ``oa.value_and_grad(num_microbatches=k)`` and sgd in one
  call (the typed form's loop);
* ``jax.grad loop``: ``k`` jit calls of ``jax.grad`` + ``oa.accumulate``:
  JAX reduces the gradient in each call;
* ``deferred loop``: ``k`` jit calls of ``oa.value_and_grad(...,
  gradient_sync="deferred")`` + ``oa.accumulate`` built without
  ``axis_name`` (the types say which axes): the sum stays unreduced and is
  reduced once, in the emitting branch.

Then where a deferred call's time goes, each part compiled on its own and
timed interleaved with the others: the gradient alone (deferred, and
``jax.grad`` of the same micro-batch), and ``tx.update`` alone on an
unreduced gradient, non-emitting and emitting.

Per update: the bytes that reductions over ``data`` sum (the typed form's
fallback leaf, ``params['pos']``, included: it is reduced per call), and
the time (interleaved repetitions, medians). Checked: every update against
the full batch's. With fewer than 8 devices ``run`` measures in a child.
"""

import json
import sys

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

import harness
import optax_accum as oa
from optax_accum._src.compiled import hlo
import report
from zoo import typed_model as tm

KEY = "l"
TITLE = "The deferred micro-step loop without axis_name (data x tensor)"
DEVICES = 8
SHAPE, NAMES = (4, 2), ("data", "tensor")
CONFIGS = {
    "full": {"k": 4, "reps": 15, "batch": 256, "model": {
        "vocab": 2048, "seq": 64, "dim": 256, "heads": 8, "ffn": 1024,
        "layers": 4}},
    "quick": {"k": 4, "reps": 5, "batch": 64, "model": {
        "vocab": 512, "seq": 32, "dim": 128, "heads": 4, "ffn": 512,
        "layers": 2}},
    "toy": {"k": 2, "reps": 1, "batch": 16, "model": {
        "vocab": 32, "seq": 8, "dim": 16, "heads": 4, "ffn": 32,
        "layers": 1}},
}
FULL, ONE_CALL, NAIVE, DEFERRED = (
    "full batch", "one call", "jax.grad loop", "deferred loop")
PARTS = ("grad (deferred)", "grad (jax.grad)", "tx.update (non-emitting)",
         "tx.update (emitting)")
# Most of the jax.grad loop's time per update the deferred loop may take.
TIME_TARGET = 1.0
MIN_GRADIENT_BYTES = 64
LR = 0.1


def _data_bytes(compiled, mesh, k, loop_calls):
  """Bytes reduced over ``data`` per update: a call's times k (its branch
  once) for a loop of calls; a loop body's times k for one call."""
  total = 0
  for c in hlo.collectives(compiled, mesh):
    if (c.collective in ("all-reduce", "reduce-scatter")
        and "data" in (c.axes or ()) and c.nbytes >= MIN_GRADIENT_BYTES):
      repeats = (1 if c.branched else k) if loop_calls else (
          k if c.looped else 1)
      total += c.nbytes * repeats
  return total


def _programs(cfg, k, params, batch, mesh):
  loss_fn = tm.loss_fn(cfg)
  rows = batch["ids"].shape[0] // k
  micro = [jax.device_put(jax.tree.map(lambda x, i=i: x[i * rows:(i + 1)
                                                         * rows], batch),
                          NamedSharding(mesh, P("data"))) for i in range(k)]
  whole = jax.device_put(batch, NamedSharding(mesh, P("data")))
  sgd = optax.sgd(LR)
  naive_tx = oa.accumulate(sgd, every_k=k)
  deferred_tx = oa.accumulate(sgd, every_k=k)
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1,
                              num_tokens_fn=tm.num_tokens,
                              gradient_sync="deferred")
  one_call_fn = oa.value_and_grad(loss_fn, num_microbatches=k,
                                  num_tokens_fn=tm.num_tokens)

  def full(p, s, b):
    u, s = sgd.update(jax.grad(loss_fn)(p, b), s, p)
    return optax.apply_updates(p, u), s

  def one_call(p, s, b):
    u, s = sgd.update(one_call_fn(p, b)[1], s, p)
    return optax.apply_updates(p, u), s

  def naive(p, s, b):
    u, s = naive_tx.update(jax.grad(loss_fn)(p, b), s, p,
                           num_tokens=tm.num_tokens(b))
    return optax.apply_updates(p, u), s

  def deferred(p, s, b):
    u, s = deferred_tx.update(grad_fn(p, b)[1], s, p,
                              num_tokens=tm.num_tokens(b))
    return optax.apply_updates(p, u), s

  # The deferred state after one cycle (micro_step 0 again): typed like the
  # gradient from its first call on, so the timed calls compile once.
  deferred_state, step = deferred_tx.init(params), jax.jit(deferred)
  for b in micro:
    deferred_state = step(params, deferred_state, b)[1]
  steps = {FULL: (full, sgd.init(params), [whole]),
           ONE_CALL: (one_call, sgd.init(params), [whole]),
           NAIVE: (naive, naive_tx.init(params), micro),
           DEFERRED: (deferred, deferred_state, micro)}
  compiled = {name: jax.jit(f, donate_argnums=1).lower(params, s, b[0])
              .compile() for name, (f, s, b) in steps.items()}
  return steps, compiled, micro, grad_fn, deferred_tx, loss_fn


def _parts(params, micro, grad_fn, tx, loss_fn, state):
  """Each part of a deferred call compiled alone, and its arguments."""
  deferred_grads = jax.jit(lambda p, b: grad_fn(p, b)[1])
  g = deferred_grads(params, micro[0])
  update = jax.jit(lambda g, s, p, b, emit: tx.update(
      g, s, p, num_tokens=tm.num_tokens(b), emit=emit), static_argnums=4)
  return {
      PARTS[0]: (deferred_grads, (params, micro[0])),
      PARTS[1]: (jax.jit(jax.grad(loss_fn)), (params, micro[0])),
      PARTS[2]: (update, (g, state, params, micro[0], False)),
      PARTS[3]: (update, (g, state, params, micro[0], True)),
  }


def _in_process(cfg):
  k = cfg["k"]
  mesh = jax.make_mesh(SHAPE, NAMES, axis_types=(AxisType.Explicit,) * 2)
  mcfg = tm.Config(**cfg["model"], batch_axes=("data",), tensor="tensor")
  host_params, batch = tm.init(mcfg), tm.batch(mcfg, cfg["batch"])
  with jax.set_mesh(mesh):
    params = jax.tree.map(jax.device_put, host_params,
                          tm.specs(mcfg))
    steps, compiled, micro, grad_fn, tx, loss_fn = _programs(
        mcfg, k, params, batch, mesh)

    def update(name):
      _, state, inputs = steps[name]  # the state is donated: a fresh copy.
      return harness.update_by_calls(compiled[name], params,
                                     harness.copy_tree(state), inputs)

    updated, times = harness.time_updates(
        {name: (lambda n=name: update(n)) for name in compiled},
        reps=cfg["reps"], first=lambda _, p: jax.device_get(p))
    parts = _parts(params, micro, grad_fn, tx, loss_fn, steps[DEFERRED][1])
    part_times = harness.interleaved(
        {name: (lambda f=f, a=a: jax.block_until_ready(f(*a)))
         for name, (f, a) in parts.items()}, reps=cfg["reps"])
    data_bytes = {name: _data_bytes(c, mesh, k, name in (NAIVE, DEFERRED))
                  for name, c in compiled.items()}
  scale = max(harness.max_abs(updated[FULL]), 1.0)
  return {"k": k, "model": cfg["model"], "batch": cfg["batch"],
          "devices": DEVICES, "param_bytes": harness.tree_bytes(host_params),
          "candidates": harness.summarize_times(times),
          "parts": harness.summarize_times(part_times),
          "data_bytes_per_update": data_bytes,
          "max_abs_diff_vs_full": {
              name: harness.max_abs_diff(p, updated[FULL]) / scale
              for name, p in updated.items()}}


def run(cfg):
  if jax.device_count() >= DEVICES:
    return _in_process(cfg)
  return harness.in_child(__file__, cfg)


def checks(result):
  return [harness.Check(f"l. {name}: max abs param diff vs full batch"
                        " / scale", diff, 1e-5)
          for name, diff in result["max_abs_diff_vs_full"].items()]


def _median(result, name):
  return result["candidates"][name]["median_s"]


def summary_rows(result):
  k = result["k"]
  ours, naive = _median(result, DEFERRED), _median(result, NAIVE)
  b = result["data_bytes_per_update"]
  return [
      report.Row(f"l. time per update, deferred loop / jax.grad loop"
                 f" (data x tensor, k={k})", report.ms(ours),
                 report.ms(naive), f"{ours / naive:.2f}x",
                 f"<= {TIME_TARGET}x", ours / naive <= TIME_TARGET),
      report.Row(f"l. bytes reduced over data per update, deferred /"
                 f" jax.grad loop (k={k})", report.mib(b[DEFERRED]),
                 report.mib(b[NAIVE]),
                 f"{b[DEFERRED] / max(b[NAIVE], 1):.3f}x",
                 f"<= {1.5 / k:.3f}x", b[DEFERRED] <= 1.5 / k * b[NAIVE]),
  ]


def markdown(result):
  k, full = result["k"], _median(result, FULL)
  lines = [
      f"One update over k={k} micro-batches of a batch of"
      f" {result['batch']} rows on a 4 x 2 data x tensor mesh of"
      f" {result['devices']} simulated CPU devices,"
      f" `{report.spec(result['model'])}` (params"
      f" {report.mib(result['param_bytes'])}). Bytes that reductions over"
      " `data` sum per update, and the median time (p25-p75):",
      "",
      "| | reduced over data | time | vs full batch |",
      "|---|---|---|---|",
  ]
  for name in (FULL, ONE_CALL, NAIVE, DEFERRED):
    t = result["candidates"][name]
    lines.append(
        f"| {name} | {report.mib(result['data_bytes_per_update'][name])} |"
        f" {report.ms(t['median_s'])} ({report.ms(t['p25_s'])}-"
        f"{report.ms(t['p75_s'])}) | {t['median_s'] / full:.2f}x |")
  lines += ["", "Where a deferred call's time goes (each part compiled"
            " alone, interleaved):", "", "| part | time |", "|---|---|"]
  for name in PARTS:
    t = result["parts"][name]
    lines.append(f"| {name} | {report.ms(t['median_s'])} |")
  return lines


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(_in_process(json.loads(sys.argv[1]))))
