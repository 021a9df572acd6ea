"""Runs the benchmarks against their peers, each in the same process.

Usage::

  python benchmarks/run.py                # full run: about 5 minutes, 2 cores
  python benchmarks/run.py --quick        # smaller sizes, about a minute
  python benchmarks/run.py --only a,c     # a subset, by key

A full run writes ``results/latest.{md,json,png}``, the figures that the
READMEs link; any other run writes ``results/quick.*`` (git-ignored), so that
it never replaces them. ``--out PREFIX`` writes ``PREFIX.{md,json,png}``.
The method is in benchmarks/README.md and harness.py.
"""

import argparse
import importlib
import os
import sys
import time

import harness
import report

_HERE = os.path.dirname(os.path.abspath(__file__))
# The repository root, for the models that the tests share (the ``zoo``
# package): ``python benchmarks/run.py`` puts only benchmarks/ on sys.path.
# The benchmarks are imported by ``load``, after this.
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
  sys.path.insert(1, _ROOT)

# The benchmarks, in the order they run and are reported. To add one, write
# benchmarks/bench_<name>.py (see "Adding a benchmark" in README.md) and add
# its line here.
BENCHMARKS = (
    "bench_cycle",           # a. one accumulation cycle vs optax.MultiSteps
    "bench_microstep",       # b. a non-emitting micro-step vs the floor
    "bench_value_and_grad",  # c. value and gradient of one batch
    "bench_sweep",           # d. time and temporary memory vs k
    "bench_memory",          # e. accumulator memory
    "bench_coupled",         # f. a loss coupling the batch vs the full batch
    "bench_noise_scale",     # g. with_stats=True vs without
    "bench_no_sync",         # h. one jit call per micro-batch: deferred sync
    "bench_plan_8b",         # i. planning k for an 8B model, never allocated
    "bench_typed",           # j. the typed form on a cookbook-style decoder
    "bench_compiled",        # k. compiled for TPU v5e chips (needs libtpu)
    "bench_deferred",        # l. the deferred loop without axis_name, d x t
    "bench_nnx_deferred",    # m. the deferred loop in an nnx.Optimizer
    "bench_zero",            # n. ZeRO-1 / ZeRO-2 vs data parallel and FSDP
    "bench_emit",            # o. the emitting micro-step, compiled
    "bench_first_step",      # p. trace + lower + compile of a micro-step
    "bench_overlap",         # q. the one reduction hidden
)
RESULTS_DIR = os.path.join(_HERE, "results")


def load(names=BENCHMARKS):
  return [importlib.import_module(name) for name in names]


def select(benchmarks, only):
  """The benchmarks whose keys ``only`` lists (comma-separated), or all."""
  if not only:
    return benchmarks
  by_key = {b.KEY: b for b in benchmarks}
  keys = [k.strip() for k in only.split(",") if k.strip()]
  unknown = [k for k in keys if k not in by_key]
  if unknown:
    raise ValueError(f"--only={only!r} names unknown benchmarks {unknown}; "
                     f"the benchmarks are {', '.join(by_key)}.")
  return [by_key[k] for k in keys]


def default_prefix(size):
  """Only a full run replaces the committed ``results/latest.*``."""
  return os.path.join(RESULTS_DIR, "latest" if size == "full" else "quick")


def run(benchmarks, size):
  """Runs each benchmark at its ``size`` configuration; returns the results."""
  res = {"size": size, "quick": size != "full", "config": {},
         "machine": harness.machine_info()}
  print(f"[load average at start: {res['machine']['loadavg_start']}]",
        file=sys.stderr, flush=True)
  start = time.perf_counter()
  for bench in benchmarks:
    t0 = time.perf_counter()
    res["config"][bench.KEY] = bench.CONFIGS[size]
    res[bench.KEY] = bench.run(bench.CONFIGS[size])
    print(f"[{bench.KEY}. {bench.TITLE}: {time.perf_counter() - t0:.0f} s]",
          file=sys.stderr, flush=True)
  res["wall_s"] = time.perf_counter() - start
  res["machine"]["loadavg_end"] = harness.load_average()
  print(f"[load average at end: {res['machine']['loadavg_end']}]",
        file=sys.stderr, flush=True)
  res["summary"] = [list(row) for bench in benchmarks
                    for row in bench.summary_rows(res[bench.KEY])]
  res["checks"] = {bench.KEY: [dict(c._asdict(), holds=c.holds)
                               for c in bench.checks(res[bench.KEY])]
                   for bench in benchmarks}
  return res


def main(argv=None):
  """Runs, writes the report, and returns the results (exit 1 if wrong)."""
  parser = argparse.ArgumentParser(
      description="Benchmarks optax_accum against its peers.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="small sizes and few repetitions (about a minute); "
                      "writes results/quick.* unless --out is given")
  parser.add_argument("--only", default="",
                      help="comma-separated keys of the benchmarks to run "
                      "(a,b,c,...; see the registry); all when empty")
  parser.add_argument("--out", default=None,
                      help="output path prefix for .md, .json and .png "
                      "(default: results/latest, or results/quick with "
                      "--quick)")
  args = parser.parse_args(argv)
  size = "quick" if args.quick else "full"
  benchmarks = select(load(), args.only)
  res = run(benchmarks, size)
  text, paths = report.write(res, benchmarks, args.out or default_prefix(size))
  print(text)
  print(f"wrote {', '.join(paths)} in {res['wall_s']:.0f} s", file=sys.stderr)
  failed = report.failed_checks(res)
  if failed:
    print("correctness checks failed: "
          + "; ".join(c["what"] for c in failed), file=sys.stderr)
  return res


if __name__ == "__main__":
  sys.exit(1 if report.failed_checks(main()) else 0)
