"""The arithmetic both entry points share: weights, per-leaf rules, aux and
noise-scale sums. Per-device steps go through ``mesh/manual`` (see the code
map in ``_src``)."""
