"""One leaf of two train states compared: the difference and its allowance.

A floating leaf of the state after ``k`` micro-batches, ``x_k``, is compared
with the same leaf after the reference split, ``x_ref``, both from ``x_0``:

  ``||x_k - x_ref|| <= rtol * ||x_ref - x_0|| + 4 * eps * ||x_ref||``

(Euclidean norms over the leaf). The first term allows the update to differ
in float32 rounding: summing the gradient in another order changes it by a
few ulps of its terms, which the optimizer's arithmetic (a square root, a
division, Newton-Schulz) can amplify; the default ``rtol`` is
``sqrt(float32 eps)``, about 3.5e-4, half of float32's digits. A mistake
changes the update at the percent level. The second term is the rounding of
the leaf's own values (``eps`` of its dtype): a bfloat16 parameter whose
update rounds to a neighbouring value. A leaf the reference left unchanged
must then come out (nearly) unchanged too.

Integer and boolean leaves (counters, flags) must be equal. Everything is
reduced on the devices (one scalar per statistic), so a sharded state is
never gathered to the host.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

RTOL = float(np.sqrt(np.finfo(np.float32).eps))


class LeafDiff(NamedTuple):
  """One leaf of the state after ``num_microbatches``, beside the reference.

  Attributes:
    path: the leaf's path (``jax.tree_util.keystr``).
    num_microbatches: the split it was computed with.
    max_abs: the largest elementwise difference from the reference.
    error: ``||x_k - x_ref||``.
    allowed: the allowance above (0 for integer and boolean leaves).
    update: ``||x_ref - x_0||``, the reference's change of the leaf.
    scale: ``<u_k, u_ref> / <u_ref, u_ref>`` for the changes ``u`` from
      ``x_0``: how many times the reference's update this one is (NaN where
      the reference made none); for integer leaves, the ratio of the
      changes.
    clean_scale: whether ``u_k`` is ``scale * u_ref`` to 1%.
    nonfinite: the leaf holds NaN or infinity where ``x_0`` held none.
  """

  path: str
  num_microbatches: int
  max_abs: float
  error: float
  allowed: float
  update: float
  scale: float
  clean_scale: bool
  nonfinite: bool

  @property
  def ok(self) -> bool:
    return not self.nonfinite and self.error <= self.allowed

  @property
  def excess(self) -> float:
    """``error / allowed`` (inf where nothing is allowed and it differs)."""
    if self.error == 0:
      return 0.0
    return self.error / self.allowed if self.allowed > 0 else float("inf")


def _norm(x: jax.Array) -> jax.Array:
  """The Euclidean norm, scaled so that float32 squares cannot overflow."""
  top = jnp.max(jnp.abs(x), initial=0.0)
  safe = jnp.where(top > 0, top, 1.0)
  return top * jnp.sqrt(jnp.sum(jnp.square(x / safe)))


@jax.jit
def _float_stats(x0: jax.Array, ref: jax.Array, res: jax.Array) -> dict:
  x0, ref, res = (v.astype(jnp.float32) for v in (x0, ref, res))
  u_ref, u_k, diff = ref - x0, res - x0, res - ref
  top = jnp.maximum(jnp.max(jnp.abs(u_ref), initial=0.0),
                    jnp.max(jnp.abs(u_k), initial=0.0))
  safe = jnp.where(top > 0, top, 1.0)
  a, b = u_ref / safe, u_k / safe
  scale = jnp.sum(a * b) / jnp.sum(a * a)
  return {
      "max_abs": jnp.max(jnp.abs(diff), initial=0.0),
      "error": _norm(diff),
      "update": _norm(u_ref),
      "size": _norm(ref),
      "scale": scale,
      "residual": _norm(b - scale * a) / jnp.maximum(_norm(b), 1e-30),
      "nonfinite": jnp.any(~jnp.isfinite(res) & jnp.isfinite(x0)),
  }


@jax.jit
def _exact_stats(x0: jax.Array, ref: jax.Array, res: jax.Array) -> dict:
  x0, ref, res = (v.astype(jnp.int64 if jax.config.jax_enable_x64
                           else jnp.int32) for v in (x0, ref, res))
  diff = jnp.abs(res - ref)
  u_ref, u_k = ref - x0, res - x0
  return {
      "max_abs": jnp.max(diff, initial=0),
      "changes": (jnp.sum(u_ref), jnp.sum(u_k)),
  }


def _fetch(tree: Any) -> Any:
  """Scalars computed on the devices, as Python floats (any process)."""
  return jax.tree.map(lambda x: float(np.asarray(x.addressable_data(0))),
                      tree)


def _as_numbers(x: Any) -> Any:
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def compare(path: str, k: int, x0: Any, ref: Any, res: Any,
            rtol: float) -> LeafDiff:
  """``res`` (after ``k`` micro-batches) against ``ref``, both from ``x0``."""
  x0, ref, res = _as_numbers(x0), _as_numbers(ref), _as_numbers(res)
  if jnp.issubdtype(ref.dtype, jnp.inexact):
    s = _fetch(_float_stats(x0, ref, res))
    eps = float(jnp.finfo(ref.dtype).eps)
    return LeafDiff(path, k, s["max_abs"], s["error"],
                    rtol * s["update"] + 4 * eps * s["size"], s["update"],
                    s["scale"] if s["update"] > 0 else float("nan"),
                    s["residual"] < 1e-2, bool(s["nonfinite"]))
  s = _fetch(_exact_stats(x0, ref, res))
  change_ref, change_k = s["changes"]
  scale = change_k / change_ref if change_ref else float("nan")
  return LeafDiff(path, k, s["max_abs"], s["max_abs"], 0.0, abs(change_ref),
                  scale, True, False)
