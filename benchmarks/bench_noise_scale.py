"""g. The cost of the gradient noise scale: ``with_stats=True`` vs without.

``oa.value_and_grad(loss, num_microbatches=k, with_stats=True)`` vs the same
call without statistics, on the models of c. The statistics cost one squared
norm of each micro-batch's gradient (a pass over the gradient, no pass over
the data) and a few scalars. Checked: the value and gradient are those of the
call without statistics, and the statistics are finite.

A third candidate, for the explanation only, is ``with_stats=True`` with the
squared norm stubbed out (a constant zero, patched in while tracing): its
statistics are wrong, but its time splits the overhead into the bookkeeping
(the carry, the scalars) and the norm itself (one more read of each
micro-batch's gradient, which XLA's CPU backend does not fuse with the add).
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import bench_value_and_grad
import harness
import optax_accum as oa
from optax_accum._src.rules import noise_scale
import report
from zoo import models

KEY = "g"
TITLE = "Gradient noise scale: with_stats=True vs without"
# The models and sizes of c: the overhead is relative to the same gradient
# computation; the full run takes more repetitions for a ratio near 1.
CONFIGS = {
    size: {**cfg, "reps": 15 if size == "full" else cfg["reps"]}
    for size, cfg in bench_value_and_grad.CONFIGS.items()
}
STATS, PLAIN = "with_stats=True", "without"
NO_NORM = "with_stats=True, norm stubbed (diagnostic)"
TARGET = 1.03  # Most of the plain call's time that the statistics may take.


def _no_norm(tree):
  del tree
  return jnp.zeros([], jnp.float32)


def candidates(loss_fn, k):
  """With and without statistics, jitted (not yet compiled).

  Each row of the models' batches is one item of the mean loss.
  """
  def fn(with_stats):
    return jax.jit(oa.value_and_grad(
        loss_fn, num_microbatches=k, num_tokens_fn=models.batch_size_of,
        with_stats=with_stats))
  return {STATS: fn(True), PLAIN: fn(False), NO_NORM: fn(True)}


def _tracing(name):
  """The norm is stubbed while the diagnostic candidate is traced."""
  if name == NO_NORM:
    return mock.patch.object(noise_scale, "sq_norm", _no_norm)
  return contextlib.nullcontext()


def time_model(spec, k, reps):
  params, batch, loss_fn = models.build_model(spec)
  compiled = {}
  for name, f in candidates(loss_fn, k).items():
    with _tracing(name):
      compiled[name] = f.lower(params, batch).compile()
  times = harness.interleaved(harness.compiled_calls(compiled, params, batch),
                              reps=reps)
  summaries = harness.summarize_times(times)
  value, grads, stats = compiled[STATS](params, batch)
  plain_value, plain_grads = compiled[PLAIN](params, batch)
  return {
      "spec": spec, "k": k, "param_bytes": harness.tree_bytes(params),
      "candidates": {name: {"call": summaries[name],
                            "memory": harness.memory(c)}
                     for name, c in compiled.items()},
      "loss_abs_diff": float(abs(value - plain_value)),
      "max_abs_grad_diff": harness.max_abs_diff(grads, plain_grads),
      "max_abs_grad": harness.max_abs(plain_grads),
      "stats": {name: float(x) for name, x in stats._asdict().items()},
  }


def run(cfg):
  return {name: time_model(spec, cfg["k"], cfg["reps"])
          for name, spec in cfg["models"].items()}


def _ratio(e):
  c = e["candidates"]
  return c[STATS]["call"]["median_s"] / c[PLAIN]["call"]["median_s"]


def checks(result):
  out = []
  for model, e in result.items():
    out.append(harness.Check(
        f"{model}: max abs grad diff with vs without stats / max abs grad",
        e["max_abs_grad_diff"] / e["max_abs_grad"], 1e-6))
    out.append(harness.Check(
        f"{model}: statistics that are not finite",
        float(sum(not np.isfinite(x) for x in e["stats"].values())), 0.0))
  return out


def summary_rows(result):
  rows = []
  for model, e in result.items():
    c = e["candidates"]
    ours, bookkeeping, plain = (c[n]["call"]["median_s"]
                                for n in (STATS, NO_NORM, PLAIN))
    rows.append(report.Row(
        f"g. {model}: oa.value_and_grad(k={e['k']}) with_stats=True /"
        " without", report.ms(ours), report.ms(plain), f"{ours / plain:.3f}x",
        f"<= {TARGET:.2f}x", ours / plain <= TARGET))
    rows.append(report.Row(
        f"g. {model}: the same with the norm stubbed (bookkeeping alone) /"
        " without", report.ms(bookkeeping), report.ms(plain),
        f"{bookkeeping / plain:.3f}x", "-", True))
  return rows


def markdown(result):
  lines = ["| model | candidate | call median (p25-p75) | / without |"
           " peak memory | temp memory |", "|---|---|---|---|---|---|"]
  for model, e in result.items():
    plain = e["candidates"][PLAIN]["call"]["median_s"]
    for name, c in e["candidates"].items():
      call = c["call"]
      lines.append(
          f"| {model} | {name} | {report.ms(call['median_s'])}"
          f" ({report.ms(call['p25_s'])}-{report.ms(call['p75_s'])}) |"
          f" {call['median_s'] / plain:.3f}x |"
          f" {harness.peak_label(c['memory'], report.mib)} |"
          f" {report.mib(c['memory']['temp_bytes'])} |")
  lines += ["", harness.MEMORY_REF, ""]
  for model, e in result.items():
    s = e["stats"]
    lines.append(
        f"- {model}: `{report.spec(e['spec'])}`, params"
        f" {report.mib(e['param_bytes'])}; statistics of this batch (random"
        f" data, rows as items): noise scale {s['noise_scale']:.3g},"
        f" |G|^2 {s['grad_sq_norm']:.3g}, tr(Sigma) {s['trace_cov']:.3g},"
        f" {s['num_microbatches']:.0f} micro-batches; gradients differ from"
        f" the call without statistics by {e['max_abs_grad_diff']:.1e}.")
  return lines
