"""The documentation site's sources: an API page per public name, and code
blocks that run.

Sphinx is not needed here (the minimum-versions CI run lacks it): the checks
read docs/conf.py's page list and the Markdown sources, not the built HTML.
``.ci/run`` builds the site itself, warnings as errors.
"""

import importlib.util
import inspect
import re

import pytest

import helpers
import optax_accum as oa

DOCS = helpers.ROOT / "docs"


def _load_conf():
  spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
  conf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conf)
  return conf


conf = _load_conf()

# Markdown the site shows whose ```python blocks another test runs, with
# checks of what they print: that test, which must name the file.
RUN_ELSEWHERE = {
    "README.md": "tests/docs/test_examples.py",
    "docs/distributed.md": "tests/forms/test_distributed.py",
    "docs/equinox.md": "tests/integration/test_equinox.py",
    "docs/migrating.md": "tests/docs/test_migrating.py",
    "docs/noise_scale.md": "tests/unit/rules/test_noise_scale.py",
}


def _site_markdown() -> list[str]:
  """Every Markdown file of the site: its pages and the files they include."""
  pages = [p for p in DOCS.glob("**/*.md")
           if not {"_build", "api"} & set(p.relative_to(DOCS).parts)]
  files = {p.relative_to(helpers.ROOT).as_posix() for p in pages}
  files |= {p.relative_to(helpers.ROOT).as_posix()
            for p in conf.included_files()}
  return sorted(files)


def test_every_public_name_has_an_api_page():
  pages = conf.api_pages()
  assert sorted(pages) == sorted(f"{name}.md" for name in oa.__all__)
  for name in oa.__all__:
    assert re.search(rf"^\.\. auto(function|class):: {name}$",
                     pages[f"{name}.md"], re.M), name


def test_the_api_index_lists_only_public_names():
  listed = conf.listed_api_names(conf.API_INDEX.read_text())
  assert listed, "no autosummary table in docs/api.md"
  assert len(listed) == len(set(listed)), listed
  assert not set(listed) - set(oa.__all__), set(listed) - set(oa.__all__)
  # A name no table lists yet goes into the "More" table.
  more = conf.more_table(conf.unlisted_api_names())
  assert sorted(listed + conf.listed_api_names(more)) == sorted(oa.__all__)


@pytest.mark.parametrize("name", oa.__all__)
def test_every_api_page_has_a_docstring_that_documents_it(name):
  """A page is its docstring: a summary, and a class's fields."""
  obj = getattr(oa, name)
  doc = inspect.getdoc(obj)
  assert doc and doc.splitlines()[0].strip(), f"{name} has no docstring"
  if inspect.isclass(obj) and hasattr(obj, "_fields"):
    # autodoc shows a NamedTuple's fields from its Attributes: section only.
    attributes = doc.partition("\nAttributes:\n")[2]
    missing = [f for f in obj._fields
               if not re.search(rf"^  {f}:", attributes, re.M)]
    assert not missing, f"{name}'s docstring lacks Attributes: {missing}"


def test_included_files_exist():
  for page in DOCS.glob("**/*.md"):
    for path, _ in conf.INCLUDE_LINE.findall(page.read_text()):
      assert (helpers.ROOT / path).is_file(), (page, path)


def _static_file(path: str):
  """The file of docs/ that the site serves as ``_static/<path>``, or None."""
  for folder in conf.html_static_path:
    if (DOCS / folder / path).is_file():
      return DOCS / folder / path
  return None


def test_mathjax_ships_with_the_site():
  """Maths renders offline: MathJax is a file of the site, not a CDN's.

  Loaded from a CDN, a reader without the network sees raw TeX. The bundle is
  one with SVG output (CHTML output needs web fonts, which browsers refuse to
  load from file://), with its licence beside it.
  """
  assert not re.match(r"([a-z]+:)?//", conf.mathjax_path), conf.mathjax_path
  bundle = _static_file(conf.mathjax_path)
  assert bundle, f"{conf.mathjax_path} is in no folder of html_static_path"
  assert "svg" in bundle.name, bundle
  assert (bundle.parent / "LICENSE").is_file()


def test_css_files_ship_with_the_site():
  for path in conf.html_css_files:
    assert _static_file(path), f"{path} is in no folder of html_static_path"


@pytest.mark.parametrize(
    "readme", sorted(p.relative_to(helpers.ROOT).as_posix()
                     for p in (helpers.ROOT / "examples").glob("*/README.md")))
def test_every_example_folder_has_a_gallery_page(readme):
  """Not a download of its README: a page of docs/examples/ includes it."""
  page = conf.included_files().get((helpers.ROOT / readme).resolve())
  assert page and page.parent == DOCS / "examples", (readme, page)


# Lines that a page's blocks print, in order, as their comments say.
PRINTED = {
    # NNX (a micro-step, then the update), oa.AccumulatingOptimizer (one
    # update, one step), then the checkpoint restored mid-cycle (micro_step
    # 1), and a sharded one, restored under the mesh with its sharding.
    "docs/flax.md": ["1 0 True", "4", "1 1", "1", "P(None, 'model') 1"],
    "docs/per_leaf_rules.md": ["23.0", "11.0"],
    # The fallback leaves of nnx.Linear and nnx.LayerNorm, then none.
    "docs/reduced_leaves.md": ["4 4", "()"],
    # adamw's moments in shards: the one-call step's, the per-micro-step
    # state's (the parameters replicated), nnx.Optimizer's and TrainState's;
    # a mid-window checkpoint resumed bit for bit; then ZeRO-2's
    # reduce-scatters per call, as oa.check_train_step reads.
    "docs/zero.md": ["(2, 32)", "float32[16@data,32] float32[16,32]",
                     "float32[16@data,8]", "float32[16@data,32]", "True",
                     "{'reduce-scatter': 2}"],
    # The README's step passes; a per-example loss weighted by tokens fails
    # with its hint, by examples passes; replicas equal, then drifted.
    "docs/proving.md": [
        "True", "False True",
        "the micro-batches are weighted by something other than what the"
        " loss divides by", "True", "False"],
    # The plateau logic's best value, the window's mean loss.
    "docs/composing.md": [],
}


# The pages whose blocks take longest (3 to 30 s each on 2 CPU cores) run in
# the slow tier (`python -m pytest -q -m slow`), the others in every run.
SLOW_PAGES = frozenset({
    "docs/composing.md", "docs/coupled_losses.md", "docs/flax.md",
    "docs/planner.md", "docs/proving.md", "docs/reduced_leaves.md",
    "docs/semantics.md", "docs/zero.md"})


def test_the_slow_pages_are_pages_of_the_site():
  assert SLOW_PAGES <= set(_site_markdown()), SLOW_PAGES - set(_site_markdown())


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.slow) if path in SLOW_PAGES else path
    for path in _site_markdown()])
def test_site_python_blocks_run(path, capsys):
  """Every ```python block of the site runs, in order, in one namespace.

  Blocks that cannot run alone (an excerpt of an example) are fenced ```py.
  """
  if path in RUN_ELSEWHERE:
    test_file = (helpers.ROOT / RUN_ELSEWHERE[path]).read_text()
    assert f'run_markdown_snippets("{path}"' in test_file, path
    return
  text = (helpers.ROOT / path).read_text()
  if "```python\n" not in text:
    return
  namespace = helpers.run_markdown_snippets(path)
  printed = capsys.readouterr().out.splitlines()
  expected = PRINTED.get(path, [])
  assert any(printed[i : i + len(expected)] == expected
             for i in range(len(printed) + 1)), printed
  if path == "docs/flax.md":
    assert int(namespace["state"].step) == 3  # the linen TrainState recipe


def test_distributed_tells_the_forms_in_at_most_300_lines():
  """The forms are told once: the support matrix lives on its own page."""
  lines = (DOCS / "distributed.md").read_text().splitlines()
  assert len(lines) <= 300, len(lines)


def test_readme_stays_within_220_lines():
  lines = (helpers.ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 220, len(lines)
