"""d. Time and compiled temporary memory vs the number of micro-batches k.

Time per call on a compute-bound MLP, and compiled temporary memory on
activation-heavy models (compiled only, never run), of ``oa.value_and_grad``
and ``optax.microbatching`` against one full-batch ``jax.value_and_grad``.
Checked: the timed candidates' gradients agree with the full batch's.
"""

import jax

import bench_value_and_grad
import harness
import report
from zoo import models

KEY = "d"
TITLE = "Time and temporary memory vs k"
CONFIGS = {
    "full": {
        "k": 8, "reps": 5, "time_ks": [1, 2, 4, 8, 16, 32],
        "time_model": {"kind": "mlp", "batch_size": 1024, "d_in": 1024,
                       "width": 2048, "depth": 4, "d_out": 1024},
        "memory_ks": [1, 2, 4, 8, 16, 32],
        "memory_models": {
            "mlp": {"kind": "mlp", "batch_size": 8192, "d_in": 512,
                    "width": 1024, "depth": 8, "d_out": 512},
            "transformer": {"kind": "transformer", "batch_size": 64,
                            "seq_len": 256, "d_model": 256, "num_heads": 4,
                            "num_layers": 4, "vocab_size": 2048}}},
    "quick": {
        "k": 8, "reps": 3, "time_ks": [1, 4, 8, 32],
        "time_model": {"kind": "mlp", "batch_size": 256, "d_in": 256,
                       "width": 512, "depth": 4, "d_out": 256},
        "memory_ks": [1, 2, 4, 8, 16, 32],
        "memory_models": {
            "mlp": {"kind": "mlp", "batch_size": 2048, "d_in": 256,
                    "width": 1024, "depth": 8, "d_out": 256},
            "transformer": {"kind": "transformer", "batch_size": 32,
                            "seq_len": 128, "d_model": 128, "num_heads": 4,
                            "num_layers": 2, "vocab_size": 512}}},
    "toy": {
        "k": 2, "reps": 1, "time_ks": [2],
        "time_model": {"kind": "mlp", "batch_size": 8, "d_in": 8,
                       "width": 16, "depth": 2, "d_out": 4},
        "memory_ks": [2],
        "memory_models": {
            "mlp": {"kind": "mlp", "batch_size": 16, "d_in": 8,
                    "width": 16, "depth": 2, "d_out": 4}}},
}
PLOT_SUFFIX = ""  # Its plot is PREFIX.png: results/latest.png.
TARGET = 0.3  # Most of the full batch's temp memory that ours may need at k.
# The target and the plot read temp: activations, the part that falls with
# k. The peak (below them) is, on XLA:CPU, temp + arguments + outputs.
PEAK_NOTE = (
    "Target and plot: temp (`temp_size_in_bytes`), the activations that fall"
    " with k. " + harness.MEMORY_REF)
NAMES = (bench_value_and_grad.OURS, bench_value_and_grad.PEER)


def compile_candidates(spec, ks):
  """The full batch and ours and the peer at each k, compiled."""
  params, batch, loss_fn = models.build_model(spec)
  bs = models.batch_size_of(batch)
  compiled = {"full batch": jax.jit(jax.value_and_grad(loss_fn)).lower(
      params, batch).compile()}
  for k in ks:
    for name, f in bench_value_and_grad.candidates(loss_fn, bs, k).items():
      compiled[f"{name} k={k}"] = f.lower(params, batch).compile()
  return params, batch, compiled


def time_vs_k(spec, ks, reps):
  params, batch, compiled = compile_candidates(spec, ks)
  times = harness.interleaved(harness.compiled_calls(compiled, params, batch),
                              reps=reps)
  ref_grads = compiled["full batch"](params, batch)[1]
  return {"model": spec["kind"], "spec": spec, "ks": ks,
          "candidates": harness.summarize_times(times),
          "max_abs_grad": harness.max_abs(ref_grads),
          "max_abs_grad_diff_vs_full": {
              name: harness.max_abs_diff(c(params, batch)[1], ref_grads)
              for name, c in compiled.items()}}


def temp_memory_vs_k(spec, ks):
  params, batch, compiled = compile_candidates(spec, ks)
  memory = {name: harness.memory(c) for name, c in compiled.items()}
  entry = {"spec": spec, "param_bytes": harness.tree_bytes(params),
           "batch_bytes": harness.tree_bytes(batch),
           "full batch": memory["full batch"]["temp_bytes"],
           "peak": {name: {key: m[key] for key in ("peak_bytes",
                                                   "peak_measure")}
                    for name, m in memory.items()}}
  for name in NAMES:
    entry[name] = {k: memory[f"{name} k={k}"]["temp_bytes"] for k in ks}
  return entry


def run(cfg):
  return {"k": cfg["k"], "ks": cfg["memory_ks"],
          "time": time_vs_k(cfg["time_model"], cfg["time_ks"], cfg["reps"]),
          "temp": {name: temp_memory_vs_k(spec, cfg["memory_ks"])
                   for name, spec in cfg["memory_models"].items()}}


def checks(result):
  t = result["time"]
  return [harness.Check(
      f"{t['model']} {name}: max abs grad diff vs full batch / max abs grad",
      diff / t["max_abs_grad"], 1e-5)
          for name, diff in t["max_abs_grad_diff_vs_full"].items()]


def summary_rows(result):
  k = result["k"]
  rows = []
  for model, e in result["temp"].items():
    ours, full = e[bench_value_and_grad.OURS][k], e["full batch"]
    rows.append(report.Row(
        f"d. {model}: temp memory, oa.value_and_grad(k={k}) / full batch",
        report.mib(ours), report.mib(full), f"{ours / full:.3f}x",
        f"<= {TARGET}x", ours / full <= TARGET))
  return rows


def markdown(result):
  t = result["time"]
  full = report.ms(t["candidates"]["full batch"]["median_s"])
  lines = [f"Time per call on the `{t['model']}` `{report.spec(t['spec'])}` "
           f"(full batch: {full}); the micro-batch has batch_size / k rows:",
           "", *k_table(t["ks"], lambda name, k: report.ms(
               t["candidates"][f"{name} k={k}"]["median_s"])), ""]
  for model, e in result["temp"].items():
    lines += [f"Compiled temp memory, `{model}` (`{report.spec(e['spec'])}`, "
              f"params {report.mib(e['param_bytes'])}, batch "
              f"{report.mib(e['batch_bytes'])}); full batch: "
              f"{report.mib(e['full batch'])}:", "",
              *k_table(result["ks"], lambda name, k, e=e: (
                  f"{report.mib(e[name][k])} "
                  f"({e[name][k] / e['full batch']:.2f}x)")), ""]
    peak = e["peak"]
    lines += [f"Compiled peak memory, `{model}`; full batch:"
              f" {harness.peak_label(peak['full batch'], report.mib)}:", "",
              *k_table(result["ks"], lambda name, k, p=peak: (
                  harness.peak_label(p[f"{name} k={k}"], report.mib))), ""]
  return lines + [PEAK_NOTE]


def k_table(ks, cell):
  """A Markdown table with a column per k and a row per candidate."""
  lines = ["| k | " + " | ".join(str(k) for k in ks) + " |",
           "|---|" + "---|" * len(ks)]
  for name in NAMES:
    lines.append(f"| {name} | " + " | ".join(cell(name, k) for k in ks)
                 + " |")
  return lines


def plot(result, fig):
  """Time (left) and temp memory (right) vs k, relative to the full batch."""
  fig.set_size_inches(12, 4.8)
  ax_t, ax_m = fig.subplots(1, 2)
  styles = dict(zip(NAMES, (("C0", "o"), ("C1", "s"))))
  t = result["time"]
  for name, (color, marker) in styles.items():
    ax_t.plot(t["ks"], [t["candidates"][f"{name} k={k}"]["median_s"] * 1e3
                        for k in t["ks"]],
              marker=marker, color=color, label=name)
  ax_t.axhline(t["candidates"]["full batch"]["median_s"] * 1e3, color="k",
               ls="--", label="full batch jax.value_and_grad")
  ax_t.set(xscale="log", xlabel="num_microbatches k",
           ylabel="time per call (ms, median)",
           title=f"Time vs k ({t['model']}, {t['spec']['batch_size']} rows)")
  ax_t.set_xticks(t["ks"], [str(k) for k in t["ks"]])
  ks = result["ks"]
  for (model, e), ls in zip(result["temp"].items(), ("-", ":")):
    for name, (color, marker) in styles.items():
      ax_m.plot(ks, [e[name][k] / e["full batch"] for k in ks], marker=marker,
                color=color, ls=ls, label=f"{name} ({model})")
  full = ", ".join(f"{n} {report.mib(e['full batch'])}"
                   for n, e in result["temp"].items())
  ax_m.axhline(1.0, color="k", ls="--", label=f"full batch ({full})")
  ax_m.plot([result["k"]], [TARGET], marker="v", ms=9, color="r", ls="none",
            label=f"target at k={result['k']}: <= {TARGET}x")
  ax_m.set(xscale="log", xlabel="num_microbatches k",
           ylabel="compiled temp memory / full batch",
           title="Temporary memory vs k")
  ax_m.set_xticks(ks, [str(k) for k in ks])
  for ax, fontsize in ((ax_t, None), (ax_m, 8)):
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=fontsize)
    ax.grid(alpha=0.3)
