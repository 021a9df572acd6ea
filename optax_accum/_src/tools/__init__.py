"""Opt-in tools off every hot path: the collective counter, the planner and
the reducible layers (see the code map in ``_src``)."""
