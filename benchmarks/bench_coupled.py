"""f. A loss that couples the batch: ``oa.coupled_value_and_grad`` vs k.

Symmetric InfoNCE with in-batch negatives on a GELU MLP encoder shared by two
views (two-tower contrastive learning). ``oa.coupled_value_and_grad(encode,
info_nce, num_microbatches=k)`` against one ``jax.value_and_grad`` of the
whole batch: time per call on a compute-bound encoder (it costs one extra
forward pass: about 4/3 of the full batch's work), and compiled temporary
memory on an activation-heavy one (wide hidden layers, narrow embeddings;
compiled only, never run). Checked: the loss and gradients agree with the
full batch's.
"""

import itertools
import math

import jax
import jax.numpy as jnp

import harness
import optax_accum as oa
import report

KEY = "f"
TITLE = "A loss that couples the batch: oa.coupled_value_and_grad"
CONFIGS = {
    "full": {
        "k": 8, "reps": 5, "time_ks": [1, 2, 4, 8, 16],
        "time_model": {"batch_size": 2048, "d_in": 512, "width": 1024,
                       "depth": 4, "d_out": 256},
        "memory_ks": [1, 2, 4, 8, 16, 32],
        "memory_model": {"batch_size": 4096, "d_in": 256, "width": 2048,
                         "depth": 6, "d_out": 64}},
    "quick": {
        "k": 8, "reps": 3, "time_ks": [1, 8],
        "time_model": {"batch_size": 1024, "d_in": 256, "width": 512,
                       "depth": 4, "d_out": 128},
        "memory_ks": [1, 2, 4, 8, 16],
        "memory_model": {"batch_size": 2048, "d_in": 128, "width": 1024,
                         "depth": 6, "d_out": 64}},
    "toy": {
        "k": 2, "reps": 1, "time_ks": [2],
        "time_model": {"batch_size": 16, "d_in": 8, "width": 16, "depth": 2,
                       "d_out": 4},
        "memory_ks": [2],
        "memory_model": {"batch_size": 16, "d_in": 8, "width": 16,
                         "depth": 2, "d_out": 4}},
}
FULL = "full batch jax.value_and_grad"
OURS = "oa.coupled_value_and_grad"
# Most of the full batch's time (at k) and temp memory (at k) ours may take.
TIME_TARGET, MEMORY_TARGET = 1.4, 0.35


def make_contrastive(batch_size, d_in, width, depth, d_out, seed=0):
  """``(params, batch, encode, info_nce)``: a two-view InfoNCE problem."""
  keys = jax.random.split(jax.random.key(seed), depth + 2)
  dims = [d_in] + [width] * (depth - 1) + [d_out]
  params = {"layers": [
      {"w": jax.random.normal(keys[i], (m, n), jnp.float32) / math.sqrt(m),
       "b": jnp.zeros((n,), jnp.float32)}
      for i, (m, n) in enumerate(itertools.pairwise(dims))],
            "log_scale": jnp.float32(math.log(10.0))}
  x = jax.random.normal(keys[-2], (batch_size, d_in), jnp.float32)
  noise = jax.random.normal(keys[-1], (batch_size, d_in), jnp.float32)
  batch = {"a": x, "b": x + 0.3 * noise}

  def embed(params, x):
    *hidden, last = params["layers"]
    for layer in hidden:
      x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    x = x @ last["w"] + last["b"]
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  def encode(params, microbatch):
    return {"a": embed(params, microbatch["a"]),
            "b": embed(params, microbatch["b"])}

  def info_nce(params, reps, batch):
    del batch
    logits = jnp.exp(params["log_scale"]) * reps["a"] @ reps["b"].T
    a_to_b = -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=1)))
    b_to_a = -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=0)))
    return (a_to_b + b_to_a) / 2

  return params, batch, encode, info_nce


def compile_candidates(spec, ks):
  """The full batch and ours at each k, compiled ahead of time."""
  params, batch, encode, info_nce = make_contrastive(**spec)
  full = jax.value_and_grad(lambda p, b: info_nce(p, encode(p, b), b))
  compiled = {FULL: jax.jit(full).lower(params, batch).compile()}
  for k in ks:
    ours = oa.coupled_value_and_grad(encode, info_nce, num_microbatches=k)
    compiled[f"{OURS} k={k}"] = jax.jit(ours).lower(params, batch).compile()
  return params, batch, compiled


def time_vs_k(spec, ks, reps):
  params, batch, compiled = compile_candidates(spec, ks)
  ref_loss, ref_grads = compiled[FULL](params, batch)
  errors = {}
  for name, c in compiled.items():
    loss, grads = c(params, batch)
    errors[name] = {"loss_abs_diff_vs_full": float(abs(loss - ref_loss)),
                    "max_abs_grad_diff_vs_full":
                        harness.max_abs_diff(grads, ref_grads)}
  times = harness.interleaved(harness.compiled_calls(compiled, params, batch),
                              reps=reps)
  return {"spec": spec, "ks": ks, "candidates": harness.summarize_times(times),
          "loss": float(ref_loss), "max_abs_grad": harness.max_abs(ref_grads),
          "errors": errors}


def temp_memory_vs_k(spec, ks):
  params, batch, compiled = compile_candidates(spec, ks)
  memory = {name: harness.memory(c) for name, c in compiled.items()}
  return {"spec": spec, "ks": ks, "param_bytes": harness.tree_bytes(params),
          "batch_bytes": harness.tree_bytes(batch),
          "temp_bytes": {name: m["temp_bytes"] for name, m in memory.items()},
          "peak": {name: {key: m[key] for key in ("peak_bytes",
                                                  "peak_measure")}
                   for name, m in memory.items()}}


def run(cfg):
  return {"k": cfg["k"],
          "time": time_vs_k(cfg["time_model"], cfg["time_ks"], cfg["reps"]),
          "temp": temp_memory_vs_k(cfg["memory_model"], cfg["memory_ks"])}


def checks(result):
  t = result["time"]
  return [check for name, e in t["errors"].items() if name != FULL
          for check in (
      harness.Check(f"{name}: max abs grad diff vs full batch / max abs grad",
                    e["max_abs_grad_diff_vs_full"] / t["max_abs_grad"], 1e-4),
      harness.Check(f"{name}: loss diff vs full batch / loss",
                    e["loss_abs_diff_vs_full"] / abs(t["loss"]), 1e-5))]


def _ratios(result):
  k = result["k"]
  t, m = result["time"]["candidates"], result["temp"]["temp_bytes"]
  return (t[f"{OURS} k={k}"]["median_s"], t[FULL]["median_s"],
          m[f"{OURS} k={k}"], m[FULL])


def summary_rows(result):
  k = result["k"]
  ours_s, full_s, ours_b, full_b = _ratios(result)
  return [
      report.Row(f"f. time, oa.coupled_value_and_grad(k={k}) / full batch",
                 report.ms(ours_s), report.ms(full_s),
                 f"{ours_s / full_s:.2f}x", f"<= {TIME_TARGET}x",
                 ours_s / full_s <= TIME_TARGET),
      report.Row(f"f. temp memory, oa.coupled_value_and_grad(k={k}) / full"
                 " batch", report.mib(ours_b), report.mib(full_b),
                 f"{ours_b / full_b:.3f}x", f"<= {MEMORY_TARGET}x",
                 ours_b / full_b <= MEMORY_TARGET),
  ]


def markdown(result):
  t, m = result["time"], result["temp"]
  full_s = t["candidates"][FULL]["median_s"]
  full_b = m["temp_bytes"][FULL]
  times = [t["candidates"][f"{OURS} k={k}"]["median_s"] for k in t["ks"]]
  temps = [m["temp_bytes"][f"{OURS} k={k}"] for k in m["ks"]]
  return [
      f"Symmetric InfoNCE, two views through one MLP encoder. Time per call"
      f" on `{report.spec(t['spec'])}` (full batch: {report.ms(full_s)}):",
      "",
      "| k | " + " | ".join(str(k) for k in t["ks"]) + " |",
      "|---|" + "---|" * len(t["ks"]),
      f"| {OURS} | " + " | ".join(
          f"{report.ms(s)} ({s / full_s:.2f}x)" for s in times) + " |",
      "",
      f"Compiled temp memory on `{report.spec(m['spec'])}` (params"
      f" {report.mib(m['param_bytes'])}, batch {report.mib(m['batch_bytes'])};"
      f" full batch: {report.mib(full_b)}):",
      "",
      "| k | " + " | ".join(str(k) for k in m["ks"]) + " |",
      "|---|" + "---|" * len(m["ks"]),
      f"| {OURS} | " + " | ".join(
          f"{report.mib(b)} ({b / full_b:.2f}x)" for b in temps) + " |",
      f"| {OURS}, peak | " + " | ".join(
          harness.peak_label(m["peak"][f"{OURS} k={k}"], report.mib)
          for k in m["ks"]) + " |",
      "",
      f"Full batch's peak: {harness.peak_label(m['peak'][FULL], report.mib)}."
      " Target and plot: temp (`temp_size_in_bytes`), the activations that"
      " fall with k. " + harness.MEMORY_REF,
  ]


def plot(result, fig):
  """Time and temp memory vs k, relative to the full batch, with targets."""
  fig.set_size_inches(10, 4.2)
  ax_t, ax_m = fig.subplots(1, 2)
  t, m, k = result["time"], result["temp"], result["k"]
  full_s = t["candidates"][FULL]["median_s"]
  ax_t.plot(t["ks"], [t["candidates"][f"{OURS} k={j}"]["median_s"] / full_s
                      for j in t["ks"]], marker="o", label=OURS)
  ax_t.plot([k], [TIME_TARGET], marker="v", ms=9, color="r", ls="none",
            label=f"target at k={k}: <= {TIME_TARGET}x")
  ax_t.set(ylabel="time per call / full batch", title="Time vs k")
  full_b = m["temp_bytes"][FULL]
  ax_m.plot(m["ks"], [m["temp_bytes"][f"{OURS} k={j}"] / full_b
                      for j in m["ks"]], marker="o", label=OURS)
  ax_m.plot([k], [MEMORY_TARGET], marker="v", ms=9, color="r", ls="none",
            label=f"target at k={k}: <= {MEMORY_TARGET}x")
  ax_m.set(ylabel="compiled temp memory / full batch",
           title="Temporary memory vs k")
  for ax, ks in ((ax_t, t["ks"]), (ax_m, m["ks"])):
    ax.axhline(1.0, color="k", ls="--", label="full batch")
    ax.set(xscale="log", xlabel="num_microbatches k")
    ax.set_xticks(ks, [str(j) for j in ks])
    ax.set_ylim(0, max(ax.get_ylim()[1], 1.1 * TIME_TARGET))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
