"""m. The deferred loop in an ``nnx.Optimizer``, as a new user writes it.

An NNX decoder (``zoo.models.make_nnx_decoder``: ``nnx.Embed``,
``nnx.LayerNorm``, ``nnx.Linear`` kernels sharded over ``tensor`` with
``nnx.with_partitioning``) on a 4 x 2 ``data x tensor`` mesh of 8 simulated
CPU devices (Explicit axes), adamw. One optimizer update over ``k``
micro-batches, each way in the same process, interleaved:

* ``nnx deferred``: ``k`` calls of an ``nnx.jit`` micro-step running
  ``oa.value_and_grad(..., gradient_sync="deferred")`` and
  ``optimizer.update(model, grads, num_tokens=...)`` on
  ``nnx.Optimizer(model, oa.accumulate(adamw, every_k=k), wrt=nnx.Param)``,
  as written (``nnx.jit`` donates nothing by default); then the same with
  ``donate_argnums=(0, 1)``, and with ``nnx.cached_partial`` as well;
* ``jax.jit deferred``: the same micro-step on the split state
  (``nnx.split`` once, outside), ``jax.jit`` with the state donated;
* ``nnx jax.grad loop``: ``k`` ``nnx.jit`` calls of ``nnx.value_and_grad``
  and the same ``oa.accumulate`` optimizer (JAX reduces each gradient);
* ``nnx one call``: one ``oa.value_and_grad(num_microbatches=k)`` call and
  plain adamw, ``nnx.jit``;
* ``nnx full batch`` (the reference) and ``jax.jit full batch``: one step
  of ``jax.value_and_grad`` and adamw on the whole batch.

Then where a micro-step's time goes, per call: an ``nnx.jit`` call of a
trivial program on the model and optimizer (nnx's Python per call), the
same through ``jax.jit`` on the split state, the gradient alone, the floor
(the gradient and a donated ``sum + g``), the whole micro-step compiled
alone (donated), and ``tx.update`` alone, non-emitting and emitting; and
per compiled micro-step, the copies and the bytes that alias their donated
inputs. Checked: every update against the full batch's (adamw with
``eps=1e-4``, so that the check is continuous in the gradient).
"""

import json
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import harness
import hlo_report
import optax_accum as oa
import report
from zoo import losses
from zoo import models

KEY = "m"
TITLE = "The deferred loop in an nnx.Optimizer (NNX decoder, data x tensor)"
DEVICES = 8
SHAPE, NAMES = (4, 2), ("data", "tensor")
CONFIGS = {
    # candidates None: every one of CANDIDATES.
    "full": {"k": 4, "reps": 15, "batch": 64, "seq": 32, "parts": True,
             "model": {"vocab": 512, "dim": 128, "heads": 4, "ffn": 512,
                       "layers": 2}, "candidates": None},
    "quick": {"k": 4, "reps": 5, "batch": 32, "seq": 16, "parts": True,
              "model": {"vocab": 256, "dim": 64, "heads": 4, "ffn": 256,
                        "layers": 2}, "candidates": None},
    # The parts compile ten programs more, the other four candidates four:
    # left out of the smoke test (which the summary's four still cover).
    "toy": {"k": 2, "reps": 1, "batch": 16, "seq": 8, "parts": False,
            "model": {"vocab": 32, "dim": 16, "heads": 4, "ffn": 32,
                      "layers": 1},
            "candidates": ["nnx deferred (as written)",
                           "nnx deferred, donate_argnums=(0, 1)",
                           "nnx jax.grad loop", "nnx full batch"]},
}
LR, EPS = 1e-3, 1e-4
NNX_DEFERRED = "nnx deferred (as written)"
NNX_DONATED = "nnx deferred, donate_argnums=(0, 1)"
NNX_CACHED = "nnx deferred, donated + nnx.cached_partial"
JIT_DEFERRED = "jax.jit deferred on split state, donated"
NNX_NAIVE = "nnx jax.grad loop"
NNX_ONE_CALL = "nnx one oa.value_and_grad(k) call"
NNX_FULL = "nnx full batch"
JIT_FULL = "jax.jit full batch on split state, donated"
CANDIDATES = (NNX_DEFERRED, NNX_DONATED, NNX_CACHED, JIT_DEFERRED, NNX_NAIVE,
              NNX_ONE_CALL, NNX_FULL, JIT_FULL)
PARTS = (
    "nnx.jit call of a trivial program (model, accumulate optimizer)",
    "nnx.jit call of a trivial program (model, adamw optimizer)",
    "jax.jit call of a trivial program (the split state)",
    "grad, deferred (one micro-batch)",
    "grad, jax.grad (one micro-batch)",
    "grad, jax.grad (the whole batch)",
    "floor: deferred grad + donated sum + g",
    "micro-step: deferred grad + tx.update + apply, donated",
    "tx.update alone, non-emitting (g, state donated)",
    "tx.update alone, emitting (g, state donated)",
)
# The most a deferred loop (donated) may take of the jax.grad loop's time:
# our accumulation must cost no more than JAX's own reduction per call.
NAIVE_TARGET = 1.1


num_tokens = losses.num_tokens  # the sum of a (micro-)batch's mask.


def _batch(cfg):
  rng = np.random.default_rng(0)
  rows, seq, vocab = cfg["batch"], cfg["seq"], cfg["model"]["vocab"]
  return {"ids": rng.integers(0, vocab, (rows, seq)).astype(np.int32),
          "labels": rng.integers(0, vocab, (rows, seq)).astype(np.int32),
          "mask": (rng.random((rows, seq)) < 0.8).astype(np.float32)}


def _interleaved(candidates, reps):
  """Like ``harness.interleaved``, each candidate ``(prepare, run)``: only
  ``run(prepare())`` is timed (fresh copies of donated arguments)."""
  names = list(candidates)
  for prepare, run in candidates.values():
    jax.block_until_ready(run(prepare()))
  times = harness.Times(names)
  for r in range(reps):
    for i in range(len(names)):
      name = names[(r + i) % len(names)]
      prepare, run = candidates[name]
      args = jax.block_until_ready(prepare())
      cpu, start = time.process_time(), time.perf_counter()
      jax.block_until_ready(run(args))
      times[name].append(time.perf_counter() - start)
      times.cpu[name].append(time.process_time() - cpu)
  return times


def _adamw():
  return optax.adamw(LR, eps=EPS)


def _updates(cfg, micro, whole):
  """Each candidate of ``cfg`` (all by default): a callable running one
  update; its params."""
  k = cfg["k"]
  wanted = set(cfg.get("candidates") or CANDIDATES)
  out = {}

  def fresh(tx):
    model, loss_fn = models.make_nnx_decoder(**cfg["model"])
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param), loss_fn

  def loop(step, model, optimizer, batches):
    def run():
      for b in batches:
        loss = step(model, optimizer, b)
      return jax.block_until_ready((loss, nnx.state(model)))
    return run, model

  model, opt, loss_fn = fresh(oa.accumulate(_adamw(), every_k=k))
  if NNX_DEFERRED in wanted:
    out[NNX_DEFERRED] = loop(nnx.jit(_nnx_step(loss_fn)), model, opt, micro)
  # One function for both (fewer compiles): the model is an argument.
  donated = nnx.jit(_nnx_step(loss_fn), donate_argnums=(0, 1))
  if NNX_DONATED in wanted:
    model, opt, _ = fresh(oa.accumulate(_adamw(), every_k=k))
    out[NNX_DONATED] = loop(donated, model, opt, micro)
  if NNX_CACHED in wanted:
    model, opt, _ = fresh(oa.accumulate(_adamw(), every_k=k))
    cached = nnx.cached_partial(donated, model, opt)
    out[NNX_CACHED] = (
        lambda: jax.block_until_ready([cached(b) for b in micro]), model)

  def naive_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads, num_tokens=num_tokens(batch))
    return loss

  if NNX_NAIVE in wanted:
    model, opt, _ = fresh(oa.accumulate(_adamw(), every_k=k))
    out[NNX_NAIVE] = loop(nnx.jit(naive_step), model, opt, micro)

  one_call_fn = oa.value_and_grad(
      lambda params, batch, graphdef: loss_fn(nnx.merge(graphdef, params),
                                              batch),
      num_microbatches=k, num_tokens_fn=num_tokens)

  def one_call_step(model, optimizer, batch):
    graphdef, params = nnx.split(model, nnx.Param)
    loss, grads = one_call_fn(params, batch, graphdef)
    optimizer.update(model, grads)
    return loss

  def full_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  if NNX_ONE_CALL in wanted:
    model, opt, _ = fresh(_adamw())
    out[NNX_ONE_CALL] = loop(nnx.jit(one_call_step), model, opt, [whole])
  model, opt, _ = fresh(_adamw())
  out[NNX_FULL] = loop(nnx.jit(full_step), model, opt, [whole])
  if JIT_DEFERRED in wanted:
    out[JIT_DEFERRED] = _split_loop(cfg, oa.accumulate(_adamw(), every_k=k),
                                    micro, deferred=True)
  if JIT_FULL in wanted:
    out[JIT_FULL] = _split_loop(cfg, _adamw(), [whole], deferred=False)
  return out


def _split_loop(cfg, tx, batches, deferred):
  """A ``jax.jit`` step on the split state (donated); the model it writes."""
  model, loss_fn = models.make_nnx_decoder(**cfg["model"])
  graphdef, params = nnx.split(model, nnx.Param)
  grad_fn = _grad_fn(loss_fn, graphdef, deferred)
  extra = {"num_tokens": num_tokens} if deferred else {}

  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params,
                               **{k: f(batch) for k, f in extra.items()})
    return optax.apply_updates(params, updates), state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  carry = [params, tx.init(params)]

  def run():
    for b in batches:
      carry[0], carry[1], loss = step(carry[0], carry[1], b)
    nnx.update(model, carry[0])
    return jax.block_until_ready((loss, carry[0]))
  return run, model


def _grad_fn(loss_fn, graphdef, deferred):
  def loss_of(params, batch):
    return loss_fn(nnx.merge(graphdef, params), batch)
  if deferred:
    return oa.value_and_grad(loss_of, num_microbatches=1,
                             num_tokens_fn=num_tokens,
                             gradient_sync="deferred")
  return jax.value_and_grad(loss_of)


def _parts(cfg, micro, whole):
  """Each part of a micro-step, compiled alone: ``(prepare, run)``."""
  k = cfg["k"]
  model, loss_fn = models.make_nnx_decoder(**cfg["model"])
  graphdef, params = nnx.split(model, nnx.Param)
  tx = oa.accumulate(_adamw(), every_k=k)
  grad_fn = _grad_fn(loss_fn, graphdef, deferred=True)
  plain_grad = jax.jit(jax.grad(
      lambda p, b: loss_fn(nnx.merge(graphdef, p), b)))
  deferred_grad = jax.jit(lambda p, b: grad_fn(p, b)[1])

  def step(p, s, b):
    _, g = grad_fn(p, b)
    u, s = tx.update(g, s, p, num_tokens=num_tokens(b))
    return optax.apply_updates(p, u), s

  def floor(p, sums, b):
    return jax.tree.map(lambda s, g: s + g, sums, grad_fn(p, b)[1])
  floor = jax.jit(floor, donate_argnums=1)

  copy = harness.copy_tree
  jit_step = jax.jit(step, donate_argnums=(0, 1))
  state = tx.init(params)
  for b in micro:  # a cycle: the state typed like the gradients from now.
    state = jit_step(copy(params), state, b)[1]
  emitting = copy(state)
  for b in micro[:-1]:  # the next call emits.
    emitting = jit_step(copy(params), emitting, b)[1]
  grads = deferred_grad(params, micro[0])
  update = jax.jit(lambda g, s, p, n: tx.update(g, s, p, num_tokens=n),
                   donate_argnums=(0, 1))
  n = num_tokens(micro[0])

  m_acc, _ = models.make_nnx_decoder(**cfg["model"])
  o_acc = nnx.Optimizer(m_acc, oa.accumulate(_adamw(), every_k=k),
                        wrt=nnx.Param)
  as_written = nnx.jit(_nnx_step(loss_fn))
  as_written(m_acc, o_acc, micro[0])  # the sum typed unreduced from now.
  m_adam, _ = models.make_nnx_decoder(**cfg["model"])
  o_adam = nnx.Optimizer(m_adam, _adamw(), wrt=nnx.Param)
  trivial = nnx.jit(lambda model, optimizer, b: num_tokens(b))
  split_state = nnx.split((m_acc, o_acc))[1]
  jit_trivial = jax.jit(lambda state, b: num_tokens(b))
  b0 = micro[0]

  def nothing():
    return None

  parts = dict(zip(PARTS, [
      (nothing, lambda _: trivial(m_acc, o_acc, b0)),
      (nothing, lambda _: trivial(m_adam, o_adam, b0)),
      (nothing, lambda _: jit_trivial(split_state, b0)),
      (nothing, lambda _: deferred_grad(params, b0)),
      (nothing, lambda _: plain_grad(params, b0)),
      (nothing, lambda _: plain_grad(params, whole)),
      (lambda: copy(state.grad_sum),
       lambda s: floor(params, s, b0)),
      (lambda: (copy(params), copy(state)), lambda a: jit_step(*a, b0)),
      (lambda: (copy(grads), copy(state)), lambda a: update(*a, params, n)),
      (lambda: (copy(grads), copy(emitting)),
       lambda a: update(*a, params, n)),
  ]))
  hlo = {}
  for name, fn in {
      "nnx.jit (as written)": as_written,
      "nnx.jit donate_argnums=(0, 1)": nnx.jit(_nnx_step(loss_fn),
                                              donate_argnums=(0, 1)),
      "jax.jit split state, donated": jit_step}.items():
    if name.startswith("nnx"):
      lowered = fn.lower(m_acc, o_acc, b0)
    else:
      lowered = fn.lower(params, state, b0)
    compiled = lowered.compile()
    stats = hlo_report.hlo_stats(compiled.as_text())
    mem = compiled.memory_analysis()
    hlo[name] = {"copies": stats["copy"], "copy_bytes": stats["copy_bytes"],
                 "alias_bytes": int(mem.alias_size_in_bytes),
                 "argument_bytes": int(mem.argument_size_in_bytes)}
  return parts, hlo


def _nnx_step(loss_fn):
  grad_fn = oa.value_and_grad(
      lambda params, batch, graphdef: loss_fn(nnx.merge(graphdef, params),
                                              batch),
      num_microbatches=1, num_tokens_fn=num_tokens, gradient_sync="deferred")

  def step(model, optimizer, batch):
    graphdef, params = nnx.split(model, nnx.Param)
    loss, grads = grad_fn(params, batch, graphdef)
    optimizer.update(model, grads, num_tokens=num_tokens(batch))
    return loss
  return step


def _params(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _in_process(cfg):
  k, reps = cfg["k"], cfg["reps"]
  mesh = jax.make_mesh(SHAPE, NAMES, axis_types=(AxisType.Explicit,) * 2)
  host = _batch(cfg)
  rows = cfg["batch"] // k
  with jax.set_mesh(mesh):
    whole = jax.device_put(jax.tree.map(jnp.asarray, host), P("data"))
    micro = [jax.device_put(jax.tree.map(
        lambda x, i=i: jnp.asarray(x[i * rows:(i + 1) * rows]), host),
                            P("data")) for i in range(k)]
    updates = _updates(cfg, micro, whole)
    # The first update of each, from the same initial parameters, is its
    # result: the parameters its model holds after it.
    first, times = harness.time_updates(
        {name: run for name, (run, _) in updates.items()}, reps=reps,
        first=lambda name, _: _params(updates[name][1]))
    part_times, hlo = {}, {}
    if cfg.get("parts", True):
      parts, hlo = _parts(cfg, micro, whole)
      part_times = harness.summarize_times(_interleaved(parts, reps=reps))
  reference = first[NNX_FULL]
  return {
      "k": k, "model": cfg["model"], "batch": cfg["batch"],
      "seq": cfg["seq"], "devices": DEVICES,
      "param_bytes": int(sum(x.nbytes for x in reference)),
      "candidates": harness.summarize_times(times),
      "parts": part_times,
      "hlo": hlo,
      "max_abs_diff_vs_full": {
          name: max(float(np.max(np.abs(a - b)))
                    for a, b in zip(p, reference))
          for name, p in first.items()},
      "loadavg": harness.load_average(),
  }


def run(cfg):
  if jax.device_count() >= DEVICES:
    return _in_process(cfg)
  return harness.in_child(__file__, cfg)


def checks(result):
  return [harness.Check(f"m. {name}: max abs param diff vs full batch after"
                        " one update", diff, 1e-5)
          for name, diff in result["max_abs_diff_vs_full"].items()]


def _cpu(result, name):
  return result["candidates"][name]["cpu_median_s"]


def summary_rows(result):
  k = result["k"]
  donated, naive = _cpu(result, NNX_DONATED), _cpu(result, NNX_NAIVE)
  written, full = _cpu(result, NNX_DEFERRED), _cpu(result, NNX_FULL)
  return [
      report.Row(f"m. CPU time per update, nnx deferred loop (donated) /"
                 f" nnx jax.grad loop (k={k})", report.ms(donated),
                 report.ms(naive), f"{donated / naive:.2f}x",
                 f"<= {NAIVE_TARGET}x", donated / naive <= NAIVE_TARGET),
      report.Row(f"m. CPU time per update, nnx deferred loop as written /"
                 f" nnx full-batch step (k={k})", report.ms(written),
                 report.ms(full), f"{written / full:.2f}x", "-", True),
  ]


def markdown(result):
  full = result["candidates"][NNX_FULL]
  lines = [
      f"One adamw update over k={result['k']} micro-batches of"
      f" {result['batch']} x {result['seq']} tokens on a 4 x 2 data x tensor"
      f" mesh of {result['devices']} simulated CPU devices, the NNX decoder"
      f" `{report.spec(result['model'])}` (params"
      f" {report.mib(result['param_bytes'])}). Medians of interleaved"
      " repetitions (p25-p75), wall clock and process CPU time; ratios to"
      " the nnx full-batch step:",
      "",
      "| per update | wall | vs full | CPU | vs full |",
      "|---|---|---|---|---|",
  ]
  for name in [c for c in CANDIDATES if c in result["candidates"]]:
    t = result["candidates"][name]
    lines.append(
        f"| {name} | {report.ms(t['median_s'])} ({report.ms(t['p25_s'])}-"
        f"{report.ms(t['p75_s'])}) | {t['median_s'] / full['median_s']:.2f}x"
        f" | {report.ms(t['cpu_median_s'])} |"
        f" {t['cpu_median_s'] / full['cpu_median_s']:.2f}x |")
  if not result["parts"]:
    return lines
  lines += ["", "Where a micro-step's time goes, per call (each part"
            " compiled alone, interleaved):", "",
            "| part | wall | CPU |", "|---|---|---|"]
  for name in PARTS:
    t = result["parts"][name]
    lines.append(f"| {name} | {report.ms(t['median_s'])} |"
                 f" {report.ms(t['cpu_median_s'])} |")
  lines += ["", "The compiled micro-step (a non-emitting call):", "",
            "| program | copies | copied | aliasing donated inputs |"
            " arguments |", "|---|---|---|---|---|"]
  for name, h in result["hlo"].items():
    lines.append(f"| {name} | {h['copies']} | {report.mib(h['copy_bytes'])}"
                 f" | {report.mib(h['alias_bytes'])} |"
                 f" {report.mib(h['argument_bytes'])} |")
  return lines


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(_in_process(json.loads(sys.argv[1]))))
