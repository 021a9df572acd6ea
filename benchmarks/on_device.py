"""The benchmarks that run on one accelerator, run on the one in hand.

Usage (on a machine with one GPU, jax's default backend the GPU)::

  python benchmarks/on_device.py --out results/h100
  python benchmarks/on_device.py --size toy --out /tmp/t   # a smoke test

Runs benchmarks a (a cycle vs ``optax.MultiSteps``), b (a micro-step vs
the floor), c (value and gradient vs the full batch and
``optax.microbatching``) and d (time and memory vs k) on jax's default
backend, at sizes for one accelerator (``DEVICE_CONFIGS``), and o (the
donated emitting micro-step) compiled for, and read from, that device.
Same method as ``run.py`` (interleaved repetitions, medians, each
benchmark's checks); writes ``PREFIX.{md,json,png}``.
"""

import argparse
import os
import sys

import jax

import run

# Sizes for one accelerator: parameters of 16 x 4096^2 f32 (1 GiB), so that
# a step is more than kernel launches (muon's Newton-Schulz at 8 x 2048^2,
# since MultiSteps runs it k times a cycle); c and d at their full CPU sizes.
DEVICE_CONFIGS = {
    "a": {"k": 8, "inners": {
        "adamw": {"leaves": 16, "size": 4096, "reps": 15},
        "muon": {"leaves": 8, "size": 2048, "reps": 5}}},
    "b": {"leaves": 16, "size": 4096, "reps": 40, "calls_per_rep": 4},
    "o": {"k": 4, "leaves": 8, "size": 4096, "inners": ["adamw", "muon"],
          "compilers": ["local"]},
}
KEYS = ("a", "b", "c", "d", "o")


def _configure(benchmarks, size):
  """Adds the ``"device"`` size to each benchmark's CONFIGS."""
  for bench in benchmarks:
    if size == "device":
      cfg = DEVICE_CONFIGS.get(bench.KEY, bench.CONFIGS["full"])
    else:
      cfg = dict(bench.CONFIGS[size])
      if bench.KEY == "o":
        cfg["compilers"] = ["local"]
    bench.CONFIGS["device"] = cfg


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="device",
                      choices=["device", "full", "quick", "toy"])
  parser.add_argument("--only", default=",".join(KEYS))
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  print(f"[{jax.default_backend()}: {device.device_kind}, jax"
        f" {jax.__version__}]", file=sys.stderr, flush=True)
  benchmarks = run.select(run.load(), args.only)
  _configure(benchmarks, args.size)
  res = run.run(benchmarks, "device")
  res["machine"]["device_kind"] = device.device_kind
  text, paths = run.report.write(res, benchmarks, args.out)
  print(text)
  print(f"wrote {', '.join(paths)}", file=sys.stderr)
  return res


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  sys.exit(1 if run.report.failed_checks(main()) else 0)
