"""Opt-in tools off every hot path: the collective counter, the train-step
check and the planner (see the code map in ``_src``)."""
