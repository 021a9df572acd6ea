"""q. Hiding the one reduction: overlap, peak, compile time.

Compiled for 8 compile-only devices (benchmark k's: a TPU v5e ``2x4``
slice, and 8 H100s with the ``gpu`` extra), nothing run, on benchmark k's
decoder (``zoo/typed_model.py``). Candidates, one update of ``k``
micro-batches in one call each:

* ``ours``: ``oa.value_and_grad`` in the typed form, the last micro-batch
  after the loop: asked for with ``overlap_reduction=True`` where
  the library takes that argument (``overlap_candidates.OPT_IN``), else
  where the compiler overlaps (GPUs; TPUs with
  ``overlap_candidates.TPU_OVERLAP_FLAGS``);
* ``today``: the same with the last micro-batch kept in the loop (the
  release before ``overlap_reduction``): ``overlap_reduction=False``, or
  ``trip_count.where_it_overlaps`` replaced by its ``plain`` branch while
  tracing;
* ``scan``: the hand-written token-weighted ``lax.scan`` of ``jax.grad``
  (``zoo/peers.py``), reducing after its loop (ZeRO-1: resharded into
  ``oa.zero_specs``'s shards, as ours returns it);
* ``MultiSteps``: ``jax.grad`` of one micro-batch per jitted call fed to
  ``optax.MultiSteps`` (benchmark k's, parameters and state donated): it
  reduces in every call, and XLA may overlap each call's reduction with
  that call's backward; its bytes per update are k calls';
* ``peeled anyway`` (by default only with libtpu's defaults, where ours keeps
  the loop whole): the last micro-batch after the loop whatever the
  compiler, what the peel alone costs there.

Meshes: benchmark k's ``data x tensor`` (4 x 2) and ``fsdp`` (8), and on 8
data-parallel devices ``data`` (parameters replicated) and ``ZeRO-1``
(``param_specs=oa.zero_specs(...)``, ``gradient_sync="once"``). The model's
positional embedding is broadcast before its add (``pos_broadcast``): a leaf
JAX keeps replicated is reduced in every micro-batch, and then the last
micro-batch stays in the loop.

:data:`DECODER` (``python bench_overlap.py decoder``, not one of run.py's
sizes) is a 16-layer decoder in Llama 3.2 1B's proportions on all four
meshes, its layers unrolled and, in the meshes named ``"..., scanned
layers"``, stacked and run by ``lax.scan`` (``scan_layers``); it writes
``results/q_decoder.json``.

The modules: :mod:`overlap_candidates` (compiler settings, meshes, the
candidates' programs), :mod:`overlap_measure` (what is read from each
compiled program, in a child process per compiler setting), :mod:`loop_sums`
(what produces each running sum in the loop's body) and
:mod:`overlap_report` (checks, summary rows, the table).

The results keep each candidate's figures and counts
(:func:`overlap_measure.summary`); each reduction and each running sum,
listed, go to ``"raw_out"`` (git-ignored ``results/raw/``) where the
configuration names it.

The compile times are one compile each (``repeats`` for more, in rotated
order): the first large compile of a process is the slowest, so compare
them with care. With ``"hlo_dir"`` in the configuration each program's
text is written there. Each compiler setting runs in its own child
process (``LIBTPU_INIT_ARGS`` is read once, when libtpu loads;
``XLA_FLAGS`` when jax starts; the CUDA plugin's compile-only GPUs need jax
started on the CPU platform)::

  python benchmarks/bench_overlap.py '{"compiler": "TPU v5e, overlap flags",
                                        ...}'
"""

import fcntl
import json
import os
import re
import sys

import jax

import harness
import overlap_candidates as oc
import overlap_measure
import overlap_report
from zoo import compile_only as co

KEY = "q"
TITLE = "Hiding the one reduction: overlap, peak and compile time"
# Benchmark k's sizes, the positional embedding broadcast before its add
# (``pos_broadcast``): otherwise JAX keeps that leaf replicated and reduces
# it in each micro-batch, and the last micro-batch stays in the loop
# (``reduces_only_after_loop``).
_MODEL_1B = {"vocab": 32768, "seq": 1024, "dim": 4096, "heads": 32,
             "ffn": 16384, "layers": 4, "pos_broadcast": True}
# Where each reduction and running sum goes, listed (from benchmarks/).
_RAW = "results/raw/q_overlap.json"
CONFIGS = {
    "full": {"k": 8, "batch": 64, "repeats": 1, "model": _MODEL_1B,
             "meshes": ["data x tensor", "fsdp"],
             "compilers": list(oc.COMPILERS), "raw_out": _RAW},
    "quick": {"k": 8, "batch": 64, "repeats": 1, "model": {
        "vocab": 32768, "seq": 1024, "dim": 2048, "heads": 16, "ffn": 8192,
        "layers": 2, "pos_broadcast": True},
              "meshes": ["data x tensor", "fsdp"],
              "compilers": list(oc.COMPILERS), "raw_out": _RAW},
    "toy": {"k": 2, "batch": 32, "repeats": 1, "model": {
        "vocab": 64, "seq": 8, "dim": 32, "heads": 4, "ffn": 64,
        "layers": 1, "pos_broadcast": True},
            "meshes": ["data x tensor", "data" + oc.SCANNED],
            "compilers": ["TPU v5e, overlap flags"], "raw_out": None},
}
# A 16-layer decoder in Llama 3.2 1B's proportions (a vocabulary 64 times
# the width; an FFN 6 times it, so that its two matrices hold what Llama's
# three gated ones do), scaled down to compile in minutes: its embedding and
# unembedding are each about a sixth of the bytes. Its layers
# unrolled and stacked (``scan_layers``); ``python bench_overlap.py decoder``
# writes results/q_decoder.json.
_MESHES = ["data", "data x tensor", "fsdp", "ZeRO-1"]
DECODER = {"k": 4, "batch": 64, "repeats": 1, "model": {
    "vocab": 16384, "seq": 128, "dim": 256, "heads": 4, "ffn": 1536,
    "layers": 16, "pos_broadcast": True},
           "meshes": _MESHES + [m + oc.SCANNED for m in _MESHES],
           "compilers": ["TPU v5e, overlap flags", "H100, no combining",
                         "H100, defaults"],
           "raw_out": "results/raw/q_decoder.json"}

checks = overlap_report.checks
summary_rows = overlap_report.summary_rows
markdown = overlap_report.markdown


def _write_raw(raw, path):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(raw, f, default=str)
  print(f"q. each reduction and running sum: {path}", file=sys.stderr)


def run(cfg):
  """Each compiler setting in its own child; the summary of their figures."""
  out = {"k": cfg["k"], "batch": cfg["batch"], "model": cfg["model"],
         "compilers": {}, "skipped": {}}
  for setting in cfg["compilers"]:
    platform, env, drop = oc.COMPILERS[setting]
    missing = co.missing_gpu() if platform == "gpu" else co.missing_tpu()
    if missing:
      out["skipped"][setting] = missing
      continue
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **env}
    if platform == "gpu":
      env["JAX_PLATFORMS"] = "cpu"
    child = {key: val for key, val in cfg.items() if key != "raw_out"}
    out["compilers"][setting] = harness.in_child(
        __file__, {**child, "compiler": setting}, env=env, drop=drop)
  if cfg.get("raw_out") and out["compilers"]:
    _write_raw(out, cfg["raw_out"])
  return overlap_measure.summary(out)


def _decoder(only=()):
  """Runs :data:`DECODER`'s compiler settings and meshes (those ``only``
  names, if it names any) and merges their summary into
  results/q_decoder.json: a process whose Python has libtpu and one whose
  Python has the CUDA plugin can each run their own."""
  cfg = dict(DECODER)
  for key in ("compilers", "meshes"):
    named = [x for x in cfg[key] if x in only]
    cfg[key] = named or cfg[key]
  named = "_".join(sorted({oc.COMPILERS[s][0] for s in cfg["compilers"]}) + (
      cfg["meshes"] if cfg["meshes"] != DECODER["meshes"] else []))
  cfg["raw_out"] = "results/raw/q_decoder_{}.json".format(
      re.sub(r"\W+", "_", named))
  result = run(cfg)
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.path.join(here, "results", "q_decoder.json")
  os.makedirs(os.path.join(here, "results", "raw"), exist_ok=True)
  with open(os.path.join(here, "results", "raw", "q_decoder.lock"),
            "w") as lock:  # another run may merge at the same time.
    fcntl.flock(lock, fcntl.LOCK_EX)
    result = _merged(path, result)
  print("\n".join(markdown(result)))


def _merged(path, result):
  """``result`` merged into the file at ``path``, and written there."""
  if os.path.exists(path):
    with open(path) as f:
      merged = json.load(f)
    for setting, measured in result["compilers"].items():
      merged["compilers"].setdefault(setting, measured)["meshes"].update(
          measured["meshes"])
    merged["skipped"] = {key: val for key, val in merged["skipped"].items()
                         if key not in merged["compilers"]}
    result = merged
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=str)
  return result


if __name__ == "__main__" and sys.argv[1] == "decoder":
  _decoder(sys.argv[2:])
elif __name__ == "__main__":
  config = json.loads(sys.argv[1])
  if oc.COMPILERS[config["compiler"]][0] == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  print(json.dumps(overlap_measure.in_process(config), default=str))
