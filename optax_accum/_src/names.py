"""The words the library writes and its readers look for, declared once.

The named scopes (:func:`jax.named_scope`) that the micro-batch loop and
``accumulate``'s update put in a program reach its compiled text as
``op_name`` metadata; the readers of compiled programs
(``oa.count_collectives``, ``oa.check_train_step``,
``oa.reduction_overlap``) find the loop, the emitting branch and the
branches by them. ``gradient_sync`` and ``gather_params`` take the values
below, which ``check_train_step`` reads too.
"""

# run_if's loop (conditional_loops): it runs once or not at all, so what runs
# in it counts as in a branch, not once per iteration of a loop.
AT_MOST_ONCE_SCOPE = "optax_accum_at_most_once"
# The counting before the micro-batch loop (microbatch/borrowing): its sum
# over the devices counts with the scalars.
TOKEN_COUNTS_SCOPE = "optax_accum_token_counts"
# The micro-batch loop (microbatch/loop).
LOOP_SCOPE = "optax_accum_microbatch_loop"
# The last micro-batch where it runs after the loop (microbatch/trip_count):
# one more trip.
PEELED_SCOPE = "optax_accum_last_microbatch"
# accumulate's emitting branch (accumulate/emit).
EMIT_SCOPE = "optax_accum_emit"

# gradient_sync's and gather_params' values.
ONCE = "once"
EVERY_MICROBATCH = "every_microbatch"
DEFERRED = "deferred"  # gradient_sync only.
CHOICES = (ONCE, EVERY_MICROBATCH)
