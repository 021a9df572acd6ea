"""optax_accum: exact gradient accumulation for JAX and optax."""

from optax_accum._src.accumulate.applying import (
    apply_if_updated as apply_if_updated,
)
from optax_accum._src.accumulate.applying import (
    update_and_apply as update_and_apply,
)
from optax_accum._src.accumulate.saved_state import (
    checkpointable_state as checkpointable_state,
)
from optax_accum._src.accumulate.saved_state import (
    restored_state as restored_state,
)
from optax_accum._src.accumulate.state import AccumulateState as AccumulateState
from optax_accum._src.accumulate.state_access import (
    find_accumulate_state as find_accumulate_state,
)
from optax_accum._src.accumulate.state_access import grad_stats as grad_stats
from optax_accum._src.accumulate.state_access import has_updated as has_updated
from optax_accum._src.accumulate.state_access import tokens_seen as tokens_seen
from optax_accum._src.accumulate.state_specs import (
    reduced_state as reduced_state,
)
from optax_accum._src.accumulate.state_specs import (
    state_partition_specs as state_partition_specs,
)
from optax_accum._src.accumulate.transform import accumulate as accumulate
from optax_accum._src.accumulate.transform import (
    AccumulateTransformation as AccumulateTransformation,
)
from optax_accum._src.compiled.hlo import CollectiveCounts as CollectiveCounts
from optax_accum._src.compiled.hlo import count_collectives as count_collectives
from optax_accum._src.compiled.overlap import (
    reduction_overlap as reduction_overlap,
)
from optax_accum._src.compiled.overlap import (
    ReductionOverlap as ReductionOverlap,
)
from optax_accum._src.compiled.self_check import (
    check_train_step as check_train_step,
)
from optax_accum._src.compiled.self_check import (
    TrainStepCheck as TrainStepCheck,
)
from optax_accum._src.mesh.axes import device_local as device_local
from optax_accum._src.mesh.zero import zero_specs as zero_specs
from optax_accum._src.microbatch.coupled import (
    coupled_value_and_grad as coupled_value_and_grad,
)
from optax_accum._src.microbatch.reduced_fallbacks import (
    Report as ShardingReport,
)
from optax_accum._src.microbatch.reduced_fallbacks import (
    sharding_report as sharding_report,
)
from optax_accum._src.microbatch.reducible_layers import add_bias as add_bias
from optax_accum._src.microbatch.reducible_layers import (
    multiply_scale as multiply_scale,
)
from optax_accum._src.microbatch.reducible_layers import (
    reducible_layers as reducible_layers,
)
from optax_accum._src.microbatch.scanned_layers import (
    scan_layers as scan_layers,
)
from optax_accum._src.microbatch.value_and_grad import (
    value_and_grad as value_and_grad,
)
from optax_accum._src.planner.planner import Plan as Plan
from optax_accum._src.planner.planner import (
    plan_microbatches as plan_microbatches,
)
from optax_accum._src.proving.k_invariance import (
    check_k_invariance as check_k_invariance,
)
from optax_accum._src.proving.k_invariance import (
    KInvarianceReport as KInvarianceReport,
)
from optax_accum._src.proving.replicas import check_replicas as check_replicas
from optax_accum._src.proving.replicas import ReplicaReport as ReplicaReport
from optax_accum._src.rules.noise_scale import GradStats as GradStats

__version__ = "0.1.0"

__all__ = (
    "AccumulateState",
    "AccumulateTransformation",
    "AccumulatingOptimizer",
    "CollectiveCounts",
    "GradStats",
    "KInvarianceReport",
    "Plan",
    "ReductionOverlap",
    "ReplicaReport",
    "ShardingReport",
    "TrainStepCheck",
    "accumulate",
    "add_bias",
    "apply_if_updated",
    "check_k_invariance",
    "check_replicas",
    "check_train_step",
    "checkpointable_state",
    "count_collectives",
    "coupled_value_and_grad",
    "device_local",
    "find_accumulate_state",
    "grad_stats",
    "has_updated",
    "multiply_scale",
    "plan_microbatches",
    "reduced_state",
    "reducible_layers",
    "reduction_overlap",
    "restored_state",
    "scan_layers",
    "sharding_report",
    "state_partition_specs",
    "tokens_seen",
    "update_and_apply",
    "value_and_grad",
    "zero_specs",
)


def __getattr__(name):
  """``AccumulatingOptimizer`` (an ``nnx.Optimizer``), imported on first use:
  optax_accum needs flax for it only."""
  if name == "AccumulatingOptimizer":
    from optax_accum._src import nnx_optimizer
    return nnx_optimizer.AccumulatingOptimizer
  raise AttributeError(f"module 'optax_accum' has no attribute {name!r}")
