"""Cross entropy straight from hidden states and the output head, never holding [L, V].

Shapes: ``B`` rows, ``L`` tokens per row, ``D`` width, ``V`` vocabulary,
``N = B * L`` tokens, ``C`` tokens per chunk.

The logits of a long row dominate a language model's training memory (for
Gemma 4's 262144-token vocabulary, 1 MiB per token in float32, and their
gradient again). :func:`linear_cross_entropy` scans the tokens ``C`` at a
time: each chunk's logits are computed in float32 (with Gemma's soft cap,
``cap * tanh(z / cap)``), reduced to their log-sum-exp and the label's logit,
and dropped. The backward recomputes each chunk's logits, forms
``softmax - onehot`` and accumulates the head's gradient chunk by chunk, so
only O(N) values (one log-sum-exp per token) are kept between the passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpjax.batch import IGNORE_INDEX

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(hidden, head, labels, *, chunk_size: int = 1024,
                         logits_soft_cap: float | None = None,
                         ignore_index: int = IGNORE_INDEX):
  """(sum of per-token CE, number of counted tokens), both float32 scalars:
  :func:`cpjax.train.token_cross_entropy` of ``cap(hidden @ head.T)``.

  Args:
    hidden: [B, L, D] final hidden states (any float dtype; the matmul
      accumulates in float32).
    head: [V, D] output projection (a tied embedding table as it is).
    labels: int[B, L]; ``ignore_index`` is not counted.
    chunk_size: tokens per chunk ``C``; ``N`` need not be a multiple of it.
    logits_soft_cap: Gemma's final soft cap, or None.

  Example:
    >>> import numpy as np
    >>> h = np.ones((1, 3, 2), np.float32)
    >>> w = np.zeros((4, 2), np.float32)
    >>> s, n = linear_cross_entropy(h, w, np.array([[1, -100, 3]]), chunk_size=2)
    >>> round(float(s), 4), float(n)       # 2 * log(4)
    (2.7726, 2.0)
  """
  hidden, head, labels = jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(labels)
  if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[-1]:
    raise ValueError(f"hidden must be [B, L, D] and head [V, D] with the same D, got "
                     f"{hidden.shape} and {head.shape}")
  if labels.shape != hidden.shape[:2] or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"labels must be an integer [B, L] = {list(hidden.shape[:2])} array, got "
                     f"{labels.dtype}{list(labels.shape)}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
  n = hidden.shape[0] * hidden.shape[1]
  chunk = min(chunk_size, max(n, 1))
  pad = -n % chunk
  # Padded tokens carry ignore_index: they add nothing to either sum.
  h = jnp.pad(hidden.reshape(n, -1), ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])
  y = jnp.pad(labels.reshape(n), (0, pad), constant_values=ignore_index).reshape(-1, chunk)
  valid = y != ignore_index
  ce_sum = _ce_sum(h, head, y, valid, logits_soft_cap)
  return ce_sum, jnp.sum(valid, dtype=jnp.float32)


def _logits(h, head, cap):
  """float32 [C, V] logits of one chunk, soft-capped, and the uncapped tanh (for the VJP)."""
  z = jnp.einsum("cd,vd->cv", h, head, preferred_element_type=jnp.float32)
  if cap is None:
    return z, None
  t = jnp.tanh(z / cap)
  return cap * t, t


def _picked(z, y):
  # The label's logit by a masked sum over V (not a gather: a vocabulary
  # sharded over an Auto mesh axis trips XLA's SPMD partitioner on gathers).
  return jnp.sum(jnp.where(jnp.arange(z.shape[-1]) == y[:, None], z, 0.0), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ce_sum(h, head, y, valid, cap):
  return _ce_forward(h, head, y, valid, cap)[0]


def _ce_forward(h, head, y, valid, cap):
  def chunk(total, xs):
    hc, yc, vc = xs
    z, _ = _logits(hc, head, cap)
    lse = jax.nn.logsumexp(z, axis=-1)
    return total + jnp.sum(jnp.where(vc, lse - _picked(z, yc), 0.0)), lse

  total, lse = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (h, y, valid))
  return total, (h, head, y, valid, lse)


def _ce_backward(cap, residuals, g):
  h, head, y, valid, lse = residuals

  def chunk(d_head, xs):
    hc, yc, vc, lc = xs
    z, t = _logits(hc, head, cap)
    # d CE / d z = softmax - onehot on counted tokens; through the cap,
    # d (cap tanh(x / cap)) / dx = 1 - tanh^2.
    dz = jnp.exp(z - lc[:, None]) - (jnp.arange(z.shape[-1]) == yc[:, None])
    dz = jnp.where(vc[:, None], dz, 0.0) * g
    if t is not None:
      dz = dz * (1.0 - t * t)
    dh = jnp.einsum("cv,vd->cd", dz, head, preferred_element_type=jnp.float32)
    d_head = d_head + jnp.einsum("cv,cd->vd", dz, hc, preferred_element_type=jnp.float32)
    return d_head, dh.astype(hc.dtype)

  d_head, dh = jax.lax.scan(chunk, jnp.zeros(head.shape, jnp.float32), (h, y, valid, lse))
  return dh, d_head.astype(head.dtype), None, None


_ce_sum.defvjp(_ce_forward, _ce_backward)
