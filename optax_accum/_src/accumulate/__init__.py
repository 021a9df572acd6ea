"""``oa.accumulate``: one micro-batch per call, the inner optimizer once per
update (see the code map in ``_src``)."""
