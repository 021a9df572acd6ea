"""i. Planning ``k`` for an 8B-parameter Llama-shaped model, never allocated.

``oa.plan_microbatches`` on abstract inputs (``jax.ShapeDtypeStruct`` with
``NamedSharding``\\ s): a Llama-shaped decoder of about 8B parameters (32
layers, d_model 4096, FFN 14336, 32 heads, 8 KV heads, vocabulary 128256),
bfloat16, FSDP over the ``data`` axis of 8 simulated CPU devices, and a batch
of 4096-token sequences. The planner compiles candidate steps ahead of time
and reads their memory per device and collectives per update from XLA; nothing
runs and no parameter is allocated. It runs in a child process, which asks
jax for the 8 devices without touching the other benchmarks' device count.
Checked: the devices hold (almost) nothing after planning, and each plan fits
its budget. The time is what planning took, against the goal of 2 minutes.
"""

import json
import math
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import harness
import optax_accum as oa
from optax_accum._src.compiled import memory_analysis
import report
from zoo import models

KEY = "i"
TITLE = "Planning k for an 8B-parameter model from abstract shapes"
DEVICES = 8
GOAL_S = 120.0  # Planning an 8B model should take under two minutes.
GiB = 2**30
LLAMA_8B = {"layers": 32, "d_model": 4096, "ffn": 14336, "heads": 32,
            "kv_heads": 8, "vocab": 128256}
CONFIGS = {
    # Budgets in GiB per device: an 80 GB H100, then half of it.
    "full": {"model": LLAMA_8B, "seq_len": 4096, "rows_per_device": 8,
             "budgets_gib": [80.0, 40.0]},
    "quick": {"model": LLAMA_8B, "seq_len": 4096, "rows_per_device": 4,
              "budgets_gib": [80.0]},
    "toy": {"model": {"layers": 2, "d_model": 64, "ffn": 128, "heads": 4,
                      "kv_heads": 2, "vocab": 256},
            "seq_len": 16, "rows_per_device": 2, "budgets_gib": [1.0]},
}


def _abstract_inputs(cfg, mesh):
  """Parameters and batch as ShapeDtypeStructs sharded over ``mesh``.

  Every matrix is sharded over ``data`` along its last-but-one axis (FSDP);
  the norms' scales are replicated.
  """
  def fsdp(path, shape):
    if "norm" in jax.tree_util.keystr(path):
      return P()
    return P(*([None] * (len(shape) - 2)), "data", None)

  shapes = models.llama_shapes(**cfg["model"])
  params = jax.tree_util.tree_map_with_path(
      lambda path, shape: jax.ShapeDtypeStruct(
          shape, jnp.bfloat16, sharding=NamedSharding(mesh, fsdp(path, shape))),
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  rows = DEVICES * cfg["rows_per_device"]
  tokens = jax.ShapeDtypeStruct((rows, cfg["seq_len"]), jnp.int32,
                                sharding=NamedSharding(mesh, P("data")))
  batch = {"inputs": tokens, "targets": tokens,
           "mask": jax.ShapeDtypeStruct(tokens.shape, jnp.float32,
                                        sharding=tokens.sharding)}
  return params, batch


def plan(cfg):
  """Plans at each budget (in this process, with 8 devices); plain numbers."""
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = _abstract_inputs(cfg, mesh)
  loss_fn = models.make_llama_loss(cfg["model"]["heads"],
                                    cfg["model"]["kv_heads"])
  plans = []
  for budget_gib in cfg["budgets_gib"]:
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
      chosen = oa.plan_microbatches(
          loss_fn, params, batch, memory_budget=int(budget_gib * GiB),
          num_tokens_fn=lambda mb: mb["mask"].sum(), axis_name="data")
      table, choice = chosen.table, {
          "k": chosen.num_microbatches, "gradient_sync": chosen.gradient_sync,
          "gather_params": chosen.gather_params,
          "memory_bytes": chosen.memory_bytes,
          "memory_measure": chosen.memory_measure,
          "collectives_per_update": chosen.collectives_per_update}
    except ValueError as e:  # nothing fits: the message prints the table.
      message = str(e).splitlines()
      table, choice = (), {"error": message[0], "table_text": message[1:]}
    plans.append({
        "budget_gib": budget_gib, "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "chosen": choice,
        "table": [{
            "k": c.num_microbatches, "gradient_sync": c.gradient_sync,
            "gather_params": c.gather_params, "memory_bytes": c.memory_bytes,
            "memory_measure": c.memory_measure,
            "collectives_per_update": c.collectives_per_update,
            "in_loop": sum(c.collectives.in_loop.values()), "fits": c.fits,
        } for c in table],
    })
  return {
      "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
      "param_bytes": sum(math.prod(x.shape) * x.dtype.itemsize
                         for x in jax.tree.leaves(params)),
      "live_bytes_after": sum(x.nbytes for x in jax.live_arrays()),
      "plans": plans,
  }


def run(cfg):
  """Runs :func:`plan` in a child process with 8 simulated devices."""
  return harness.in_child(__file__, cfg)


def checks(result):
  out = [harness.Check(
      "devices' live bytes after planning / the model's bytes",
      result["live_bytes_after"] / result["param_bytes"], 1e-3)]
  for p in result["plans"]:
    if "memory_bytes" in p["chosen"]:
      out.append(harness.Check(
          f"plan at {p['budget_gib']:g} GiB: chosen memory / budget",
          p["chosen"]["memory_bytes"] / (p["budget_gib"] * GiB), 1.0))
  return out


def summary_rows(result):
  rows = []
  for p in result["plans"]:
    c = p["chosen"]
    what = (f"i. plan {result['num_params'] / 1e9:.1f}B params at"
            f" {p['budget_gib']:g} GiB/device: k={c.get('k', '-')}")
    rows.append(report.Row(
        what, f"{p['seconds']:.0f} s", f"goal {GOAL_S:.0f} s",
        f"{p['seconds'] / GOAL_S:.2f}x", "<= 1.00x",
        p["seconds"] <= GOAL_S))
  return rows


def _flag(measure):
  """What the planner read: its peak, or temp + args (XLA:CPU), flagged."""
  if measure in (None, memory_analysis.PEAK):
    return ""
  return f" ({measure})"


def markdown(result):
  lines = [f"{result['num_params']:,} parameters"
           f" ({report.mib(result['param_bytes'])} in bfloat16), FSDP over 8"
           " devices; nothing allocated (devices' live bytes after planning:"
           f" {result['live_bytes_after']}).", ""]
  for p in result["plans"]:
    c = p["chosen"]
    choice = c.get("error") or (
        f"k={c['k']}, gradient_sync={c['gradient_sync']},"
        f" gather_params={c['gather_params']}")
    lines += [f"Budget {p['budget_gib']:g} GiB per device: {choice};"
              f" planning took {p['seconds']:.1f} s ({p['cpu_seconds']:.1f} s"
              " of CPU).", ""]
    if "table_text" in c:
      lines += ["```text", *c["table_text"], "```", ""]
      continue
    lines += ["| k | gradient_sync | gather_params | memory/device |"
              " collectives/update (in loop) | fits |",
              "|---|---|---|---|---|---|"]
    for r in p["table"]:
      lines.append(
          f"| {r['k']} | {r['gradient_sync']} | {r['gather_params']} |"
          f" {r['memory_bytes'] / GiB:.2f} GiB"
          f"{_flag(r.get('memory_measure'))} | {r['collectives_per_update']}"
          f" ({r['in_loop']}) | {'yes' if r['fits'] else 'no'} |")
    lines.append("")
  return lines + [
      "Memory per device as `oa.plan_microbatches` reads it: the peak"
      " (`memory_analysis().peak_memory_in_bytes`), or, marked (temp+args),"
      " temp + arguments + outputs - aliased where the backend's peak counts"
      " no temporaries (XLA:CPU, this benchmark's backend).", ""]


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(plan(json.loads(sys.argv[1]))))
