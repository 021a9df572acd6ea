"""Benchmarks optax_accum against its peers, each in the same process.

Usage::

  python benchmarks/run.py            # full run (about 10 minutes on 2 cores)
  python benchmarks/run.py --quick    # smaller sizes, about a minute

Sections (``--only a,b,...`` runs a subset):

  a. one accumulation cycle (k micro-steps of a jitted, donated train step)
     of ``oa.accumulate(inner, k)`` vs ``optax.MultiSteps(inner, k)``, with
     adamw and with muon as the inner optimizer;
  b. one non-emitting micro-step of ``oa.accumulate`` vs the floor, a jitted
     donated ``tree_map(add)`` of the gradient into the accumulator;
  c. ``oa.value_and_grad(loss, num_microbatches=k)`` vs one full-batch
     ``jax.value_and_grad`` vs ``optax.microbatching.microbatch``, on an MLP
     and on a small transformer;
  d. compiled temporary memory of the same three vs ``k``;
  e. accumulator memory: state bytes and the compiled train step's sizes.

Timing: every candidate is compiled ahead of time and run once before timing;
repetitions are interleaved (candidate order rotates each repetition, so each
one runs as often first as last), each repetition ends with
``jax.block_until_ready``, and we report medians. Train-step state and
parameters are donated.

Writes ``benchmarks/results/latest.{md,json,png}`` (or ``--out PREFIX``).
"""

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching

import optax_accum as oa
import _models
import hlo_report

MiB = 2**20
NEVER = 2**30  # every_k for a transformation that never emits.


# ---------------------------------------------------------------- timing


class Times(dict):
  """name -> wall-clock seconds per repetition; ``.cpu``: process CPU seconds."""

  def __init__(self, names):
    super().__init__({name: [] for name in names})
    self.cpu = {name: [] for name in names}


def interleaved(candidates, reps, warmup=1):
  """Times zero-argument callables, interleaved; returns a :class:`Times`.

  Each callable runs one repetition and blocks until its results are ready.
  Repetition r runs the candidates in order, starting from the r-th one.
  """
  names = list(candidates)
  for name in names:
    for _ in range(warmup):
      candidates[name]()
  times = Times(names)
  for r in range(reps):
    for i in range(len(names)):
      name = names[(r + i) % len(names)]
      cpu, start = time.process_time(), time.perf_counter()
      candidates[name]()
      times[name].append(time.perf_counter() - start)
      times.cpu[name].append(time.process_time() - cpu)
  return times


def summarize(seconds, cpu_seconds=None):
  q = np.percentile(seconds, [25, 75])
  out = {"median_s": statistics.median(seconds), "p25_s": float(q[0]),
         "p75_s": float(q[1]), "min_s": min(seconds), "reps": len(seconds)}
  if cpu_seconds is not None:
    out["cpu_median_s"] = statistics.median(cpu_seconds)
  return out


def tree_bytes(tree):
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def memory(compiled):
  m = compiled.memory_analysis()
  out = {
      "argument_bytes": int(m.argument_size_in_bytes),
      "output_bytes": int(m.output_size_in_bytes),
      "alias_bytes": int(m.alias_size_in_bytes),
      "temp_bytes": int(m.temp_size_in_bytes),
  }
  out["peak_estimate_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                                - out["alias_bytes"] + out["temp_bytes"])
  return out


def page_faults_per_call(runner, calls):
  """Minor page faults of this process per call (fresh pages touched)."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  runner.steps(calls)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


# ------------------------------------------------- a, b, e: the transformation


def train_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


class Trainer:
  """A donated, ahead-of-time compiled train step and its own copy of state."""

  def __init__(self, tx, params, grads):
    self.params = copy_tree(params)
    self.state = tx.init(self.params)
    self.grads = grads
    self.state_bytes = tree_bytes(self.state)
    self.compiled = jax.jit(train_step(tx), donate_argnums=(0, 1)).lower(
        self.params, self.state, grads).compile()

  def steps(self, n):
    for _ in range(n):
      self.params, self.state = self.compiled(self.params, self.state,
                                              self.grads)
    jax.block_until_ready((self.params, self.state))


class UpdateOnly:
  """A donated ``tx.update`` alone (no apply_updates).

  The state and the gradients are donated, and the updates of one call are the
  gradients of the next: the zero updates of a non-emitting step are written
  into the gradients' buffer instead of freshly allocated memory (a fresh
  40 MiB output per call costs more in page faults than the step itself, and a
  real train step consumes its updates in place). JAX pairs donated inputs
  with same-shaped outputs in order, so the outputs are ordered like the
  donated inputs: updates (for the gradients), then the state.
  """

  def __init__(self, tx, params, grads):
    self.params = params
    self.grads = copy_tree(grads)
    self.state = tx.init(params)

    def update(grads, state, params):
      return tx.update(grads, state, params)

    self.compiled = jax.jit(update, donate_argnums=(0, 1)).lower(
        self.grads, self.state, params).compile()

  def steps(self, n):
    for _ in range(n):
      self.grads, self.state = self.compiled(self.grads, self.state,
                                             self.params)
    jax.block_until_ready((self.state, self.grads))


class Floor:
  """``acc = acc + g`` per leaf, jitted and donated: one read-2N write-N pass."""

  def __init__(self, params, grads):
    self.acc = jax.tree.map(jnp.zeros_like, params)
    self.grads = grads
    self.compiled = jax.jit(
        lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0).lower(
            self.acc, grads).compile()

  def steps(self, n):
    for _ in range(n):
      self.acc = self.compiled(self.acc, self.grads)
    jax.block_until_ready(self.acc)


def param_tree(leaves, size):
  keys = jax.random.split(jax.random.key(0), 2 * leaves)
  params = {f"w{i}": jax.random.normal(keys[i], (size, size)) * 0.02
            for i in range(leaves)}
  grads = {f"w{i}": jax.random.normal(keys[leaves + i], (size, size)) * 1e-3
           for i in range(leaves)}
  return params, grads


def ours_variants(args, inner, k):
  """The transformations we time (one; a hook for comparing variants)."""
  del args
  return {"oa.accumulate": oa.accumulate(inner, k)}


def section_cycle(args, cfg):
  """a (and e): one cycle of k micro-steps, ours vs optax.MultiSteps."""
  results = {}
  for inner_name in ("adamw", "muon"):
    c = cfg["cycle"][inner_name]
    inner = (optax.adamw(1e-3, weight_decay=1e-4) if inner_name == "adamw"
             else optax.contrib.muon(1e-3))
    params, grads = param_tree(c["leaves"], c["size"])
    k = cfg["k"]
    txs = ours_variants(args, inner, k)
    txs["optax.MultiSteps"] = optax.MultiSteps(inner, k)
    trainers = {name: Trainer(tx, params, grads) for name, tx in txs.items()}
    # Warm-up: one micro-step each. Any k consecutive micro-steps hold exactly
    # one emitting step, so the timed cycles need not start a cycle.
    for t in trainers.values():
      t.steps(1)
    times = interleaved({n: (lambda t=t: t.steps(k)) for n, t in
                         trainers.items()}, reps=c["reps"], warmup=0)
    # Same gradients, same number of cycles: the parameters must agree.
    ref = trainers["optax.MultiSteps"].params
    entry = {"leaves": c["leaves"], "shape": [c["size"], c["size"]], "k": k,
             "param_bytes": tree_bytes(params), "candidates": {}}
    for name, t in trainers.items():
      diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
          jax.tree.leaves(t.params), jax.tree.leaves(ref)))
      inner_bytes = tree_bytes(inner.init(params))
      entry["candidates"][name] = {
          "cycle": summarize(times[name], times.cpu[name]),
          "max_abs_param_diff_vs_multisteps": diff,
          "state_bytes": t.state_bytes,
          "inner_state_bytes": inner_bytes,
          "accumulator_overhead_bytes": t.state_bytes - inner_bytes,
          "compiled": memory(t.compiled),
          "hlo": {key: val for key, val in hlo_report.hlo_stats(
              t.compiled.as_text()).items() if key != "per_computation"},
      }
    results[inner_name] = entry
    del trainers
  return results


def section_microstep(args, cfg):
  """b: a non-emitting micro-step vs the floor tree_map(add)."""
  c = cfg["micro"]
  params, grads = param_tree(c["leaves"], c["size"])
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  runners = {"floor tree_map(add)": Floor(params, grads)}
  for name, tx in ours_variants(args, inner, NEVER).items():
    runners[f"{name} update only"] = UpdateOnly(tx, params, grads)
    runners[f"{name} train step"] = Trainer(tx, params, grads)
  runners["optax.MultiSteps train step"] = Trainer(
      optax.MultiSteps(inner, NEVER), params, grads)
  n = c["calls_per_rep"]
  times = interleaved({name: (lambda r=r: r.steps(n)) for name, r in
                       runners.items()}, reps=c["reps"])
  out = {"leaves": c["leaves"], "shape": [c["size"], c["size"]],
         "param_bytes": tree_bytes(params), "calls_per_rep": n,
         "candidates": {}}
  for name, r in runners.items():
    s = summarize([t / n for t in times[name]],
                  [t / n for t in times.cpu[name]])
    s["hlo"] = {key: val for key, val in hlo_report.hlo_stats(
        r.compiled.as_text()).items() if key != "per_computation"}
    s["compiled"] = memory(r.compiled)
    s["page_faults_per_call"] = page_faults_per_call(r, 2 * n)
    out["candidates"][name] = s
  return out


# ---------------------------------------------------- c, d: value_and_grad


def vg_candidates(loss_fn, batch_size, k):
  """Jitted (not yet compiled) value-and-grad functions for one k."""
  return {
      "oa.value_and_grad": jax.jit(oa.value_and_grad(
          loss_fn, num_microbatches=k)),
      "optax.microbatching": jax.jit(microbatching.microbatch(
          jax.value_and_grad(loss_fn), argnums=1,
          microbatch_size=batch_size // k,
          accumulator=microbatching.AccumulationType.MEAN)),
  }


def build_model(spec):
  kind = spec["kind"]
  kwargs = {key: val for key, val in spec.items() if key != "kind"}
  if kind == "mlp":
    return _models.make_mlp(**kwargs)
  return _models.make_transformer(**kwargs)


def batch_size_of(batch):
  return jax.tree.leaves(batch)[0].shape[0]


def max_grad_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b)))


def section_value_and_grad(args, cfg):
  """c: time of one call at k, ours vs full batch vs optax.microbatching."""
  del args
  results = {}
  k = cfg["k"]
  for model_name, spec in cfg["vg_models"].items():
    params, batch, loss_fn = build_model(spec)
    bs = batch_size_of(batch)
    fns = {"full batch jax.value_and_grad": jax.jit(
        jax.value_and_grad(loss_fn))}
    fns.update(vg_candidates(loss_fn, bs, k))
    compiled = {n: f.lower(params, batch).compile() for n, f in fns.items()}
    ref_loss, ref_grads = compiled["full batch jax.value_and_grad"](
        params, batch)
    entry = {"spec": spec, "k": k, "param_bytes": tree_bytes(params),
             "candidates": {}}
    times = interleaved(
        {n: (lambda c=c: jax.block_until_ready(c(params, batch)))
         for n, c in compiled.items()}, reps=cfg["vg_reps"])
    for name, c in compiled.items():
      loss, grads = c(params, batch)
      entry["candidates"][name] = {
          "call": summarize(times[name], times.cpu[name]),
          "loss_abs_diff_vs_full": float(abs(loss - ref_loss)),
          "max_abs_grad_diff_vs_full": max_grad_diff(grads, ref_grads),
          "max_abs_grad": max(float(jnp.max(jnp.abs(g)))
                              for g in jax.tree.leaves(ref_grads)),
          "temp_bytes": memory(c)["temp_bytes"],
      }
    results[model_name] = entry
  return results


def section_sweep(args, cfg):
  """d: time (an MLP) and temp memory (activation-heavy models) vs k."""
  del args
  out = {"ks": cfg["ks"], "time": {}, "temp": {}}
  # Time vs k on the compute-bound MLP.
  params, batch, loss_fn = build_model(cfg["sweep_model"])
  bs = batch_size_of(batch)
  cands = {"full batch": jax.jit(jax.value_and_grad(loss_fn)).lower(
      params, batch).compile()}
  for k in cfg["sweep_time_ks"]:
    for name, f in vg_candidates(loss_fn, bs, k).items():
      cands[f"{name} k={k}"] = f.lower(params, batch).compile()
  times = interleaved(
      {n: (lambda c=c: jax.block_until_ready(c(params, batch)))
       for n, c in cands.items()}, reps=cfg["sweep_reps"])
  out["time"] = {"model": "mlp", "spec": cfg["sweep_model"],
                 "ks": cfg["sweep_time_ks"],
                 "candidates": {n: summarize(t, times.cpu[n])
                                for n, t in times.items()}}
  # Temp memory vs k: compile only.
  for model_name, spec in cfg["mem_models"].items():
    params, batch, loss_fn = build_model(spec)
    bs = batch_size_of(batch)
    full = jax.jit(jax.value_and_grad(loss_fn)).lower(params, batch).compile()
    entry = {"spec": spec, "param_bytes": tree_bytes(params),
             "batch_bytes": tree_bytes(batch),
             "full batch": memory(full)["temp_bytes"],
             "oa.value_and_grad": {}, "optax.microbatching": {}}
    for k in cfg["ks"]:
      for name, f in vg_candidates(loss_fn, bs, k).items():
        entry[name][k] = memory(f.lower(params, batch).compile())["temp_bytes"]
    out["temp"][model_name] = entry
  return out


# ---------------------------------------------------------------- configs


def config(quick):
  if quick:
    return {
        "k": 8,
        "cycle": {"adamw": {"leaves": 10, "size": 512, "reps": 7},
                  "muon": {"leaves": 10, "size": 256, "reps": 3}},
        "micro": {"leaves": 10, "size": 512, "reps": 15, "calls_per_rep": 4},
        "vg_models": {
            "mlp": {"kind": "mlp", "batch_size": 2048, "d_in": 512,
                    "width": 1024, "depth": 4, "d_out": 512},
            "transformer": {"kind": "transformer", "batch_size": 16,
                            "seq_len": 64, "d_model": 128, "num_heads": 4,
                            "num_layers": 2, "vocab_size": 512},
        },
        "vg_reps": 7,
        "sweep_model": {"kind": "mlp", "batch_size": 256, "d_in": 256,
                        "width": 512, "depth": 4, "d_out": 256},
        "ks": [1, 2, 4, 8, 16, 32],
        "sweep_time_ks": [1, 4, 8, 32],
        "sweep_reps": 3,
        "mem_models": {
            "mlp": {"kind": "mlp", "batch_size": 2048, "d_in": 256,
                    "width": 1024, "depth": 8, "d_out": 256},
            "transformer": {"kind": "transformer", "batch_size": 32,
                            "seq_len": 128, "d_model": 128, "num_heads": 4,
                            "num_layers": 2, "vocab_size": 512},
        },
    }
  return {
      "k": 8,
      "cycle": {"adamw": {"leaves": 10, "size": 1024, "reps": 15},
                "muon": {"leaves": 10, "size": 1024, "reps": 3}},
      "micro": {"leaves": 10, "size": 1024, "reps": 40, "calls_per_rep": 4},
      # Micro-batches of 512 rows: big enough to keep the CPU's matmuls
      # compute-bound (the sweep of d shows the cost of smaller ones).
      "vg_models": {
          "mlp": {"kind": "mlp", "batch_size": 4096, "d_in": 1024,
                  "width": 2048, "depth": 4, "d_out": 1024},
          "transformer": {"kind": "transformer", "batch_size": 32,
                          "seq_len": 128, "d_model": 256, "num_heads": 4,
                          "num_layers": 2, "vocab_size": 2048},
      },
      "vg_reps": 7,
      "sweep_model": {"kind": "mlp", "batch_size": 1024, "d_in": 1024,
                      "width": 2048, "depth": 4, "d_out": 1024},
      "ks": [1, 2, 4, 8, 16, 32],
      "sweep_time_ks": [1, 2, 4, 8, 16, 32],
      "sweep_reps": 5,
      "mem_models": {
          "mlp": {"kind": "mlp", "batch_size": 8192, "d_in": 512,
                  "width": 1024, "depth": 8, "d_out": 512},
          "transformer": {"kind": "transformer", "batch_size": 64,
                          "seq_len": 256, "d_model": 256, "num_heads": 4,
                          "num_layers": 4, "vocab_size": 2048},
      },
  }


def machine_info():
  cpu = "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  mem = None
  try:
    with open("/proc/meminfo") as f:
      mem = int(f.readline().split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  import flax  # pylint: disable=import-outside-toplevel
  return {
      "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
      "platform": platform.platform(), "python": platform.python_version(),
      "jax": jax.__version__, "jaxlib": jax.lib.__version__,
      "optax": optax.__version__, "flax": flax.__version__,
      "optax_accum": getattr(oa, "__version__", "?"),
      "backend": jax.default_backend(),
      "loadavg_start": list(os.getloadavg()),
      "devices": [str(d) for d in jax.devices()],
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
  }


# ---------------------------------------------------------------- report


def _ms(s):
  return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def _mib(b):
  return f"{b / MiB:.1f} MiB"


def _load(avg):
  return "/".join(f"{x:.1f}" for x in avg) if avg else "?"


def _check(ok):
  return "yes" if ok else "**no**"


def summary_rows(res):
  """Rows of the headline table: (what, ours, peer, ratio, target, holds)."""
  rows = []
  k = res["config"]["k"]
  for inner_name, target, aim in (("adamw", 1.4, 2.0), ("muon", 5.0, None)):
    e = res.get("a", {}).get(inner_name)
    if not e:
      continue
    ours = e["candidates"]["oa.accumulate"]["cycle"]["median_s"]
    peer = e["candidates"]["optax.MultiSteps"]["cycle"]["median_s"]
    r = peer / ours
    shape = "x".join(map(str, e["shape"]))
    goal = f">= {target}x" + (f" (aim {aim}x)" if aim else "")
    rows.append((f"a. cycle of k={k}, {inner_name}, {e['leaves']} x {shape} "
                 "f32: speedup vs optax.MultiSteps", _ms(ours), _ms(peer),
                 f"{r:.2f}x", goal, _check(r >= target)))
  b = res.get("b")
  if b:
    c = b["candidates"]
    floor = c["floor tree_map(add)"]["median_s"]
    for kind in ("update only", "train step"):
      ours = c[f"oa.accumulate {kind}"]["median_s"]
      r = ours / floor
      label = ("tx.update alone" if kind == "update only" else
               "tx.update + apply_updates")
      rows.append((f"b. non-emitting micro-step ({label}) / floor "
                   "jit(tree_map(add), donated)", _ms(ours), _ms(floor),
                   f"{r:.2f}x", "<= 1.5x", _check(r <= 1.5)))
  for model_name, e in res.get("c", {}).items():
    c = e["candidates"]
    ours = c["oa.value_and_grad"]["call"]["median_s"]
    full = c["full batch jax.value_and_grad"]["call"]["median_s"]
    mb = c["optax.microbatching"]["call"]["median_s"]
    rows.append((f"c. {model_name}: oa.value_and_grad(k={e['k']}) / full-batch "
                 "jax.value_and_grad", _ms(ours), _ms(full),
                 f"{ours / full:.3f}x", "<= 1.10x",
                 _check(ours / full <= 1.10)))
    rows.append((f"c. {model_name}: oa.value_and_grad(k={e['k']}) / "
                 "optax.microbatching", _ms(ours), _ms(mb),
                 f"{ours / mb:.3f}x", "<= 1.05x", _check(ours / mb <= 1.05)))
  d = res.get("d")
  if d:
    for model_name, e in d["temp"].items():
      ours, full = e["oa.value_and_grad"][k], e["full batch"]
      rows.append((f"d. {model_name}: temp memory, oa.value_and_grad(k={k}) / "
                   "full batch", _mib(ours), _mib(full),
                   f"{ours / full:.3f}x", "<= 0.3x", _check(ours / full <= 0.3)))
  a = res.get("a", {}).get("adamw")
  if a:
    ours = a["candidates"]["oa.accumulate"]
    peer = a["candidates"]["optax.MultiSteps"]
    pb = a["param_bytes"]
    rows.append(("e. adamw state beyond the inner state (accumulator)",
                 f"{_mib(ours['accumulator_overhead_bytes'])} "
                 f"({ours['accumulator_overhead_bytes'] / pb:.3f} x params)",
                 f"{_mib(peer['accumulator_overhead_bytes'])} "
                 f"({peer['accumulator_overhead_bytes'] / pb:.3f} x params)",
                 "-", "one param-sized f32 buffer",
                 _check(abs(ours["accumulator_overhead_bytes"] - pb) < 1024)))
    rows.append(("e. adamw train step: compiled temp memory",
                 _mib(ours["compiled"]["temp_bytes"]),
                 _mib(peer["compiled"]["temp_bytes"]),
                 f"{ours['compiled']['temp_bytes'] / max(1, peer['compiled']['temp_bytes']):.2f}x",
                 "less than MultiSteps",
                 _check(ours["compiled"]["temp_bytes"]
                        < peer["compiled"]["temp_bytes"])))
  return rows


def markdown(res):
  m = res["machine"]
  lines = [
      f"# optax_accum benchmarks ({'quick' if res['quick'] else 'full'} run)",
      "",
      f"{m['date']} | {m['cpu']}, {m['cores']} cores, "
      f"{(m['memory_bytes'] or 0) / 2**30:.0f} GiB | backend {m['backend']} | "
      f"jax {m['jax']}, optax {m['optax']}, flax {m['flax']}, "
      f"optax_accum {m['optax_accum']} | python {m['python']}",
      "",
      "Medians of interleaved repetitions (wall clock); ratios are of medians."
      f" Load average (1/5/15 min) at start {_load(m['loadavg_start'])},"
      f" at end {_load(m.get('loadavg_end'))} (this benchmark alone keeps it"
      f" near {m['cores']}; more means other processes shared the cores).",
      "",
      "| benchmark | ours | peer | ratio | target | holds |",
      "|---|---|---|---|---|---|",
  ]
  for row in summary_rows(res):
    lines.append("| " + " | ".join(row) + " |")
  lines.append("")

  if "a" in res:
    lines += ["## a. One accumulation cycle (k micro-steps, donated train step)",
              "", "| inner | candidate | cycle median | p25-p75 | CPU median | "
              "reps | max abs param diff vs MultiSteps |",
              "|---|---|---|---|---|---|---|"]
    for inner_name, e in res["a"].items():
      for name, c in e["candidates"].items():
        t = c["cycle"]
        lines.append(f"| {inner_name} | {name} | {_ms(t['median_s'])} | "
                     f"{_ms(t['p25_s'])} - {_ms(t['p75_s'])} | "
                     f"{_ms(t['cpu_median_s'])} | {t['reps']} | "
                     f"{c['max_abs_param_diff_vs_multisteps']:.2e} |")
    lines.append("")
  if "b" in res:
    b = res["b"]
    lines += [f"## b. Non-emitting micro-step ({b['leaves']} x "
              f"{'x'.join(map(str, b['shape']))} f32, adamw inner, "
              "never emits)", "",
              "`update only`: jitted `tx.update` with the state and the "
              "gradients donated (the zero updates reuse the gradients' "
              "buffer; reads 2N, writes 2N bytes at best); `train step`: "
              "`tx.update` + `optax.apply_updates`, params and state donated "
              "(adds a read-N write-N pass over the params, and XLA "
              "materialises the zero updates as a temporary); floor: jitted "
              "`tree_map(add)` with the accumulator donated (reads 2N, writes "
              "N bytes).", "",
              "| candidate | wall per call | / floor | CPU per call | / floor |"
              " page faults per call | temp | HLO copies (MiB) | fusions |"
              " conditionals |", "|---|---|---|---|---|---|---|---|---|---|"]
    fl = b["candidates"]["floor tree_map(add)"]
    for name, c in b["candidates"].items():
      h = c["hlo"]
      lines.append(
          f"| {name} | {_ms(c['median_s'])} | "
          f"{c['median_s'] / fl['median_s']:.2f}x | "
          f"{_ms(c['cpu_median_s'])} | "
          f"{c['cpu_median_s'] / fl['cpu_median_s']:.2f}x | "
          f"{c['page_faults_per_call']:.0f} | "
          f"{_mib(c['compiled']['temp_bytes'])} | {h['copy']} "
          f"({h['copy_bytes'] / MiB:.0f}) | {h['fusion']} | "
          f"{h['conditional']} |")
    lines.append("")
  if "c" in res:
    lines += ["## c. Value and gradient of one batch",
              "", "| model | candidate | call median | / full batch | "
              "max abs grad diff vs full (max abs grad) | temp memory |",
              "|---|---|---|---|---|---|"]
    for model_name, e in res["c"].items():
      full = e["candidates"]["full batch jax.value_and_grad"]["call"][
          "median_s"]
      for name, c in e["candidates"].items():
        lines.append(
            f"| {model_name} | {name} | {_ms(c['call']['median_s'])} | "
            f"{c['call']['median_s'] / full:.3f}x | "
            f"{c['max_abs_grad_diff_vs_full']:.1e} ({c['max_abs_grad']:.1e})"
            f" | {_mib(c['temp_bytes'])} |")
    lines.append("")
    for model_name, e in res["c"].items():
      lines.append(f"- {model_name}: `{json.dumps(e['spec'])}`, "
                   f"params {_mib(e['param_bytes'])}")
    lines.append("")
  if "d" in res:
    d = res["d"]
    t = d["time"]
    lines += ["## d. Time and temporary memory vs k", "",
              f"Time per call on the `{t['model']}` "
              f"`{json.dumps(t['spec'])}` (full batch: "
              f"{_ms(t['candidates']['full batch']['median_s'])}); the "
              "micro-batch has batch_size / k rows:", "",
              "| k | " + " | ".join(str(k) for k in t["ks"]) + " |",
              "|---|" + "---|" * len(t["ks"])]
    for name in ("oa.value_and_grad", "optax.microbatching"):
      lines.append(f"| {name} | " + " | ".join(
          _ms(t["candidates"][f"{name} k={k}"]["median_s"]) for k in t["ks"])
                   + " |")
    lines.append("")
    for model_name, e in d["temp"].items():
      lines += [f"Compiled temp memory, `{model_name}` "
                f"(`{json.dumps(e['spec'])}`, params "
                f"{_mib(e['param_bytes'])}, batch {_mib(e['batch_bytes'])}); "
                f"full batch: {_mib(e['full batch'])}:", "",
                "| k | " + " | ".join(str(k) for k in d["ks"]) + " |",
                "|---|" + "---|" * len(d["ks"])]
      for name in ("oa.value_and_grad", "optax.microbatching"):
        lines.append(f"| {name} | " + " | ".join(
            f"{_mib(e[name][k])} ({e[name][k] / e['full batch']:.2f}x)"
            for k in d["ks"]) + " |")
      lines.append("")
  if "a" in res:
    lines += ["## e. Accumulator memory (train step, k micro-steps)", "",
              "| inner | candidate | state | inner state | beyond inner | "
              "compiled args | out | alias | temp | HLO copies (MiB) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for inner_name, e in res["a"].items():
      for name, c in e["candidates"].items():
        cm = c["compiled"]
        lines.append(
            f"| {inner_name} | {name} | {_mib(c['state_bytes'])} | "
            f"{_mib(c['inner_state_bytes'])} | "
            f"{_mib(c['accumulator_overhead_bytes'])} | "
            f"{_mib(cm['argument_bytes'])} | {_mib(cm['output_bytes'])} | "
            f"{_mib(cm['alias_bytes'])} | {_mib(cm['temp_bytes'])} | "
            f"{c['hlo']['copy']} ({c['hlo']['copy_bytes'] / MiB:.0f}) |")
    lines.append("")
  return "\n".join(lines)


def plot(res, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  d = res["d"]
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
  t = d["time"]
  ks = t["ks"]
  styles = {"oa.value_and_grad": ("C0", "o"), "optax.microbatching":
            ("C1", "s")}
  for name, (color, marker) in styles.items():
    ax_t.plot(ks, [t["candidates"][f"{name} k={k}"]["median_s"] * 1e3
                   for k in ks], marker=marker, color=color, label=name)
  ax_t.axhline(t["candidates"]["full batch"]["median_s"] * 1e3, color="k",
               ls="--", label="full batch jax.value_and_grad")
  ax_t.set(xscale="log", xlabel="num_microbatches k",
           ylabel="time per call (ms, median)",
           title=f"Time vs k ({t['model']}, {t['spec']['batch_size']} rows)")
  ax_t.set_xticks(ks, [str(k) for k in ks])
  ax_t.set_ylim(bottom=0)
  ax_t.legend()
  ax_t.grid(alpha=0.3)
  for (model_name, e), ls in zip(d["temp"].items(), ("-", ":")):
    for name, (color, marker) in styles.items():
      ax_m.plot(d["ks"], [e[name][k] / e["full batch"] for k in d["ks"]],
                marker=marker, color=color, ls=ls,
                label=f"{name} ({model_name})")
  full = ", ".join(f"{n} {_mib(e['full batch'])}" for n, e in d["temp"].items())
  ax_m.axhline(1.0, color="k", ls="--", label=f"full batch ({full})")
  ax_m.plot([8], [0.3], marker="v", ms=9, color="r", ls="none",
            label="target at k=8: <= 0.3x")
  ax_m.set(xscale="log", xlabel="num_microbatches k",
           ylabel="compiled temp memory / full batch",
           title="Temporary memory vs k")
  ax_m.set_xticks(d["ks"], [str(k) for k in d["ks"]])
  ax_m.set_ylim(bottom=0)
  ax_m.legend(fontsize=8)
  ax_m.grid(alpha=0.3)
  fig.suptitle(f"optax_accum, {res['machine']['cpu']}, "
               f"{res['machine']['cores']} cores, jax {res['machine']['jax']}",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


SECTIONS = {"a": section_cycle, "b": section_microstep,
            "c": section_value_and_grad, "d": section_sweep}


def main(argv=None):
  parser = argparse.ArgumentParser(
      description="Benchmarks optax_accum against its peers.")
  parser.add_argument("--quick", action="store_true",
                      help="small sizes and few repetitions (about a minute)")
  parser.add_argument("--only", default="a,b,c,d",
                      help="comma-separated sections to run (a,b,c,d; e comes "
                      "with a)")
  parser.add_argument("--out", default=os.path.join(_HERE, "results",
                                                    "latest"),
                      help="output path prefix for .md, .json and .png")
  args = parser.parse_args(argv)
  cfg = config(args.quick)
  res = {"quick": args.quick, "config": cfg, "machine": machine_info()}
  start = time.perf_counter()
  for name in args.only.split(","):
    t0 = time.perf_counter()
    res[name] = SECTIONS[name](args, cfg)
    print(f"[section {name}: {time.perf_counter() - t0:.0f} s]",
          file=sys.stderr, flush=True)
  res["wall_s"] = time.perf_counter() - start
  res["machine"]["loadavg_end"] = list(os.getloadavg())
  text = markdown(res)
  print(text)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out + ".md", "w") as f:
    f.write(text + "\n")
  with open(args.out + ".json", "w") as f:
    json.dump(res, f, indent=1, default=str)
  if "d" in res:
    plot(res, args.out + ".png")
  print(f"wrote {args.out}.{{md,json}}" + (" and .png" if "d" in res else "")
        + f" in {res['wall_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
  main()
