"""A compiled program's memory per device, as XLA's memory analysis gives it.

XLA knows, once a program is compiled and before it runs, how much memory
each device needs: ``compiled.memory_analysis()``. :func:`device_memory`
reads it as the planner (:mod:`planner`), the benchmarks and the compiled
tests compare programs by: the peak, each buffer once, where the backend
counts temporaries in it; else temp + arguments + outputs - aliased, flagged.
:func:`refused_for_memory` tells a compiler's refusal for want of memory.
"""

from typing import Any, NamedTuple

import jax

# How a program's memory per device was read: its peak, or (a backend that
# counts no temporaries in its peak) temp + arguments + outputs - aliased.
PEAK, TEMP_AND_ARGS = "peak", "temp+args"


class DeviceMemory(NamedTuple):
  """A compiled program's memory per device, from XLA's buffer assignment.

  ``peak_memory_in_bytes`` counts each buffer once, arguments and outputs
  included: the ruler. ``temp_size_in_bytes`` is the program's scratch
  allocation; it counts again the output buffers that XLA lends to loop
  temporaries (on TPU, hundreds of MiB in a micro-batch loop), so it is no
  ruler between programs. ``argument_size_in_bytes``: what the caller passes
  (parameters, optimizer state, batch), held for the whole call.
  """

  memory_bytes: int  # the peak, or temp + args + outputs - aliased.
  measure: str  # PEAK, or TEMP_AND_ARGS where the backend gives no peak.
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int


def compiled_platform(compiled: Any) -> str:
  """The platform a program was compiled for (compile-only devices too)."""
  for sharding in jax.tree.leaves((compiled.input_shardings,
                                   compiled.output_shardings)):
    devices = getattr(sharding, "device_set", None)
    if devices:
      return next(iter(devices)).platform
  return jax.default_backend()


def _peak_counts_temporaries(memory: Any, platform: str) -> bool:
  """Whether ``memory.peak_memory_in_bytes`` is the program's peak.

  XLA's TPU and GPU compilers compute it from the buffer assignment, every
  buffer counted once. XLA:CPU's (jaxlib 0.10.2) is the arguments and
  outputs and a few bytes, leaving out the temporaries: below arguments +
  temp, which a program holds together at its temporaries' peak. Older
  jaxlibs lack the field. Remove the CPU case when XLA:CPU computes its peak
  from the buffer assignment too.
  """
  peak = getattr(memory, "peak_memory_in_bytes", None)
  if not peak:
    return False
  return not (platform == "cpu" and peak < memory.argument_size_in_bytes
              + memory.temp_size_in_bytes)


def device_memory(compiled: Any) -> DeviceMemory | None:
  """``compiled``'s memory per device; None if its backend reports none.

  The peak (``memory_analysis().peak_memory_in_bytes``), or where the
  backend does not count temporaries in it, temp + arguments + outputs -
  aliased, an upper bound (``measure`` says which).
  """
  memory = compiled.memory_analysis()
  if memory is None:
    return None
  parts = (int(memory.temp_size_in_bytes), int(memory.argument_size_in_bytes),
           int(memory.output_size_in_bytes), int(memory.alias_size_in_bytes))
  if _peak_counts_temporaries(memory, compiled_platform(compiled)):
    return DeviceMemory(int(memory.peak_memory_in_bytes), PEAK, *parts)
  temp, arguments, outputs, aliased = parts
  return DeviceMemory(temp + arguments + outputs - aliased, TEMP_AND_ARGS,
                      *parts)


def refused_for_memory(error: Exception) -> bool:
  """Whether the compiler refused a program for want of device memory.

  XLA's TPU compiler refuses a program whose buffers exceed the chip's HBM
  (``RESOURCE_EXHAUSTED: ... HLO temporaries (33.81G) exceeds available HBM
  (15.75G)``). Read from the error's status code, which jaxlib >= 0.10 gives
  as ``error_code_string``; with older jaxlibs the error is not read (it
  propagates, with a note). Remove when jaxlib >= 0.10 is the minimum
  (``pyproject.toml``): :func:`planner._measure` then tests
  ``e.error_code_string == "RESOURCE_EXHAUSTED"`` itself.
  """
  return (isinstance(error, jax.errors.JaxRuntimeError)
          and getattr(error, "error_code_string", None)
          == "RESOURCE_EXHAUSTED")
