"""Context-parallel attention on global arrays: no ``shard_map`` in user code.

:func:`context_parallel_attention` takes GLOBAL arrays in the rank order that
:func:`cpjax.shard_batch` returns (``x[:, r*L:(r+1)*L]`` is what rank r
holds), runs :func:`cpjax.ring_attention` inside its own ``jax.shard_map`` over
the ``cp`` axis (and, optionally, a batch and a head axis) and returns the
global output in the same order. It composes with ``jax.jit`` and
``jax.grad`` like any other function of global arrays.

:func:`cpjax.to_rank_order` and :func:`cpjax.from_rank_order` (in
:mod:`cpjax.batch.layout`) move any array between natural token order and rank
order along any axis.

Shape letters: ``B`` batch, ``S`` padded global length, ``H``/``Hkv`` query
and key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from cpjax import _deprecations, checks
from cpjax.attention.ring import ring_attention
from cpjax.batch.layout import ShardLayout
from cpjax.masks import AttentionMask, resolve_mask
from cpjax.parallel import mesh_platform, place, required_axis_size, resolve_implementation

__all__ = ["context_parallel_attention"]


@_deprecations.renamed_keywords("cpjax.context_parallel_attention", segment_ids="document_ids")
def context_parallel_attention(
  q: jax.Array | np.ndarray,
  k: jax.Array | np.ndarray,
  v: jax.Array | np.ndarray,
  *,
  mesh: Mesh,
  layout: ShardLayout,
  axis_name: str | tuple[str, str] = "cp",
  batch_axis: str | None = None,
  head_axis: str | None = None,
  mask: AttentionMask | None = None,
  scale: float | None = None,
  logits_soft_cap: float | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  implementation: str | None = None,
  interpret: bool = False,
  strategy: str = "ring",
  **mask_keywords: Any,
) -> jax.Array:
  """Compute ring attention of global, rank-ordered arrays; calls ``shard_map`` itself.

  Equals :func:`cpjax.reference_attention` of the same arrays in natural
  order (:func:`from_rank_order`), values and gradients.

  Args:
    q: [B, S, H, D] queries, S = ``layout.padded_seq_len``, in rank order.
    k, v: [B, S, Hkv, D] keys and values; H a multiple of Hkv.
    mesh: a mesh with an ``axis_name`` axis of size ``layout.cp_size``.
    layout: the :class:`cpjax.ShardLayout` the arrays follow (from
      :func:`cpjax.shard_batch`).
    axis_name: the context-parallel mesh axis; for ``strategy="hybrid"``
      also a pair ``(ring_axis, ulysses_axis)`` (see
      :func:`cpjax.ring_attention`), the product of their sizes
      ``layout.cp_size``.
    batch_axis: optional mesh axis the batch is sharded over (B divisible by
      its size).
    head_axis: optional mesh axis the heads are sharded over (tensor
      parallelism; Hkv divisible by its size).
    mask: a :class:`cpjax.AttentionMask` whose arrays are [B, S] in rank
      order; or, instead of it, the keywords ``causal``, ``sliding_window``,
      ``document_ids``, ``padding_mask``, ``vision_group_ids`` of
      :meth:`cpjax.AttentionMask.create` (arrays [B, S] in rank order).
    scale, logits_soft_cap, block_q, block_kv, implementation, interpret, strategy: as
      :func:`cpjax.ring_attention`.

  Returns:
    [B, S, H, D] in q's dtype and rank order, sharded like q's in_spec
    ``P(batch_axis, axis_name, head_axis)``.

  Example:
    >>> import jax, numpy as np, cpjax
    >>> mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    >>> lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
    >>> x = np.random.default_rng(0).standard_normal((1, 32, 2, 8), np.float32)
    >>> docs = np.repeat([[1, 2]], 16, axis=1)                  # two documents
    >>> xr, dr = cpjax.to_rank_order(x, lay), cpjax.to_rank_order(docs, lay)
    >>> out = cpjax.context_parallel_attention(xr, xr, xr, mesh=mesh, layout=lay, document_ids=dr)
    >>> ref = cpjax.reference_attention(x, x, x, document_ids=docs)
    >>> bool(np.allclose(cpjax.from_rank_order(out, lay), ref, atol=1e-5))
    True
  """
  if not isinstance(layout, ShardLayout):
    raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
  # (A pair of axes is the hybrid's: ring_attention checks the strategy.)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  cp_size = math.prod(required_axis_size(mesh, a, "axis_name") for a in names)
  if cp_size != layout.cp_size:
    raise ValueError(
      f"layout.cp_size ({layout.cp_size}) must equal the size of mesh axis "
      f"{axis_name!r} ({cp_size})"
    )
  axes = {"axis_name": axis_name}
  for name, axis in (("batch_axis", batch_axis), ("head_axis", head_axis)):
    if axis is None:
      continue
    required_axis_size(mesh, axis, name)
    if axis in names or axis in axes.values():
      raise ValueError(f"{name}={axis!r} must differ from the other axes {axes}")
    axes[name] = axis
  b, s, _, _, _ = checks.attention_inputs(q, k, v, length="S")
  checks.attention_options(scale=scale, logits_soft_cap=logits_soft_cap)
  if s != layout.padded_seq_len:
    raise ValueError(
      f"q must hold layout.padded_seq_len = {layout.padded_seq_len} tokens on "
      f"dim 1 (global arrays in rank order), got shape {tuple(jnp.shape(q))}"
    )
  sizes = dict(mesh.shape)
  if batch_axis is not None and b % sizes[batch_axis]:
    raise ValueError(
      f"batch size {b} must be divisible by the size {sizes[batch_axis]} of "
      f"batch_axis={batch_axis!r}"
    )
  if head_axis is not None and jnp.shape(k)[2] % sizes[head_axis]:
    raise ValueError(
      f"key/value heads ({jnp.shape(k)[2]}) must be divisible by the size "
      f"{sizes[head_axis]} of head_axis={head_axis!r}, so that every query "
      "head finds its key/value head on the same device"
    )
  mask = resolve_mask(mask, **mask_keywords).validate(
    b, s, where="[B, S] (q's first two dimensions, rank order)"
  )
  # The mesh's own backend by default (a TPU mesh compiled from a CPU host too).
  implementation = resolve_implementation(implementation, platform=mesh_platform(mesh))
  x_spec = P(batch_axis, axis_name, head_axis)
  options = dict(
    layout=layout,
    axis_name=axis_name,
    scale=scale,
    logits_soft_cap=logits_soft_cap,
    block_q=block_q,
    block_kv=block_kv,
    implementation=implementation,
    interpret=interpret,
    strategy=strategy,
  )
  q, k, v = (place(jnp.asarray(x), mesh, x_spec) for x in (q, k, v))
  mask = jax.tree.map(lambda x: place(x, mesh, P(batch_axis, axis_name)), mask)
  return _program(mesh, x_spec, tuple(sorted(options.items())))(q, k, v, mask)


@functools.lru_cache(maxsize=64)
def _program(mesh: Mesh, x_spec: P, options: tuple) -> Any:
  """The jitted shard_map of ring_attention for these settings, made once.

  Called eagerly, a shard_map runs op by op (hundreds of small compiles for
  one call); jitted, it is one program, and under an outer ``jax.jit`` it is
  inlined. The mask's specs follow its tree, known when it is traced.
  """
  mask_axes = (x_spec[0], x_spec[1])

  def local(q, k, v, mask):
    return ring_attention(q, k, v, mask=mask, **dict(options))

  # (out_shardings: the output's spec is x_spec as written, as shard_map's is.)
  @functools.partial(jax.jit, out_shardings=jax.NamedSharding(mesh, x_spec))
  def run(q, k, v, mask):
    mask_spec = jax.tree.map(lambda _: P(*mask_axes), mask)
    ring = jax.shard_map(
      local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, mask_spec), out_specs=x_spec
    )
    return ring(q, k, v, mask)

  return run


def __getattr__(name: str):
  # Names that left this module in 0.2, for one release (cpjax/_deprecations.py).
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
