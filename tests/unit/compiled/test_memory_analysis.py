"""``memory_analysis``: a compiled program's memory per device, one ruler.

The peak (``peak_memory_in_bytes``, each buffer once) where the backend
counts temporaries in it; else (XLA:CPU) temp + arguments + outputs -
aliased, flagged. A compiler's refusal for want of memory is told by its
status code, not its text.
"""

import types

import jax
import jax.numpy as jnp

from optax_accum._src.compiled import memory_analysis


def _memory_stats(peak, temp, arguments=100, outputs=10, aliased=0):
  return types.SimpleNamespace(
      peak_memory_in_bytes=peak, temp_size_in_bytes=temp,
      argument_size_in_bytes=arguments, output_size_in_bytes=outputs,
      alias_size_in_bytes=aliased)


def test_memory_is_the_peak_where_the_backend_counts_temporaries_in_it():
  # XLA's TPU and GPU compilers: the peak, each buffer once (below temp +
  # arguments where XLA lends output buffers to loop temporaries).
  counts = memory_analysis._peak_counts_temporaries
  assert counts(_memory_stats(150, 80), "tpu")
  assert counts(_memory_stats(150, 80), "gpu")
  # XLA:CPU (jaxlib 0.10.2): arguments and outputs, no temporaries.
  assert not counts(_memory_stats(118, 80), "cpu")
  assert counts(_memory_stats(110, 0), "cpu")
  # An older jaxlib without the field, or a backend that reports 0.
  assert not counts(types.SimpleNamespace(temp_size_in_bytes=80), "tpu")
  assert not counts(_memory_stats(0, 80), "tpu")


def test_a_program_compiled_here_is_read_as_temp_and_args():
  """XLA:CPU's peak leaves out the temporaries: the fallback, flagged."""
  def loss(x):
    return (jnp.tanh(x @ x) @ jnp.tanh(x.T @ x)).sum()

  compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((64, 64))).compile()
  assert memory_analysis.compiled_platform(compiled) == "cpu"
  memory = memory_analysis.device_memory(compiled)
  assert memory.temp_bytes > 0
  assert memory.measure == memory_analysis.TEMP_AND_ARGS
  assert memory.memory_bytes == (memory.temp_bytes + memory.argument_bytes
                                 + memory.output_bytes - memory.alias_bytes)


def test_no_analysis_reads_as_none():
  compiled = types.SimpleNamespace(memory_analysis=lambda: None)
  assert memory_analysis.device_memory(compiled) is None


class _Exhausted(jax.errors.JaxRuntimeError):
  error_code_string = "RESOURCE_EXHAUSTED"


def test_a_refusal_for_memory_is_read_from_the_status_code():
  assert memory_analysis.refused_for_memory(_Exhausted("out of HBM"))
  # The words alone do not count: an error without the code is another one.
  assert not memory_analysis.refused_for_memory(
      jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of HBM"))
  assert not memory_analysis.refused_for_memory(
      MemoryError("RESOURCE_EXHAUSTED"))
