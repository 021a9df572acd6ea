"""o. The emitting micro-step, compiled: where the updates live.

One donated micro-step (``jax.jit(step, donate_argnums=(0, 1, 2))``, the
gradients passed in) of each candidate, compiled for one TPU v5e chip (with
libtpu), one H100 (with the CUDA plugin, in a child process that starts jax
on the CPU platform) and the CPU, nothing run; its ``peak_memory_in_bytes``
against the floor, a step that only adds the gradients to a donated sum:

* ``tx.update`` + ``oa.apply_if_updated``: the updates kept in the running
  sum's buffer and read from there (on GPUs the emit choice is a loop of at
  most one trip);
* ``oa.update_and_apply``: applied inside its emitting branch (on GPU and
  CPU a loop of at most one trip, in which XLA updates the parameters in
  place);
* ``optax.MultiSteps`` + ``optax.apply_updates``: the inner on every call,
  selected;
* the hand-written ``lax.cond`` that adds, runs the inner and applies in its
  emitting branch (the loop a user would write);
* the floor ``sum += g``.

Checked: on TPU and H100, both forms peak no higher than MultiSteps
(within a leaf of VMEM scratch on TPU).
"""

import json
import os
import sys

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

import harness
import report
from zoo import compile_only as co

KEY = "o"
TITLE = "The emitting micro-step, compiled: where the updates live"
COMPILERS = ["tpu", "gpu", "cpu"]
CONFIGS = {
    "full": {"k": 4, "leaves": 8, "size": 4096, "inners": ["adamw", "muon"],
             "compilers": COMPILERS},
    "quick": {"k": 4, "leaves": 4, "size": 2048, "inners": ["adamw", "muon"],
              "compilers": COMPILERS},
    "toy": {"k": 2, "leaves": 2, "size": 256, "inners": ["adamw"],
            "compilers": ["cpu", "tpu"]},
}
SPLIT, FUSED = "tx.update + oa.apply_if_updated", "oa.update_and_apply"
MULTISTEPS, HAND, FLOOR = ("optax.MultiSteps", "hand-written lax.cond",
                           "floor: sum += g")
CANDIDATES = (SPLIT, FUSED, MULTISTEPS, HAND, FLOOR)
_EMIT_KIND = {SPLIT: "apply_if_updated", FUSED: "update_and_apply",
              MULTISTEPS: "MultiSteps"}  # zoo/compile_only.emit_step's.


def _inner(name):
  return optax.adamw(1e-3) if name == "adamw" else optax.contrib.muon(1e-3)


def _hand_written(inner, k):
  """The cond a user would write: state (sum, inner state, micro-step)."""

  def init(params):
    return (jax.tree.map(jnp.zeros_like, params), inner.init(params),
            jnp.zeros([], jnp.int32))

  def step(params, state, grads):
    sums, inner_state, i = state
    sums = jax.tree.map(jnp.add, sums, grads)

    def emit(params, sums, inner_state):
      mean = jax.tree.map(lambda s: s / k, sums)
      updates, inner_state = inner.update(mean, inner_state, params)
      return (optax.apply_updates(params, updates),
              jax.tree.map(jnp.zeros_like, sums), inner_state)

    params, sums, inner_state = lax.cond(
        i == k - 1, emit, lambda *a: a, params, sums, inner_state)
    return params, (sums, inner_state, (i + 1) % k)

  return init, step


def _candidate(name, inner, k):
  """``(init, step)``: ``step(params, state, grads) -> (params, state)``."""
  if name == HAND:
    return _hand_written(inner, k)
  if name == FLOOR:
    return (lambda p: jax.tree.map(jnp.zeros_like, p),
            lambda p, s, g: (p, jax.tree.map(jnp.add, s, g)))
  return co.emit_step(_EMIT_KIND[name], inner, k)


def _compile(device, cfg, name, inner_name):
  mesh = co.mesh([device], (1,), ("x",))
  leaves, size = cfg["leaves"], cfg["size"]
  params = co.abstract(
      {f"w{i}": jax.ShapeDtypeStruct((size, size), jnp.float32)
       for i in range(leaves)}, mesh, {f"w{i}": P() for i in range(leaves)})
  init, step = _candidate(name, _inner(inner_name), cfg["k"])
  with jax.set_mesh(mesh):
    state = jax.eval_shape(init, params)
    state = co.abstract(state, mesh, jax.tree.map(lambda _: P(), state))
    return jax.jit(step, donate_argnums=(0, 1, 2)).lower(
        params, state, params).compile()


def _measure(compiler, cfg):
  """Each candidate's memory on one device of ``compiler``."""
  if compiler == "tpu":
    device = co.tpu_devices()[0]
  elif compiler == "gpu":
    device = co.gpu_devices()[0]
  elif compiler == "local":  # the default backend's device (on_device.py).
    device = jax.devices()[0]
  else:
    device = jax.devices("cpu")[0]
  out = {"device_kind": device.device_kind, "inners": {}}
  for inner_name in cfg["inners"]:
    out["inners"][inner_name] = {
        name: harness.memory(_compile(device, cfg, name, inner_name))
        for name in CANDIDATES}
  return out


def _missing(compiler):
  return {"tpu": co.missing_tpu, "gpu": co.missing_gpu,
          "cpu": lambda: None, "local": lambda: None}[compiler]()


def run(cfg):
  out = {"param_bytes": cfg["leaves"] * cfg["size"] ** 2 * 4,
         "leaves": cfg["leaves"], "size": cfg["size"], "k": cfg["k"],
         "compilers": {}}
  for compiler in cfg.get("compilers", COMPILERS):
    if _missing(compiler):
      out["compilers"][compiler] = {"skipped": _missing(compiler)}
      continue
    if compiler == "local":  # in this process, on the device in hand.
      out["compilers"][compiler] = _measure(compiler, cfg)
      continue
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if compiler == "gpu":  # compile-only GPUs need jax on the CPU platform.
      env["JAX_PLATFORMS"] = "cpu"
    out["compilers"][compiler] = harness.in_child(
        __file__, {**cfg, "compiler": compiler}, env=env)
  return out


def _peaks(result, compiler, inner):
  entry = result["compilers"].get(compiler, {})
  return {n: m["peak_bytes"] for n, m in
          entry.get("inners", {}).get(inner, {}).items()}


def _accelerator(result, compiler):
  """TPU, GPU, or ``"local"`` (on_device.py) on a device that is no CPU."""
  if compiler == "local":
    kind = result["compilers"][compiler].get("device_kind", "cpu")
    return "cpu" not in kind.lower()
  return compiler in ("tpu", "gpu")


def checks(result):
  """On TPU and H100, both forms within one leaf (TPU: VMEM scratch) and a
  MiB of scalars of MultiSteps."""
  out = []
  for compiler in result["compilers"]:
    for inner in ("adamw", "muon"):
      peaks = _peaks(result, compiler, inner)
      if peaks and _accelerator(result, compiler):
        out += [harness.Check(
            f"{compiler.upper()}, {inner}: {form} peak minus"
            " optax.MultiSteps's (bytes)",
            max(0, peaks[form] - peaks[MULTISTEPS]),
            result["param_bytes"] // result["leaves"] + harness.MiB)
                for form in (FUSED, SPLIT)]
  return out


def summary_rows(result):
  rows = []
  for compiler in result["compilers"]:
    peaks = _peaks(result, compiler, "adamw")
    if not peaks:
      continue
    accelerator = _accelerator(result, compiler)
    for form in (FUSED, SPLIT):
      ratio = peaks[form] / peaks[MULTISTEPS]
      rows.append(report.Row(
          f"o. {compiler.upper()}: donated adamw micro-step peak, {form} /"
          f" optax.MultiSteps", report.mib(peaks[form]),
          report.mib(peaks[MULTISTEPS]), f"{ratio:.3f}x",
          "<= 1x on TPU and H100" if accelerator else "-",
          ratio <= 1.0 + 1.0 / result["leaves"] or not accelerator))
  return rows


def markdown(result):
  lines = [
      f"One donated micro-step, {result['leaves']} f32[{result['size']},"
      f" {result['size']}] parameters ({report.mib(result['param_bytes'])}),"
      f" every_k={result['k']}, the gradients passed in; compiled for one"
      " device, nothing run. Peak (`peak_memory_in_bytes`; on TPU it also"
      " counts the chip's VMEM scratch) and, in brackets, its excess over"
      " the floor.", "",
      "| compiler | inner | " + " | ".join(CANDIDATES) + " |",
      "|---|---|" + "---|" * len(CANDIDATES)]
  for compiler, entry in result["compilers"].items():
    if "skipped" in entry:
      lines.append(f"| {compiler} | skipped: {entry['skipped']} |"
                   + " |" * len(CANDIDATES))
      continue
    for inner, mems in entry["inners"].items():
      floor = mems[FLOOR]["peak_bytes"]
      cells = [f"{harness.peak_label(mems[n], report.mib)} (+"
               f"{report.mib(mems[n]['peak_bytes'] - floor)})"
               for n in CANDIDATES]
      lines.append(f"| {compiler} ({entry['device_kind']}) | {inner} | "
                   + " | ".join(cells) + " |")
  return lines + ["", harness.MEMORY_REF]


if __name__ == "__main__":
  config = json.loads(sys.argv[1])
  if config["compiler"] == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  print(json.dumps(_measure(config["compiler"], config)))
