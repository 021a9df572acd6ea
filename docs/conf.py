"""Sphinx configuration of the optax_accum documentation site.

Build it from the repository root (``pip install -e ".[docs]"`` first):

  sphinx-build -W --keep-going -b html docs docs/_build/html

The API reference has a page per name of ``optax_accum.__all__``, written into
``docs/api/`` (ignored by git) when the build starts, so that a new public name
gets its page without an edit here. ``docs/api.md`` groups them in summary
tables; a name that no table lists yet is added to a last table, "More", so it
is never left out. ``tests/docs/test_docs.py`` checks both without Sphinx.
"""

import inspect
import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).parent
sys.path.insert(0, str(DOCS.parent))

import optax_accum  # noqa: E402  (after the path insert above)

project = "optax_accum"
author = "the optax_accum authors"
copyright = "the optax_accum authors"
release = optax_accum.__version__

extensions = [
    "myst_parser",
    "sphinx_design",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
# A page links to the repository's files with relative links; myst copies the
# ones that are not pages (scripts, the examples' READMEs) as downloads.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# Google-style docstrings, as optax writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# A NamedTuple's Attributes: one list of its fields, described, without
# autodoc's entry per field (whose annotations expand optax's type aliases).
napoleon_use_ivar = True
napoleon_attr_annotations = False
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
# Signatures show defaults as written (jnp.float32, not <class ...>).
autodoc_preserve_defaults = True
# The summary tables of docs/api.md link to the pages below; they make none.
autosummary_generate = False

html_theme = "sphinx_book_theme"
html_title = "optax_accum"
html_static_path = ["_static"]
html_css_files = ["code_blocks.css"]
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
# MathJax ships with the site, so maths renders offline and from file:// (the
# default loads it from a CDN, and a reader without the network sees raw TeX).
# docs/_static/mathjax/ holds es5/tex-svg-full.js and LICENSE of the npm
# package mathjax 3.2.2 (``npm pack mathjax@3.2.2``), unchanged: one file with
# every TeX extension (none is fetched on demand) and SVG output, whose glyphs
# are inside it (CHTML output needs web fonts, which browsers refuse to load
# from file://; MathJax 4 fetches glyphs outside its base set from a CDN).
# The path is relative to _static/; tests/docs/test_docs.py checks the file.
mathjax_path = "mathjax/tex-svg-full.js"
pygments_style = "default"


# The API reference.

API_DIR = DOCS / "api"
API_INDEX = DOCS / "api.md"
_GENERATED_MARK = "<!-- written by docs/conf.py from optax_accum.__all__ -->"


def api_page(name: str) -> str:
  """The MyST source of the API page of ``optax_accum.<name>``."""
  obj = getattr(optax_accum, name)
  if inspect.isclass(obj):
    directive = "autoclass"
    # A NamedTuple's fields are documented in its docstring's Attributes:
    # autodoc would list them again as "Alias for field number N".
    options = ":exclude-members: count, index\n:no-members:\n"
  else:
    directive = "autofunction"
    options = ""
  return (
      f"{_GENERATED_MARK}\n\n"
      f"# `oa.{name}`\n\n"
      f"```{{eval-rst}}\n"
      f".. currentmodule:: optax_accum\n\n"
      f".. {directive}:: {name}\n"
      + "".join(f"   {line}\n" for line in options.splitlines())
      + "```\n"
  )


def api_pages() -> dict[str, str]:
  """The API pages to write: file name -> MyST source, one per public name."""
  return {f"{name}.md": api_page(name) for name in optax_accum.__all__}


def listed_api_names(text: str) -> list[str]:
  """The names that the summary tables (autosummary blocks) of ``text`` list."""
  names = []
  for block in re.findall(r"```\{autosummary\}\n(.*?)```", text, re.S):
    names += [line.strip() for line in block.splitlines()
              if line.strip() and not line.strip().startswith(":")]
  return names


def unlisted_api_names() -> list[str]:
  """The public names that no summary table of docs/api.md lists."""
  listed = set(listed_api_names(API_INDEX.read_text()))
  return [name for name in optax_accum.__all__ if name not in listed]


def more_table(names) -> str:
  """The "More" section that lists ``names`` (empty for no names)."""
  if not names:
    return ""
  rows = "".join(f"{name}\n" for name in names)
  return f"\n## More\n\n```{{autosummary}}\n:nosignatures:\n\n{rows}```\n"


def _write_api_pages(app) -> None:
  del app
  API_DIR.mkdir(exist_ok=True)
  pages = api_pages()
  for stale in API_DIR.glob("*.md"):
    if stale.name not in pages and _GENERATED_MARK in stale.read_text():
      stale.unlink()
  for file_name, text in pages.items():
    path = API_DIR / file_name
    # Rewriting an unchanged page would make Sphinx rebuild it every time.
    if not path.exists() or path.read_text() != text:
      path.write_text(text)


def _add_more_table(app, docname, source) -> None:
  del app
  if docname == "api":
    source[0] += more_table(unlisted_api_names())


# Pages made of the repository's own Markdown (the README, the examples'
# READMEs): a line ``<!-- include: PATH -->`` (PATH from
# the repository root) stands for that file, its relative links rewritten to
# point from the page. A link to a file that a page includes goes to that page;
# to another file of the repository, to a copy of it (a download); to a folder,
# becomes plain text. ``<!-- include: PATH demote -->`` also moves its headings
# one level down, under the page's own title.

ROOT = DOCS.parent
INCLUDE_LINE = re.compile(r"^<!-- include: (\S+)( demote)? -->$", re.M)
_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")


def included_files() -> dict[pathlib.Path, pathlib.Path]:
  """Repository file -> the page of docs/ that includes it."""
  pages = {}
  for page in sorted(DOCS.glob("**/*.md")):
    if "_build" in page.parts:
      continue
    for path, _ in INCLUDE_LINE.findall(page.read_text()):
      pages[(ROOT / path).resolve()] = page
  return pages


def _rewrite_link(match, source: pathlib.Path, page: pathlib.Path, pages):
  bang, text, target = match.groups()
  if re.match(r"[a-z]+:", target) or target.startswith("#"):
    return match.group(0)
  path, hash_, anchor = target.partition("#")
  resolved = (source.parent / path).resolve()
  if resolved in pages:
    resolved = pages[resolved]
  elif resolved.is_dir():
    return text
  elif not resolved.exists():
    return match.group(0)  # left for Sphinx to report.
  new = pathlib.Path(os.path.relpath(resolved, page.parent)).as_posix()
  if not bang and not resolved.is_relative_to(DOCS):
    new = f"path:{new}"  # a download, even of a Markdown file.
  return f"{bang}[{text}]({new}{hash_}{anchor})"


def rewrite_links(text: str, source: pathlib.Path, page: pathlib.Path,
                  pages) -> str:
  """``text``, read from ``source``, its relative links rewritten for ``page``.

  Code blocks are left alone.
  """
  chunks = re.split(r"(^```.*?^```[^\n]*$)", text, flags=re.M | re.S)
  for i in range(0, len(chunks), 2):  # the even chunks are outside fences.
    chunks[i] = _LINK.sub(
        lambda m: _rewrite_link(m, source, page, pages), chunks[i])
  return "".join(chunks)


def demote_headings(text: str) -> str:
  """``text`` with each heading one level lower (``#`` -> ``##``)."""
  chunks = re.split(r"(^```.*?^```[^\n]*$)", text, flags=re.M | re.S)
  for i in range(0, len(chunks), 2):
    chunks[i] = re.sub(r"^#", "##", chunks[i], flags=re.M)
  return "".join(chunks)


def _rewrite_page(app, docname, source) -> None:
  page = DOCS / f"{docname}.md"
  if not page.exists():
    return
  pages = included_files()

  def include(match):
    app.env.note_dependency(str(ROOT / match.group(1)))
    included = (ROOT / match.group(1)).resolve()
    text = rewrite_links(included.read_text(), included, page, pages)
    return demote_headings(text) if match.group(2) else text

  text = rewrite_links(source[0], page, page, pages)
  source[0] = INCLUDE_LINE.sub(include, text)


def setup(app):
  app.connect("builder-inited", _write_api_pages)
  app.connect("source-read", _add_more_table)
  app.connect("source-read", _rewrite_page)
  return {"parallel_read_safe": True}
