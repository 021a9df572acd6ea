"""A probe: the one reduction hidden in a whole train step, optimizer included.

Not in the registry. Benchmark q's 16-layer decoder (:data:`bench_overlap.
DECODER`: vocabulary 16384, width 256, untied embedding and unembedding,
k = 4) on 8 data-parallel devices, in the train step a user jits:
``oa.value_and_grad``, then the inner optimizer's update and
``optax.apply_updates``, parameters and optimizer state donated. Optimizers:
``adamw`` (each leaf's update needs that leaf's reduced gradient only) and
``clip+adamw`` (``optax.clip_by_global_norm`` first: the update waits for
every reduction). Candidates: ``overlap_reduction`` on (ours) and off
(today). Each is compiled, never run, and read by ``oa.reduction_overlap``:
its share (reductions started before the last matrix multiply), and, for
those started after it, the bytes that other work between their start and
done writes (``bytes_written_between``: the other leaves' update, where
nothing global waits). Figures: ``results/q_decoder.md``, last section.

  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_all_reduce_combine_threshold_bytes=0 \\
      python benchmarks/probe_train_step.py "H100, no combining"  # gpu extra
  LIBTPU_INIT_ARGS="<overlap_candidates.TPU_OVERLAP_FLAGS>" \\
      python benchmarks/probe_train_step.py "TPU v5e, overlap flags"
"""

import os
import sys

import jax
import optax

# The repository root, for the ``zoo`` package (``python
# benchmarks/probe_train_step.py`` puts only benchmarks/ on sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(1, _ROOT)

import bench_overlap  # noqa: E402
import optax_accum as oa  # noqa: E402
import overlap_candidates as oc  # noqa: E402

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(1e-3, weight_decay=0.1)),
}


def _train_step(value_and_grad, inner):
  def step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def measure(setting, mesh_name="data"):
  """One row per optimizer and candidate: what the compiled step shows."""
  cfg = dict(bench_overlap.DECODER, compiler=setting)
  _, devices = oc.devices_of(setting)
  mesh, data_axes, _, steps = oc.problem(mesh_name, cfg, devices)
  rows = []
  for name, make in OPTIMIZERS.items():
    for cand in (oc.OURS, oc.TODAY):
      inner = make()
      value_and_grad, (params, batch), _ = steps[cand]
      with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(inner.init, params)
      compiled, lowering, compiling = oc.compile_candidate(
          mesh, _train_step(value_and_grad, inner),
          (params, opt_state, batch), cand, donate=(0, 1))
      with jax.set_mesh(mesh):
        report = oa.reduction_overlap(compiled, data_axes=data_axes)
      late = [r for r in report.reductions if not r.overlapped]
      rows.append((
          name, cand, report.overlapped_share, report.num_reductions,
          sum(r.nbytes for r in late) / 2**20,
          sum(r.bytes_written_between for r in late) / 2**20,
          compiled.memory_analysis().peak_memory_in_bytes / 2**20,
          lowering + compiling))
  return rows


if __name__ == "__main__":
  print("optimizer | candidate | share | reductions | MiB started after the"
        " last matmul | MiB written beside them | peak MiB | compile s")
  for row in measure(sys.argv[1] if len(sys.argv) > 1 else
                     "H100, no combining"):
    print("{} | {} | {:.1%} | {} | {:.1f} | {:.1f} | {:.1f} | {:.0f}".format(
        *row))
