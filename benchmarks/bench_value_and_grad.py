"""c. Value and gradient of one batch, split into k micro-batches.

``oa.value_and_grad(loss, num_microbatches=k)`` vs one full-batch
``jax.value_and_grad`` vs ``optax.microbatching.microbatch``, on an MLP and on
a small transformer. Checked: the gradients agree with the full batch's.
"""

import jax
from optax import microbatching

import harness
import optax_accum as oa
import report
from zoo import models

KEY = "c"
TITLE = "Value and gradient of one batch"
# Micro-batches of 512 rows in the full run: big enough to keep the CPU's
# matmuls compute-bound (the sweep of d shows the cost of smaller ones).
CONFIGS = {
    "full": {"k": 8, "reps": 7, "models": {
        "mlp": {"kind": "mlp", "batch_size": 4096, "d_in": 1024,
                "width": 2048, "depth": 4, "d_out": 1024},
        "transformer": {"kind": "transformer", "batch_size": 32,
                        "seq_len": 128, "d_model": 256, "num_heads": 4,
                        "num_layers": 2, "vocab_size": 2048}}},
    "quick": {"k": 8, "reps": 7, "models": {
        "mlp": {"kind": "mlp", "batch_size": 2048, "d_in": 512,
                "width": 1024, "depth": 4, "d_out": 512},
        "transformer": {"kind": "transformer", "batch_size": 16,
                        "seq_len": 64, "d_model": 128, "num_heads": 4,
                        "num_layers": 2, "vocab_size": 512}}},
    # The toy size (the smoke test's) leaves out the transformer: even a tiny
    # one takes seconds to compile.
    "toy": {"k": 2, "reps": 1, "models": {
        "mlp": {"kind": "mlp", "batch_size": 8, "d_in": 8, "width": 16,
                "depth": 2, "d_out": 4}}},
}
FULL, OURS, PEER = ("full batch jax.value_and_grad", "oa.value_and_grad",
                    "optax.microbatching")
# Most of the full batch's and of the peer's time that ours may take.
TARGET_VS_FULL, TARGET_VS_PEER = 1.10, 1.05


def candidates(loss_fn, batch_size, k):
  """Ours and the peer, jitted (not yet compiled), for one k."""
  return {
      OURS: jax.jit(oa.value_and_grad(loss_fn, num_microbatches=k,
                                      equal_weights=True)),
      PEER: jax.jit(microbatching.microbatch(
          jax.value_and_grad(loss_fn), argnums=1,
          microbatch_size=batch_size // k,
          accumulator=microbatching.AccumulationType.MEAN)),
  }


def gradient_errors(compiled, params, batch, ref):
  """Each candidate's loss and gradient differences to ``ref`` (full batch)."""
  ref_loss, ref_grads = ref
  out = {}
  for name, c in compiled.items():
    loss, grads = c(params, batch)
    out[name] = {
        "loss_abs_diff_vs_full": float(abs(loss - ref_loss)),
        "max_abs_grad_diff_vs_full": harness.max_abs_diff(grads, ref_grads),
        "max_abs_grad": harness.max_abs(ref_grads),
    }
  return out


def time_model(spec, k, reps):
  params, batch, loss_fn = models.build_model(spec)
  fns = {FULL: jax.jit(jax.value_and_grad(loss_fn))}
  fns.update(candidates(loss_fn, models.batch_size_of(batch), k))
  compiled = {n: f.lower(params, batch).compile() for n, f in fns.items()}
  ref = compiled[FULL](params, batch)
  times = harness.interleaved(harness.compiled_calls(compiled, params, batch),
                              reps=reps)
  summaries = harness.summarize_times(times)
  errors = gradient_errors(compiled, params, batch, ref)
  return {"spec": spec, "k": k, "param_bytes": harness.tree_bytes(params),
          "candidates": {name: {
              "call": summaries[name], **errors[name],
              "memory": harness.memory(c)}
                         for name, c in compiled.items()}}


def run(cfg):
  return {name: time_model(spec, cfg["k"], cfg["reps"])
          for name, spec in cfg["models"].items()}


def checks(result):
  return [harness.Check(
      f"{model} {name}: max abs grad diff vs full batch / max abs grad",
      c["max_abs_grad_diff_vs_full"] / c["max_abs_grad"], 1e-5)
          for model, e in result.items()
          for name, c in e["candidates"].items()]


def summary_rows(result):
  rows = []
  for model, e in result.items():
    c = e["candidates"]
    ours, full, peer = (c[n]["call"]["median_s"] for n in (OURS, FULL, PEER))
    what = f"c. {model}: oa.value_and_grad(k={e['k']}) / "
    rows.append(report.Row(
        what + "full-batch jax.value_and_grad", report.ms(ours),
        report.ms(full), f"{ours / full:.3f}x", f"<= {TARGET_VS_FULL:.2f}x",
        ours / full <= TARGET_VS_FULL))
    rows.append(report.Row(
        what + "optax.microbatching", report.ms(ours), report.ms(peer),
        f"{ours / peer:.3f}x", f"<= {TARGET_VS_PEER:.2f}x",
        ours / peer <= TARGET_VS_PEER))
  return rows


def markdown(result):
  lines = ["| model | candidate | call median | / full batch | "
           "max abs grad diff vs full (max abs grad) | peak memory |"
           " temp memory |",
           "|---|---|---|---|---|---|---|"]
  for model, e in result.items():
    full = e["candidates"][FULL]["call"]["median_s"]
    for name, c in e["candidates"].items():
      lines.append(
          f"| {model} | {name} | {report.ms(c['call']['median_s'])} | "
          f"{c['call']['median_s'] / full:.3f}x | "
          f"{c['max_abs_grad_diff_vs_full']:.1e} ({c['max_abs_grad']:.1e})"
          f" | {harness.peak_label(c['memory'], report.mib)}"
          f" | {report.mib(c['memory']['temp_bytes'])} |")
  lines.append("")
  lines += [harness.MEMORY_REF, ""]
  for model, e in result.items():
    lines.append(f"- {model}: `{report.spec(e['spec'])}`, "
                 f"params {report.mib(e['param_bytes'])}")
  return lines
