"""``layout``: one interface for every form, one implementation per form."""

import inspect
from typing import Protocol

import pytest

from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import manual_layout
from optax_accum._src.microbatch import typed_layout

IMPLEMENTATIONS = (layout.SingleLayout, manual_layout.ManualLayout,
                   typed_layout.TypedLayout)


def _members(protocol: type[Protocol]) -> set[str]:
  names = {n for n, _ in inspect.getmembers(protocol, inspect.isfunction)
           if not n.startswith("_")}
  return names | set(protocol.__annotations__)


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_form_implements_the_whole_protocol(cls):
  """The stages call only the Protocol's methods: each layout has them all,
  with the Protocol's parameters."""
  for name in _members(layout.Layout):
    assert hasattr(cls, name), (cls.__name__, name)
    want = getattr(layout.Layout, name, None)
    if inspect.isfunction(want):
      got = inspect.signature(getattr(cls, name)).parameters
      assert list(got) == list(inspect.signature(want).parameters), (
          cls.__name__, name)


def test_the_stages_never_ask_which_form_they_are_in():
  """Below the runner, nothing names a layout class or a form."""
  from optax_accum._src.microbatch import coupled  # pylint: disable=g-import-not-at-top
  from optax_accum._src.microbatch import loop  # pylint: disable=g-import-not-at-top
  from optax_accum._src.microbatch import trip_count  # pylint: disable=g-import-not-at-top
  for module in (loop, coupled, trip_count):
    source = inspect.getsource(module)
    for word in ("ManualLayout", "TypedLayout", "SingleLayout",
                 "manual_layout", "typed_layout", "forms.", "lay is None",
                 "isinstance(lay"):
      assert word not in source, (module.__name__, word)
