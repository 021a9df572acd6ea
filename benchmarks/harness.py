"""The timing harness shared by every benchmark.

The method (benchmarks/README.md, "Method"): every candidate is compiled ahead
of time and run before timing; repetitions are interleaved, repetition ``r``
running the candidates in a rotated order so that each runs as often first as
last; each call blocks until its results are ready; we report medians and
p25-p75 of wall-clock time and the median of process CPU time. Memory is what
XLA's ``compiled.memory_analysis()`` says the program allocates, read as its
peak (:func:`memory`).
"""

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa
from optax_accum._src.compiled import memory_analysis

MiB = 2**20


class Times(dict):
  """name -> wall-clock seconds per repetition; ``.cpu``: CPU seconds."""

  def __init__(self, names):
    super().__init__({name: [] for name in names})
    self.cpu = {name: [] for name in names}


def interleaved(candidates, reps, warmup=1):
  """Times zero-argument callables, interleaved; returns a :class:`Times`.

  Each callable runs one repetition and blocks until its results are ready.
  Repetition r runs the candidates in order, starting from the r-th one.
  """
  names = list(candidates)
  for name in names:
    for _ in range(warmup):
      candidates[name]()
  times = Times(names)
  for r in range(reps):
    for i in range(len(names)):
      name = names[(r + i) % len(names)]
      cpu, start = time.process_time(), time.perf_counter()
      candidates[name]()
      times[name].append(time.perf_counter() - start)
      times.cpu[name].append(time.process_time() - cpu)
  return times


def update_by_calls(step, params, state, batches):
  """One optimizer update made of one call per micro-batch; its parameters.

  ``params, state = step(params, state, batch)`` for each of ``batches``, in
  order (one batch: an update in one call), the loop of PyTorch DDP's
  ``no_sync`` written for ``jax.jit``; blocks until the parameters are ready
  and returns them.
  """
  for batch in batches:
    params, state = step(params, state, batch)
  return jax.block_until_ready(params)


def time_updates(updates, reps, first=None):
  """Each candidate's first update, then its time per update, interleaved.

  ``updates`` maps each candidate's name to a zero-argument callable that
  runs one update (its calls, one per micro-batch, or one call) and blocks
  until it is done. Each runs once, in order, before anything is timed: what
  ``first(name, out)`` makes of that run's output ``out`` (``out`` itself by
  default) is the candidate's result, to check against its peer. Then
  :func:`interleaved` times the same callables. Returns ``(results, times)``.
  """
  results = {}
  for name, update in updates.items():
    out = update()
    results[name] = out if first is None else first(name, out)
  return results, interleaved(updates, reps)


def summarize(seconds, cpu_seconds=None):
  """Median, p25, p75 and min of wall-clock times (and the CPU median)."""
  q = np.percentile(seconds, [25, 75])
  out = {"median_s": statistics.median(seconds), "p25_s": float(q[0]),
         "p75_s": float(q[1]), "min_s": min(seconds), "reps": len(seconds)}
  if cpu_seconds is not None:
    out["cpu_median_s"] = statistics.median(cpu_seconds)
  return out


def summarize_times(times, per=1):
  """:func:`summarize` of each candidate of a :class:`Times`, divided by per."""
  return {name: summarize([t / per for t in wall],
                          [t / per for t in times.cpu[name]])
          for name, wall in times.items()}


def compiled_calls(compiled, *args):
  """Zero-argument callables that run each compiled function and block."""
  return {name: (lambda c=c: jax.block_until_ready(c(*args)))
          for name, c in compiled.items()}


def tree_bytes(tree):
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def max_abs(tree):
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def max_abs_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b)))


def copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


def memory(compiled):
  """Sizes XLA's memory analysis gives a compiled program, in bytes.

  ``peak_bytes``: the figure to compare programs by,
  ``peak_memory_in_bytes`` (each buffer once, arguments and outputs
  included), read as ``oa.plan_microbatches`` reads it; ``peak_measure`` is
  ``"peak"``, or ``"temp+args"`` where the backend counts no temporaries in
  its peak (XLA:CPU: then temp + arguments + outputs - aliased, an upper
  bound, flagged in the tables). ``temp_bytes``: the scratch allocation,
  which counts output buffers lent to loop temporaries a second time;
  ``argument_bytes``: what the caller passes in.
  """
  m = memory_analysis.device_memory(compiled)
  return {"peak_bytes": m.memory_bytes, "peak_measure": m.measure,
          "argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes,
          "alias_bytes": m.alias_bytes, "temp_bytes": m.temp_bytes}


MEMORY_NOTE = (
    "Memory per device from `memory_analysis()`. **peak**:"
    " `peak_memory_in_bytes`, each buffer once, arguments and outputs"
    " included: the ruler. **temp**: `temp_size_in_bytes`, the program's"
    " scratch allocation; it counts the output buffers XLA lends to loop"
    " temporaries a second time, so temp + arguments + outputs can exceed"
    " the peak. **arguments**: what the caller passes in (parameters,"
    " optimizer state, batch), held for the whole call. A peak marked"
    " (temp+args) is temp + arguments + outputs - aliased, an upper bound:"
    " the backend's peak counts no temporaries (XLA:CPU, jaxlib 0.10.2).")


# A section's pointer to MEMORY_NOTE, which opens the report (report.py).
MEMORY_REF = ("Memory: peak, temp and arguments as the report's opening says"
              " (a peak marked (temp+args) is XLA:CPU's stand-in).")


def peak_label(mem, size):
  """``size(mem['peak_bytes'])``, marked ``(temp+args)`` unless a peak."""
  flag = ("" if mem["peak_measure"] == memory_analysis.PEAK
          else " (temp+args)")
  return size(mem["peak_bytes"]) + flag


def page_faults_per_call(runner, calls):
  """Minor page faults of this process per call (fresh pages touched)."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  runner.steps(calls)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def in_child(script, cfg, env=None, drop=()):
  """Runs ``python script 'cfg as JSON'``; returns the JSON of its last line.

  The child runs in benchmarks/ with this process's environment, less the
  variables named in ``drop``, plus ``env``: for settings that only a new
  process takes (jax's device count, glibc's malloc tunables).
  """
  here = os.path.dirname(os.path.abspath(__file__))
  child_env = {k: v for k, v in os.environ.items() if k not in drop}
  child_env.update(env or {})
  child_env["PYTHONPATH"] = os.pathsep.join(
      [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
  done = subprocess.run(
      [sys.executable, os.path.abspath(script), json.dumps(cfg)],
      capture_output=True, text=True, check=False, cwd=here, env=child_env)
  if done.returncode:
    raise RuntimeError(f"{os.path.basename(script)}'s child failed:\n"
                       f"{done.stderr}")
  return json.loads(done.stdout.splitlines()[-1])


def load_average():
  """The 1, 5 and 15 minute load averages: near the core count when alone."""
  return list(os.getloadavg())


def _cpu_name():
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "unknown"


def _memory_bytes():
  try:
    with open("/proc/meminfo") as f:
      return int(f.readline().split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    return None


def machine_info():
  """The machine, the versions and the load average at the start."""
  import flax  # pylint: disable=import-outside-toplevel
  return {
      "cpu": _cpu_name(), "cores": os.cpu_count(),
      "memory_bytes": _memory_bytes(),
      "platform": platform.platform(), "python": platform.python_version(),
      "jax": jax.__version__, "jaxlib": jax.lib.__version__,
      "optax": optax.__version__, "flax": flax.__version__,
      "optax_accum": getattr(oa, "__version__", "?"),
      "backend": jax.default_backend(),
      "loadavg_start": load_average(),
      "devices": [str(d) for d in jax.devices()],
      "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
  }


class Check(NamedTuple):
  """A benchmark's correctness check: ``value <= limit`` must hold."""
  what: str
  value: float
  limit: float

  @property
  def holds(self):
    return self.value <= self.limit
