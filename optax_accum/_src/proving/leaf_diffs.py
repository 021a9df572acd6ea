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
must come out (nearly) unchanged too. Where the true gradient of a
parameter is zero (an attention key's bias: softmax ignores it), Adam
scales its rounding noise into a full step in a direction of chance: such
leaves are recognised from the optimizer's moments and pass
(:func:`rounding_gradients`).

Integer and boolean leaves (counters, flags) must be equal. Everything is
reduced on the devices (one scalar per statistic), so a sharded state is
never gathered to the host.
"""

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_F32_EPS = float(np.finfo(np.float32).eps)
RTOL = float(np.sqrt(_F32_EPS))


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
    zero_gradient: the leaf's parameter has a gradient at float32 rounding
      (see :func:`rounding_gradients`): it passes whatever its difference.
    rounding: the allowance's second term, ``4 * eps * ||x_ref||``.
    low_precision: the leaf is a floating dtype coarser than float32
      (bfloat16, float16, float8).
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
  zero_gradient: bool = False
  rounding: float = 0.0
  low_precision: bool = False

  @property
  def ok(self) -> bool:
    return not self.nonfinite and (self.error <= self.allowed
                                   or self.zero_gradient)

  @property
  def excess(self) -> float:
    """``error / allowed`` (inf where nothing is allowed and it differs)."""
    if self.error == 0 or self.zero_gradient:
      return 0.0
    return self.error / self.allowed if self.allowed > 0 else float("inf")


def _norm(x: jax.Array) -> jax.Array:
  """The Euclidean norm, scaled so that float32 squares cannot overflow."""
  top = jnp.max(jnp.abs(x), initial=0.0)
  safe = jnp.where(top > 0, top, 1.0)
  return top * jnp.sqrt(jnp.sum(jnp.square(x / safe)))


def _minus(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a - b``, zero where the two are equal (infinities too) or both NaN:
  a leaf holding an infinite mask the step leaves alone is unchanged."""
  same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))
  return jnp.where(same, 0.0, a - b)


def _float_stats(x0: jax.Array, ref: jax.Array, res: jax.Array) -> dict:
  x0, ref, res = (v.astype(jnp.float32) for v in (x0, ref, res))
  u_ref, u_k, diff = _minus(ref, x0), _minus(res, x0), _minus(res, ref)
  top = jnp.maximum(jnp.max(jnp.abs(u_ref), initial=0.0),
                    jnp.max(jnp.abs(u_k), initial=0.0))
  safe = jnp.where(top > 0, top, 1.0)
  a, b = u_ref / safe, u_k / safe
  scale = jnp.sum(a * b) / jnp.sum(a * a)
  return {
      "max_abs": jnp.max(jnp.abs(diff), initial=0.0),
      "error": _norm(diff),
      "update": _norm(u_ref),
      "size": _norm(jnp.where(jnp.isfinite(ref), ref, 0.0)),
      "scale": scale,
      "residual": _norm(b - scale * a) / jnp.maximum(_norm(b), 1e-30),
      "nonfinite": jnp.any(~jnp.isfinite(res) & jnp.isfinite(x0)),
  }


def _exact_stats(x0: jax.Array, ref: jax.Array, res: jax.Array) -> dict:
  x0, ref, res = (v.astype(jnp.int64 if jax.config.jax_enable_x64
                           else jnp.int32) for v in (x0, ref, res))
  diff = jnp.abs(res - ref)
  u_ref, u_k = ref - x0, res - x0
  return {
      "max_abs": jnp.max(diff, initial=0),
      "changes": (jnp.sum(u_ref), jnp.sum(u_k)),
  }


def _is_float(x: jax.Array) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


@jax.jit
def _all_stats(triples: list[tuple[jax.Array, ...]]) -> list[dict]:
  """Every leaf's statistics in one program: compiled once per state."""
  return [(_float_stats if _is_float(ref) else _exact_stats)(x0, ref, res)
          for x0, ref, res in triples]


def _fetch(tree: Any) -> Any:
  """Scalars computed on the devices, as Python floats (any process)."""
  return jax.tree.map(lambda x: float(np.asarray(x.addressable_data(0))),
                      tree)


def _as_numbers(x: Any) -> Any:
  """A key as its data, a complex leaf as its real and imaginary parts."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  if jnp.iscomplexobj(x):
    return jnp.stack([x.real, x.imag], axis=-1)
  return x


def _row(path: str, k: int, ref: jax.Array, s: dict, rtol: float) -> LeafDiff:
  if _is_float(ref):
    eps = float(jnp.finfo(ref.dtype).eps)
    rounding = 4 * eps * s["size"]
    return LeafDiff(path, k, s["max_abs"], s["error"],
                    rtol * s["update"] + rounding, s["update"],
                    s["scale"] if s["update"] > 0 else float("nan"),
                    s["residual"] < 1e-2, bool(s["nonfinite"]),
                    rounding=rounding, low_precision=eps > _F32_EPS)
  change_ref, change_k = s["changes"]
  scale = change_k / change_ref if change_ref else float("nan")
  return LeafDiff(path, k, s["max_abs"], s["max_abs"], 0.0,
                  abs(change_ref), scale, True, False)


def compare(k: int, leaves: dict[str, tuple[Any, Any, Any]],
            rtol: float) -> list[LeafDiff]:
  """Each leaf after ``k`` micro-batches against the reference's.

  Args:
    k: the split.
    leaves: for each path, the leaf given, the reference's and this
      split's, of one shape and dtype.
    rtol: the allowance relative to the reference's update.
  """
  triples = [tuple(map(_as_numbers, t)) for t in leaves.values()]
  stats = _fetch(_all_stats(triples))
  return [_row(path, k, ref, s, rtol)
          for path, (_, ref, _), s in zip(leaves, triples, stats)]


# A leaf whose change is under this share of its family's holds rounding.
ROUNDING_SHARE = 2.0**-17
_KEY = re.compile(r"\[[^\]]*\]|\.[A-Za-z_][A-Za-z_0-9]*")


def _suffixes(path: str) -> list[str]:
  """The tails of ``path`` at its key boundaries, longest first."""
  keys = _KEY.findall(path)
  return ["".join(keys[i:]) for i in range(1, len(keys))]


def _families(rows: list[LeafDiff]) -> tuple[dict, dict, dict]:
  """For each prefix of a floating leaf's path: the tails under it, the
  squared norm of their changes; and for each tail, its prefixes."""
  tails: dict[str, set[str]] = {}
  norm2: dict[str, float] = {}
  prefixes: dict[str, list[str]] = {}
  for row in rows:
    if row.allowed > 0:
      for tail in _suffixes(row.path):
        prefix = row.path[: -len(tail)]
        tails.setdefault(prefix, set()).add(tail)
        norm2[prefix] = norm2.get(prefix, 0.0) + row.update**2
        prefixes.setdefault(tail, []).append(prefix)
  return {p: frozenset(t) for p, t in tails.items()}, norm2, prefixes


def rounding_gradients(rows: list[LeafDiff]) -> list[LeafDiff]:
  """``rows`` with the leaves of parameters whose gradient is rounding
  noise marked ``zero_gradient``.

  An attention key's bias has a true gradient of zero (softmax ignores
  it): what is computed is float32 noise, different for every summation
  order, and Adam divides it by its own square root, a full step of the
  learning rate in a direction of chance. Such a parameter shows in the
  optimizer's moments, which hold the gradient. A parameter is found by
  its path in a tree that another part of the state mirrors leaf for leaf
  (the parameters, Adam's ``mu``, its ``nu``): where its leaf in one of
  them changes by less than ``ROUNDING_SHARE`` of that tree's change, its
  failing leaves pass: no mistake of weighting can show in a gradient that
  is zero.
  """
  tails, norm2, prefixes = _families(rows)
  update = {row.path: row.update for row in rows}

  def rounding_only(row: LeafDiff) -> bool:
    for tail in _suffixes(row.path):  # the longest mirrored tail decides.
      own = row.path[: -len(tail)]
      mirrors = [p for p in prefixes.get(tail, ())
                 if p != own and tails[p] == tails[own]]
      if mirrors:
        return any(update[p + tail] <= ROUNDING_SHARE * norm2[p]**0.5
                   for p in mirrors)
    return False

  return [row._replace(zero_gradient=True)
          if not row.ok and row.allowed > 0 and rounding_only(row) else row
          for row in rows]
