"""Run ring_attention on full (padded) arrays through shard_map, and the reference."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax.batch import balance
from tests.helpers import cp_mesh

META_KEYS = ("document_ids", "padding_mask", "vision_group_ids")


def make_inputs(rng, *, b=2, s=64, hq=4, hkv=2, d=8, dtype=np.float32):
  q = rng.standard_normal((b, s, hq, d)).astype(np.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  w = rng.standard_normal((b, s, hq, d)).astype(np.float32)  # cotangent weights
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (jnp.asarray(w, jnp.float32),)


def packed_metadata(rng, b, s, *, pad_from=None, vision=False, n_docs=3):
  """Document ids with id-0 padding from ``pad_from``, matching padding mask,
  and (optionally) vision groups made from random image spans."""
  meta = {}
  pad_from = s if pad_from is None else pad_from
  doc_ids = np.zeros((b, s), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, pad_from), n_docs - 1, replace=False))
    doc_ids[row, :pad_from] = 1 + np.searchsorted(cuts, np.arange(pad_from), side="right")
  meta["document_ids"] = doc_ids
  meta["padding_mask"] = doc_ids == 0
  if vision:
    types = np.zeros((b, s), np.int32)
    for row in range(b):
      for _ in range(2):
        start = int(rng.integers(0, max(pad_from - 6, 1)))
        types[row, start : start + int(rng.integers(3, 12))] = 1
    types[doc_ids == 0] = 0
    meta["vision_group_ids"] = np.asarray(cpjax.vision_group_ids(types))
  return meta


def ring(
  q,
  k,
  v,
  w,
  *,
  cp: int,
  kind: str,
  meta=None,
  grads=True,
  mesh=None,
  batch_axis=None,
  stripes=None,
  **kw,
):
  """Ring attention of full-sequence arrays; returns (out, (dq, dk, dv)) in global order.

  The loss for gradients is ``sum(out * w)``.
  """
  meta = {k_: v_ for k_, v_ in (meta or {}).items() if v_ is not None}
  b, s = q.shape[:2]
  layout = cpjax.ShardLayout(s, s, cp, kind, stripes=stripes)
  # Row b in rank order is x[b, order[b]]: per row under document_balanced,
  # whose documents the host reorders (its mask must separate documents).
  if kind == "document_balanced":
    order = balance.balance_documents(meta["document_ids"], layout)[:, cpjax.rank_order(layout)]
  else:
    order = np.broadcast_to(cpjax.rank_order(layout), (b, s))
  inverse = np.argsort(order, axis=1)
  mesh = cp_mesh(cp) if mesh is None else mesh
  spec = P(batch_axis, "cp")

  def rows(x, index):
    x = np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x)
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return np.take_along_axis(x, index, axis=1)

  def place(x):
    return jax.device_put(jnp.asarray(rows(x, order), x.dtype), NamedSharding(mesh, spec))

  def local(q, k, v, meta):
    return cpjax.ring_attention(q, k, v, layout=layout, **meta, **kw)

  attn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)
  args = [place(x) for x in (q, k, v)] + [{k_: place(v_) for k_, v_ in meta.items()}]
  w_r = place(w)

  @jax.jit
  def run(q, k, v, meta, w):
    out = attn(q, k, v, meta)
    if not grads:
      return out, None
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, meta).astype(jnp.float32) * w)
    return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  with jax.set_mesh(mesh):
    out, g = run(*args, w_r)
  unorder = lambda x: rows(np.asarray(jnp.asarray(x, jnp.float32)), inverse)
  return unorder(out), (None if g is None else tuple(unorder(x) for x in g))


def reference(q, k, v, w, *, meta=None, grads=True, **kw):
  meta = {k_: v_ for k_, v_ in (meta or {}).items() if v_ is not None}
  f = lambda q, k, v: cpjax.reference_attention(
    q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **meta, **kw
  )
  out = f(q, k, v)
  g = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v) if grads else None
  return np.asarray(out), (None if g is None else tuple(np.asarray(x, np.float32) for x in g))


def check_global_documents(heads: int, **options):
  """Check ``context_parallel_attention(**options)`` on two packed documents.

  Global, rank-ordered q = k = v f32[1, 32, ``heads``, 8] over cp = 4 on a
  load-balanced layout, jitted, against the dense reference; returns the
  mesh, the layout and the natural-order x it ran on.
  """
  mesh = cp_mesh(4)
  lay = cpjax.ShardLayout(32, 32, 4, "load_balanced")
  x = np.random.default_rng(5).standard_normal((1, 32, heads, 8), np.float32)
  docs = np.repeat([[1, 2]], 16, axis=1)
  xr, dr = cpjax.to_rank_order(x, lay), cpjax.to_rank_order(docs, lay)
  attend = functools.partial(cpjax.context_parallel_attention, mesh=mesh, layout=lay, **options)
  out = jax.jit(lambda x, d: attend(x, x, x, document_ids=d))(xr, dr)
  want = cpjax.reference_attention(x, x, x, document_ids=docs)
  chex.assert_trees_all_close(cpjax.from_rank_order(out, lay), want, rtol=1e-5, atol=1e-5)
  return mesh, lay, x


def count_gathers(monkeypatch) -> list:
  """Record each all-gathered attention call as it is traced (one entry a
  call): where a strategy reaches the attention, not only its values."""
  from cpjax.attention.ring import _passes

  return spy(monkeypatch, _passes, "_gathered")


def count_ulysses(monkeypatch) -> list:
  """Record each Ulysses attention call as it is traced (its output's all-to-all home)."""
  from cpjax.attention.ring import _attention

  return spy(monkeypatch, _attention, "_row_to_heads")


def spy(monkeypatch, module, name: str) -> list:
  """Record each call of ``module.name`` (one entry a call) while a test runs."""
  calls, real = [], getattr(module, name)

  def record(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(module, name, record)
  return calls


def gradient_program(strategy: str, *, cp: int = 4, hkv: int = 1, shared: bool = False) -> str:
  """The compiled gradient program (text) of attention on 8 load-balanced
  tokens a rank, 4 query heads on ``hkv`` K/V heads; ``shared``: one array
  passed as both K and V."""
  s = 8 * cp
  mesh = cp_mesh(cp)
  lay = cpjax.ShardLayout(s, s, cp, "load_balanced")
  spec = NamedSharding(mesh, P(None, "cp"))

  def attend(q, k, v):
    return cpjax.ring_attention(q, k, k if shared else v, layout=lay, strategy=strategy)

  f = jax.shard_map(attend, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
  loss = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
  args = [
    jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec)
    for shape in ((1, s, 4, 8), (1, s, hkv, 8), (1, s, hkv, 8))
  ]
  with jax.set_mesh(mesh):
    return jax.jit(loss).lower(*args).compile().as_text()


def count_ops(text: str, op: str) -> int:
  """How many ``op`` instructions (or their async ``-start`` halves) a program's text holds."""
  return len([line for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line])
