"""``oa.value_and_grad`` and ``oa.coupled_value_and_grad``: k micro-batches in
one call (see the code map in ``_src``)."""
