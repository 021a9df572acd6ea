"""The benchmarks, each at toy size: they run, report finite figures and agree.

One ``run.py --quick`` runs every benchmark of the registry with its ``toy``
configuration in place of its ``quick`` one, writing into a temporary results
folder that holds stand-ins for the committed ``latest.*``.
"""

import hashlib
import importlib
import math
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"
LATEST = [BENCHMARKS / "results" / f"latest.{ext}"
          for ext in ("md", "json", "png")]
# Every benchmark module, found by name: a new one is smoke-tested unasked.
BENCH_MODULES = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py"))

pytestmark = pytest.mark.slow


def _digests(paths):
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
          for p in paths if p.exists()}


def _import_benchmarks():
  """run.py and the registry's modules, imported as ``run.py`` finds them.

  The benchmarks import one another by bare name (``import harness``), so
  their folder goes first on ``sys.path`` while they are imported and run;
  their names are then taken out of ``sys.modules`` again, so that they never
  meet an example's module of the same name (``report``).
  """
  siblings = [p.stem for p in BENCHMARKS.glob("*.py")]
  for name in siblings:
    sys.modules.pop(name, None)
  sys.path.insert(0, str(BENCHMARKS))
  run = importlib.import_module("run")
  return run, {name: importlib.import_module(name) for name in siblings}


def _forget_benchmarks(modules):
  sys.path.remove(str(BENCHMARKS))
  for name in modules:
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """Runs ``run.py --quick`` at toy sizes; returns results, folder, modules."""
  results_dir = tmp_path_factory.mktemp("results")
  stand_ins = {}
  for path in LATEST:
    stand_ins[path.name] = f"committed {path.name}".encode()
    (results_dir / path.name).write_bytes(stand_ins[path.name])
  committed = _digests(LATEST)
  run, modules = _import_benchmarks()
  try:
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(run, "RESULTS_DIR", str(results_dir))
      for bench in run.load():
        mp.setitem(bench.CONFIGS, "quick", bench.CONFIGS["toy"])
      res = run.main(["--quick"])
  finally:
    _forget_benchmarks(modules)
  assert _digests(LATEST) == committed
  return res, results_dir, stand_ins, modules


def _numbers(tree, path=""):
  if isinstance(tree, dict):
    for key, val in tree.items():
      yield from _numbers(val, f"{path}/{key}")
  elif isinstance(tree, (list, tuple)):
    for i, val in enumerate(tree):
      yield from _numbers(val, f"{path}[{i}]")
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield path, tree


def test_quick_run_writes_quick_and_leaves_latest_untouched(quick_run):
  res, results_dir, stand_ins, _ = quick_run
  for name, content in stand_ins.items():
    assert (results_dir / name).read_bytes() == content, name
  for ext in ("md", "json", "png"):
    assert (results_dir / f"quick.{ext}").stat().st_size > 0, ext
  assert (results_dir / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  md = (results_dir / "quick.md").read_text()
  assert md.startswith("# optax_accum benchmarks (quick run)")
  assert res["summary"]
  for row in res["summary"]:
    assert f"| {row[0]} |" in md, row
  for key in res["config"]:
    assert f"\n## {key}. " in md, key


def _skipped(tree):
  """Why a result's parts were skipped: the compilers an extra would bring
  (``missing_tpu``'s "pip install 'optax-accum[tpu]'"), as a benchmark
  records them under "skipped"."""
  if isinstance(tree, dict):
    for key, val in tree.items():
      if key == "skipped":
        yield from [val] if isinstance(val, str) else val.values()
      else:
        yield from _skipped(val)


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_benchmark_at_toy_size(quick_run, name):
  res, _, _, modules = quick_run
  bench = modules[name]
  result = res[bench.KEY]
  assert res["config"][bench.KEY] == bench.CONFIGS["toy"]
  numbers = list(_numbers(result))
  assert numbers
  assert all(math.isfinite(x) for _, x in numbers), [
      p for p, x in numbers if not math.isfinite(x)]
  rows = bench.summary_rows(result)
  assert rows and all(row.what.startswith(f"{bench.KEY}.") for row in rows)
  for row in rows:
    assert "nan" not in row.ours + row.peer + row.ratio, row
  checks = bench.checks(result)
  missing = sorted(set(_skipped(result)))
  if not checks and missing:  # its checks read TPU or GPU figures only.
    pytest.skip("; ".join(missing))
  assert checks, "every benchmark checks its result against a peer"
  for check in checks:
    assert math.isfinite(check.value) and check.holds, check
  assert bench.markdown(result)
  assert set(bench.CONFIGS) == {"full", "quick", "toy"}
  assert set(bench.CONFIGS["full"]) == set(bench.CONFIGS["quick"]) == set(
      bench.CONFIGS["toy"])


def _memory_figures(tree):
  """Every dict of compiled sizes (``harness.memory``) in a result."""
  if isinstance(tree, dict):
    if isinstance(tree.get("temp_bytes"), int):
      yield tree
    for val in tree.values():
      yield from _memory_figures(val)
  elif isinstance(tree, (list, tuple)):
    for val in tree:
      yield from _memory_figures(val)


def test_compiled_memory_is_reported_with_its_peak(quick_run):
  """Issue 38: no temp without the peak beside it, nor a fallback unsaid."""
  res, _, _, modules = quick_run
  found = 0
  for name in modules["run"].BENCHMARKS:
    bench = modules[name]
    for m in _memory_figures(res[bench.KEY]):
      found += 1
      assert m["peak_measure"] in ("peak", "temp+args"), (bench.KEY, m)
      if m["peak_measure"] == "temp+args":
        assert m["peak_bytes"] == (m["temp_bytes"] + m["argument_bytes"]
                                   + m["output_bytes"] - m["alias_bytes"])
  assert found


def test_registry_lists_every_benchmark_module_once(quick_run):
  res, _, _, modules = quick_run
  run = modules["run"]
  assert sorted(run.BENCHMARKS) == BENCH_MODULES
  keys = [modules[name].KEY for name in run.BENCHMARKS]
  assert len(set(keys)) == len(keys)
  assert list(res["checks"]) == keys


def test_failed_check_is_reported(quick_run):
  res, _, _, modules = quick_run
  report = modules["report"]
  assert not report.failed_checks(res)
  broken = dict(res, checks={"a": [dict(res["checks"]["a"][0], holds=False)]})
  assert report.failed_checks(broken) == broken["checks"]["a"]
  md = report.markdown(broken, [])
  assert "Correctness checks that failed" in md
  assert broken["checks"]["a"][0]["what"] in md


def test_only_names_the_unknown_benchmark(quick_run):
  _, _, _, modules = quick_run
  run = modules["run"]
  benches = [modules[name] for name in run.BENCHMARKS]
  assert [b.KEY for b in run.select(benches, "c, a")] == ["c", "a"]
  with pytest.raises(ValueError, match="'z'"):
    run.select(benches, "a,z")
  assert run.default_prefix("full").endswith("latest")
  assert not run.default_prefix("quick").endswith("latest")


def test_on_device_reads_the_emit_step_from_the_device_in_hand(tmp_path):
  """``on_device.py`` (run on a real H100 for ``results/h100.md``): o
  compiled for jax's default device, read in this process, its checks run,
  and the registry's own configurations left as they were."""
  run, modules = _import_benchmarks()
  try:
    emit = modules["bench_emit"]
    toy = dict(emit.CONFIGS["toy"])
    res = modules["on_device"].main(
        ["--size", "toy", "--only", "o", "--out", str(tmp_path / "d")])
  finally:
    _forget_benchmarks(modules)
  local = res["o"]["compilers"]["local"]
  assert local["device_kind"] == res["machine"]["device_kind"]
  peaks = {n: m["peak_bytes"] for n, m in local["inners"]["adamw"].items()}
  assert set(peaks) == set(emit.CANDIDATES)
  assert peaks[emit.FLOOR] < min(peaks[n] for n in emit.CANDIDATES[:4])
  assert not run.report.failed_checks(res)
  assert emit.CONFIGS["toy"] == toy
  assert (tmp_path / "d.md").read_text().count("| local (") == 1
