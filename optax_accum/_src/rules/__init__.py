"""The arithmetic both entry points share: weights, per-leaf rules, aux and
noise-scale sums. No sharding inside (see the code map in ``_src``)."""
