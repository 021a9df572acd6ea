"""Readers of compiled programs: what a compiled step does, from its text.

``oa.count_collectives`` (``hlo``), ``oa.check_train_step`` (``self_check``
on ``step_reading``), ``oa.reduction_overlap`` (``overlap`` on
``reduction_spans``, ``model_loops`` and ``matmul_flops``) and the memory
the planner weighs (``memory_analysis``), all on one parser, ``hlo_text``,
whose public names are this folder's inside: no module here uses
another's private names.

What this folder guarantees: it reads compiled programs and runs nothing
of the library; it imports nothing from ``microbatch/`` or ``accumulate/``.
The named scopes it looks for, and ``gradient_sync``'s values, come from
``names``, where the code that writes them takes them too.
"""
