"""Only the Hkv K/V heads (and the per-token mask arrays) ride the ring: every
collective permute in the lowered forward and backward carries [B, Hkv, L, D]
or [B, L], never the Hq query heads."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cpjax
from tests.helpers import cp_mesh

# StableHLO: %5 = "stablehlo.collective_permute"(%4) <{...}> : (tensor<2x1x16x8xf32>) -> tensor<...>
PERMUTE = re.compile(r'"?stablehlo\.collective_permute"?.*?:\s*\(tensor<([0-9x]+)x(\w+)>\)')


def permuted_shapes(text):
  """[(shape tuple, dtype)] of every collective_permute operand in StableHLO ``text``."""
  return [(tuple(int(d) for d in dims.split("x")), dtype) for dims, dtype in PERMUTE.findall(text)]


@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("kind", ["contiguous", "load_balanced"])
def test_collective_permutes_carry_only_kv_heads(hkv, kind):
  b, s, hq, d, cp = 2, 64, 4, 8, 4  # B, L = 16, Hq, D all distinct from Hkv
  lay = cpjax.ShardLayout(s, s, cp, kind)
  mesh = cp_mesh(cp)
  spec = P(None, "cp")
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  ring = jax.shard_map(
    lambda q, k, v, doc_ids: cpjax.ring_attention(q, k, v, layout=lay, document_ids=doc_ids),
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
  )
  loss = lambda q, k, v, doc_ids: jnp.sum(ring(q, k, v, doc_ids))  # noqa: E731
  args = (
    sds((b, s, hq, d), jnp.float32),
    sds((b, s, hkv, d), jnp.float32),
    sds((b, s, hkv, d), jnp.float32),
    sds((b, s), jnp.int32),
  )
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).as_text()
  shapes = permuted_shapes(text)
  assert len(shapes) == text.count("stablehlo.collective_permute"), "a permute the regex missed"
  local = lay.local_seq_len
  kv = [sh for sh, _ in shapes if len(sh) == 4]
  assert kv, "no K/V collective permute found"
  assert all(sh == (b, hkv, local, d) for sh in kv), shapes  # head-major [B, Hkv, L, D]
  # The mask's arrays travel stacked, [n, B, L]: here the document ids alone.
  assert all(sh == (1, b, local) for sh, _ in shapes if len(sh) != 4), shapes
  # Forward K, V; backward K, V, dK, dV in the loop and dK, dV sent home: 8 (one direction).
  assert len(kv) >= 6, shapes
