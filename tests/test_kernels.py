"""The Pallas per-hop kernels: interpret-mode parity with the dense reference,
lowering for TPU and GPU from this CPU machine, and their bad input.

Interpret mode runs the very kernels the accelerators compile, block specs,
scalar-prefetched schedules and all, so the shapes here follow each implementation's
tiling rules: 128-row tiles for Mosaic TPU, power-of-two tiles for Triton.
"""

import collections
import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax.attention.ring.kernels import _common as common
from cpjax.attention.ring.kernels import resolve_implementation
from cpjax.masks import BlockMap
from tests import attention_harness as H
from tests.helpers import cp_mesh

F32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)  # as the XLA path's bf16 tests (tests/test_ring_attention.py)


def check(
  implementation,
  *,
  cp,
  kind,
  s,
  hq=4,
  hkv=2,
  d=32,
  dtype=np.float32,
  docs=False,
  pad_from=None,
  vision=False,
  seed=0,
  tol=F32,
  **kw,
):
  rng = np.random.default_rng(seed)
  inputs = H.make_inputs(rng, b=2, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype)
  meta = H.packed_metadata(rng, 2, s, pad_from=pad_from, vision=vision)
  if not docs:
    meta.pop("document_ids")
  if pad_from is None:
    meta.pop("padding_mask")
  out, grads = H.ring(
    *inputs, cp=cp, kind=kind, meta=meta, implementation=implementation, interpret=True, **kw
  )
  for ring_only in ("block_q", "block_kv", "stripes"):
    kw.pop(ring_only, None)
  ref_out, ref_grads = H.reference(*inputs, meta=meta, **kw)
  chex.assert_tree_all_finite((out, grads))
  chex.assert_trees_all_close(out, ref_out, **tol)
  for name, got, want in zip("qkv", grads, ref_grads):
    chex.assert_trees_all_close(got, want, **tol, custom_message=f"d{name}")
  return out, ref_out, grads


# Triton tiles are powers of two >= 16: 16-token tiles (32 rows with G = 2)
# split every chunk here into several tiles, so each hop has empty, partial
# and full tiles.
GPU_CASES = {
  "cp1-docs-padding": dict(cp=1, kind="contiguous", s=128, docs=True, pad_from=100),
  "cp2-lb-window": dict(cp=2, kind="load_balanced", s=128, docs=True, sliding_window=20),
  "cp4-window-softcap": dict(
    cp=4, kind="contiguous", s=256, sliding_window=40, logits_soft_cap=3.0
  ),
  "cp8-lb-vision-gqa4": dict(
    cp=8, kind="load_balanced", s=256, hq=8, hkv=2, docs=True, pad_from=230, vision=True
  ),
  "cp8-bidirectional-window": dict(cp=8, kind="contiguous", s=256, causal=False, sliding_window=24),
  "cp4-lb-bf16": dict(cp=4, kind="load_balanced", s=256, docs=True, dtype=jnp.bfloat16, tol=BF16),
  # Rows reordered by document, four 16-token stripes per rank.
  "cp4-db-docs-window": dict(
    cp=4, kind="document_balanced", s=256, docs=True, pad_from=240, sliding_window=20, stripes=4
  ),
}


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernels_interpreted(case):
  check("pallas_gpu", block_q=16, block_kv=16, **GPU_CASES[case])


@pytest.mark.parametrize("case", ["lb-docs-padding-window", "db-vision-gqa4"])
def test_gpu_kernels_walk_every_tile_of_a_grouped_schedule_block(monkeypatch, case):
  """Past ``schedule_tiles`` blocks a hop, the GPU schedule lists blocks of
  several tiles and each program walks the tiles of every listed block (with
  room for 4 blocks, 8 x 8 tiles of 16 tokens go as 2 x 2 blocks of 4 x 4
  tiles): values and gradients are still the dense reference's, padded rows
  and windows cutting through a block included."""
  from cpjax.attention.ring.kernels import _implementations

  monkeypatch.setitem(
    _implementations.PALLAS_IMPLEMENTATIONS,
    "pallas_gpu",
    dataclasses.replace(_implementations.PALLAS_IMPLEMENTATIONS["pallas_gpu"], schedule_tiles=4),
  )
  groups = []
  tiles_per_block = common.Schedule.tiles_per_block

  def recorded(sched, *tiles):
    groups.append(tiles_per_block(sched, *tiles))
    return groups[-1]

  monkeypatch.setattr(common.Schedule, "tiles_per_block", recorded)
  shape = {
    "lb-docs-padding-window": dict(
      kind="load_balanced", docs=True, pad_from=200, sliding_window=40, d=16
    ),
    "db-vision-gqa4": dict(
      kind="document_balanced", hq=8, hkv=2, docs=True, vision=True, stripes=2, d=16
    ),
  }[case]
  check("pallas_gpu", cp=2, s=256, block_q=16, block_kv=16, **shape)
  assert groups and set(groups) == {(4, 4)}, groups  # forward, dq and dk/dv


# Mosaic tiles are multiples of 128 rows and keys: chunks of 128 tokens and
# more (block_q = 64 tokens makes 128 rows with G = 2).
TPU_CASES = {
  "cp1-docs-padding-2x2-tiles": dict(
    cp=1, kind="contiguous", s=256, docs=True, pad_from=200, block_q=64, block_kv=128
  ),
  "cp2-lb-vision-window-softcap": dict(
    cp=2, kind="load_balanced", s=512, vision=True, sliding_window=100, logits_soft_cap=3.0
  ),
  "cp4-window-bf16": dict(
    cp=4, kind="contiguous", s=512, sliding_window=130, dtype=jnp.bfloat16, tol=BF16
  ),
  "cp8-lb-docs-padding": dict(
    cp=8, kind="load_balanced", s=2048, hq=2, hkv=1, d=16, docs=True, pad_from=1900
  ),
  "cp2-db-docs-window": dict(
    cp=2,
    kind="document_balanced",
    s=1024,
    hq=2,
    hkv=1,
    d=16,
    docs=True,
    pad_from=1000,
    sliding_window=150,
    stripes=4,
  ),
  # Bidirectional masks with G = 4: block_q = 32 tokens makes 128-row tiles;
  # hops hold empty, partial and full tiles.
  "cp2-bidirectional-window-gqa4": dict(
    cp=2,
    kind="contiguous",
    s=512,
    hq=8,
    hkv=2,
    causal=False,
    sliding_window=200,
    block_q=32,
    block_kv=128,
  ),
  "cp2-lb-bidirectional-vision-gqa4": dict(
    cp=2,
    kind="load_balanced",
    s=512,
    hq=8,
    hkv=2,
    causal=False,
    vision=True,
    docs=True,
    block_q=32,
    block_kv=128,
  ),
}


@pytest.mark.parametrize("case", TPU_CASES)
def test_tpu_kernels_interpreted(case):
  check("pallas_tpu", **TPU_CASES[case])


def test_tpu_kernels_split_a_table_too_long_for_smem_into_pieces(monkeypatch):
  """A hop whose tile table passes ``TABLE_WORDS`` runs as several calls over
  pieces of the row blocks (forward, dq) and key blocks (dk/dv), each with its
  piece of the table: with room for 4 words, every call here walks a single
  tile list, and values and gradients are still the dense reference's."""
  from cpjax.attention.ring.kernels import _tpu as tpu

  monkeypatch.setattr(tpu, "TABLE_WORDS", 4)
  assert tpu._pieces(1, 4, 4) == [slice(i, i + 1) for i in range(4)]
  assert tpu._pieces(1, 8, 1) == [slice(0, 4), slice(4, 8)]
  assert tpu._pieces(1, 6, 1) == [slice(0, 3), slice(3, 6)]
  assert tpu._pieces(2, 4, 4) == [slice(i, i + 1) for i in range(4)]  # nothing smaller
  grids = collections.defaultdict(list)
  launch = common.launch

  def recorded(params, make_call, *args):
    grids[make_call.keywords["name"]].append(make_call.keywords["grid_spec"].grid)
    return launch(params, make_call, *args)

  monkeypatch.setattr(common, "launch", recorded)
  check(
    "pallas_tpu",
    cp=2,
    kind="load_balanced",
    s=1024,
    hq=2,
    hkv=1,
    d=16,
    docs=True,
    pad_from=1000,
    sliding_window=300,
    block_q=64,
    block_kv=128,
  )
  assert set(grids) == {"cpjax_ring_forward", "cpjax_ring_dq", "cpjax_ring_dkdv"}, grids
  # Unsplit, each call walks 8 row blocks of 4 key blocks (dk/dv: 4 of 8).
  for name, calls in grids.items():
    assert {grid[2] for grid in calls} == {1}, (name, calls)  # one tile list a call


@pytest.mark.parametrize(
  "implementation, shape",
  [
    ("pallas_gpu", dict(cp=4, kind="load_balanced", s=128, pad_from=64, block_q=16, block_kv=16)),
    ("pallas_tpu", dict(cp=2, kind="load_balanced", s=512, pad_from=256)),
  ],
)
def test_rows_with_nothing_allowed_are_zero_with_zero_gradient(implementation, shape):
  """A fully padded second half: its queries see nothing and its keys are never
  seen, so out, dq, dk and dv are exactly 0 there (not merely within 1e-5)."""
  out, ref, (dq, dk, dv) = check(implementation, docs=True, **shape)
  half = shape["pad_from"]
  np.testing.assert_array_equal(ref[:, half:], 0.0)
  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    np.testing.assert_array_equal(x[:, half:], 0.0, err_msg=name)


def test_context_parallel_attention_passes_the_backend_through():
  lay = cpjax.ShardLayout(128, 128, 2, "load_balanced")
  mesh = cp_mesh(2)
  x = np.random.default_rng(1).standard_normal((1, 128, 2, 16), np.float32)
  docs = np.repeat([[1, 2]], 64, axis=1)
  xr, dr = cpjax.to_rank_order(x, lay), cpjax.to_rank_order(docs, lay)
  out = cpjax.context_parallel_attention(
    xr,
    xr,
    xr,
    mesh=mesh,
    layout=lay,
    document_ids=dr,
    implementation="pallas_gpu",
    interpret=True,
    block_q=16,
    block_kv=16,
  )
  chex.assert_trees_all_close(
    cpjax.from_rank_order(out, lay), cpjax.reference_attention(x, x, x, document_ids=docs), **F32
  )


@pytest.mark.parametrize("layout", ["load_balanced", "document_balanced"])
def test_any_length_runs_on_the_pallas_implementations(layout):
  """56 tokens at cp = 2 used to stop with "cannot tile layout.chunk_len=28"
  on the GPU kernels: the sharder now pads every chunk to 16 tokens (64 in
  all), masked, and the logits equal the single-device model's."""
  from flax import nnx

  from cpjax.models import gemma4

  cfg = gemma4.Gemma4Config.preset("tiny")
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
  batch = gemma4.prepare_batch(
    gemma4.synthetic_batch(
      np.random.default_rng(0), cfg, batch_size=1, seq_len=56, images_per_row=0
    ),
    cfg,
  )
  got = gemma4.cp_logits(
    model, batch, cp_mesh(2), layout=layout, implementation="pallas_gpu", interpret=True
  )
  chex.assert_trees_all_close(got, model(batch), rtol=1e-4, atol=1e-4)
  sharder = model.prepare_model_inputs_for_cp(layout=layout)["cp_sharder"]
  assert sharder.shard_batch(batch, cp_mesh(2), implementation="pallas_gpu")[1].padded_seq_len == 64
  assert (
    sharder.shard_batch(batch, cp_mesh(2), implementation="pallas_tpu")[1].padded_seq_len == 512
  )
  assert sharder.shard_batch(batch, cp_mesh(2))[1].padded_seq_len == 56  # CPU: XLA tiles anything


def test_flax_attention_fn_passes_the_backend_through():
  """One device, no shard_map: flax's MultiHeadAttention on the GPU kernels."""
  from flax import nnx

  x = np.random.default_rng(2).standard_normal((1, 64, 32), np.float32)
  docs = np.repeat([[1, 2]], 32, axis=1)
  mask = cpjax.AttentionMask.create(document_ids=docs)
  kernels = nnx.MultiHeadAttention(
    2,
    32,
    decode=False,
    rngs=nnx.Rngs(0),
    attention_fn=(
      cpjax.ring_attention_fn(implementation="pallas_gpu", interpret=True, block_q=16, block_kv=16)
    ),
  )
  xla = nnx.MultiHeadAttention(
    2,
    32,
    decode=False,
    rngs=nnx.Rngs(0),
    attention_fn=cpjax.ring_attention_fn(implementation="xla"),
  )
  chex.assert_trees_all_close(kernels(x, mask=mask), xla(x, mask=mask), **F32)


@pytest.mark.slow
def test_the_training_loss_of_gemma4_lowers_with_the_tpu_kernels():
  """make_loss_fn -> CPContext -> the model's every layer: the kernels, no tile loop.
  (CI compiles the whole step for TPU instead: tests/test_compile_targets.py.)"""
  from flax import nnx

  from cpjax import training
  from cpjax.models import gemma4

  cfg = gemma4.Gemma4Config.preset("tiny")
  model = gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))
  mesh = cp_mesh(2)
  batch = gemma4.synthetic_batch(np.random.default_rng(0), cfg, batch_size=1, seq_len=512)
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  sharded, layout = sharder.shard_batch(batch, mesh)
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
  loss = training.make_loss_fn(
    graphdef, mesh=mesh, layout=layout, frozen=buffers, implementation="pallas_tpu"
  )
  grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
  with jax.set_mesh(mesh):
    text = grad.trace(params, sharded).lower(lowering_platforms=("tpu",)).as_text()
  names = collections.Counter(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text))
  # Each of the 6 layers lowers its own ring; every ring calls each kernel.
  assert min(names[k] for k in ("forward", "dq", "dkdv")) >= cfg.text.num_hidden_layers, names


# ------------------------------------------------------------- the schedule
def test_schedule_lists_nonempty_tiles_per_row_and_column():
  """Hand-worked: row 0 visits key blocks 0 and 2, row 1 only 1, row 2 none."""
  visit = np.array([[[1, 0, 1], [0, 1, 0], [0, 0, 0]]], bool)
  full = np.array([[[1, 0, 0], [0, 1, 0], [0, 0, 0]]], bool)
  s = common.schedule(BlockMap(jnp.asarray(visit), jnp.asarray(full)), 2, jnp.bool_(True))
  np.testing.assert_array_equal(s.ncols, [[2, 1, 0]] * 2)
  np.testing.assert_array_equal(s.cols[0], [[0, 2, 2], [1, 1, 1], [0, 0, 0]])
  np.testing.assert_array_equal(s.nrows, [[1, 1, 1]] * 2)
  np.testing.assert_array_equal(s.rows[0], [[0, 0, 0], [1, 1, 1], [0, 0, 0]])
  np.testing.assert_array_equal(s.full[1], full[0].astype(np.int32))
  off = common.schedule(BlockMap(jnp.asarray(visit), jnp.asarray(full)), 1, jnp.bool_(False))
  np.testing.assert_array_equal(off.ncols, [[0, 0, 0]])


# --------------------------------------------------------------- lowering
def _lowered_ring(
  implementation, platform, *, kind="load_balanced", cp=4, s=4096, hq=8, hkv=2, d=128, **mask
):
  """StableHLO text of the ring's forward and backward, lowered for ``platform``."""
  lay = cpjax.ShardLayout(s, s, cp, kind)
  mesh = cp_mesh(cp)
  spec = P(None, "cp")

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  def loss(q, k, v, doc_ids, vg):
    ring = jax.shard_map(
      lambda q, k, v, doc_ids, vg: cpjax.ring_attention(
        q,
        k,
        v,
        layout=lay,
        document_ids=doc_ids,
        vision_group_ids=vg,
        implementation=implementation,
        **mask,
      ),
      mesh=mesh,
      in_specs=spec,
      out_specs=spec,
    )
    return jnp.sum(ring(q, k, v, doc_ids, vg).astype(jnp.float32))

  args = (
    sds((1, s, hq, d), jnp.bfloat16),
    sds((1, s, hkv, d), jnp.bfloat16),
    sds((1, s, hkv, d), jnp.bfloat16),
    sds((1, s), jnp.int32),
    sds((1, s), jnp.int32),
  )
  traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args)
  return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
  "implementation, platform, custom_call",
  [
    ("pallas_tpu", "tpu", "tpu_custom_call"),
    ("pallas_gpu", "cuda", "__gpu$xla.gpu.triton"),
  ],
)
@pytest.mark.parametrize("kind, window", [("load_balanced", None), ("contiguous", 512)])
def test_ring_lowers_with_kernels(implementation, platform, custom_call, kind, window):
  """Forward and backward lower to the three kernels plus collective permutes;
  a silent fallback to the XLA tile loop would show no kernel calls."""
  text = _lowered_ring(implementation, platform, kind=kind, sliding_window=window)
  calls = collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))
  names = collections.Counter(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text))
  # The ring's loop body calls each kernel once per chunk visited in a step,
  # and once more after the loop (two of each with a load-balanced layout,
  # whose hops run in both directions only when windowed).
  assert calls[custom_call] >= 3, calls
  assert {"forward", "dq", "dkdv"} <= set(names), names
  assert "collective_permute" in text
  assert "stablehlo.while" in text


def test_xla_implementation_has_no_kernel_calls():
  text = _lowered_ring("xla", "tpu")
  assert "tpu_custom_call" not in text and "cpjax_ring_" not in text


# -------------------------------------------------------------- bad input
def _ring_call(**kw):
  lay = cpjax.ShardLayout(256, 256, 1, kw.pop("kind", "contiguous"))
  d = kw.pop("d", 32)
  x = jnp.ones((1, lay.padded_seq_len, 2, d), jnp.float32)
  return jax.jit(lambda x: cpjax.ring_attention(x, x, x, layout=lay, **kw))(x)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_pallas_implementation_on_the_wrong_backend_is_a_value_error(implementation):
  with pytest.raises(
    ValueError,
    match=rf"implementation='{implementation}' compiles for .*lowered for "
    r"the 'cpu' backend.*interpret=True",
  ):
    _ring_call(implementation=implementation)


def test_mismatched_platform_when_lowering_for_another_accelerator():
  with pytest.raises(ValueError, match=r"'pallas_gpu' compiles for cuda.*'tpu' backend"):
    _lowered_ring("pallas_gpu", "tpu")


@pytest.mark.parametrize(
  "kw, match",
  [
    (
      dict(implementation="pallas_gpu", d=24),
      r"cannot tile head dim 24: it must be a power "
      r"of two >= 16",
    ),
    (dict(implementation="pallas_gpu", block_kv=8), r"block_kv = 8 must be a power of two >= 16"),
    (dict(implementation="pallas_tpu", block_kv=64), r"block_kv = 64 must be a multiple of 128"),
    (
      dict(implementation="pallas_tpu", block_q=32),
      r"block_q \* G = 32 rows must be a multiple "
      r"of 128",
    ),
    (
      dict(implementation="pallas_tpu", kind="load_balanced", block_q=64),
      r"cannot tile layout.chunk_len=128 .*block_kv=128.*\(a longer sequence",
    ),
    (
      dict(implementation="cuda"),
      r"implementation must be None or one of \('xla', "
      r"'pallas_tpu', 'pallas_gpu'\), got 'cuda'",
    ),
  ],
)
def test_untileable_shapes_are_value_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    _ring_call(interpret=True, **kw)


def test_interpret_must_be_a_bool_or_tpu_interpret_params():
  from jax.experimental.pallas import tpu as pltpu

  with pytest.raises(
    TypeError, match="interpret must be a bool or a pltpu.InterpretParams, got str"
  ):
    _ring_call(implementation="pallas_gpu", interpret="yes")
  with pytest.raises(ValueError, match="it needs implementation='pallas_tpu', got 'pallas_gpu'"):
    _ring_call(implementation="pallas_gpu", interpret=pltpu.InterpretParams())


# ---------------------------------------------------------------- defaults
def test_default_implementation_follows_the_backend(monkeypatch):
  assert resolve_implementation(None) == "xla"  # these tests run on CPU
  for backend, want in (("tpu", "pallas_tpu"), ("gpu", "pallas_gpu"), ("cpu", "xla")):
    monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
    assert resolve_implementation(None) == want


def test_default_tiles_come_from_the_tile_record():
  """Gemma 4's head dims: the record's tile, cut to divide the chunk."""
  from cpjax.attention.ring._schedule import block_sizes

  lay = cpjax.ShardLayout(32768, 32768, 8, "load_balanced")  # chunks of 2048 tokens
  assert block_sizes(lay, "pallas_tpu", 256, 2, None, None) == (256, 512)
  assert block_sizes(lay, "pallas_gpu", 512, 1, None, None) == (16, 16)
  assert block_sizes(lay, "pallas_gpu", 128, 4, None, None) == (32, 64)
  assert block_sizes(lay, "pallas_gpu", 128, 4, None, None, jnp.float32) == (8, 32)
  assert block_sizes(lay, "pallas_gpu", 256, 8, None, None, jnp.bfloat16) == (4, 32)
  assert block_sizes(lay, "xla", 128, 4, None, None) == (128, 128)


@pytest.mark.slow
def test_tpu_kernels_under_the_tpu_interpreter_without_races():
  """The forward, dq and dk/dv kernels on one device (cp = 1: the TPU
  interpreter's ordered callbacks do not pass through shard_map here), with a
  window, four packed documents reordered by document_balanced and padding,
  under Pallas' TPU interpreter, which simulates Mosaic's memory spaces and
  DMAs, with race detection on: values and gradients equal the dense
  reference and no race is reported. Much slower than the HLO interpreter:
  make soak."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
  from jax.experimental.pallas import tpu as pltpu

  rng = np.random.default_rng(11)
  s = 256
  q, k, v, w = H.make_inputs(rng, b=1, s=s, hq=2, hkv=1, d=128)
  meta = H.packed_metadata(rng, 1, s, pad_from=240, n_docs=4)
  lay = cpjax.ShardLayout(s, s, 1, "document_balanced", stripes=2)
  order = cpjax.balance_documents(meta["document_ids"], lay)[0][cpjax.rank_order(lay)]
  params = pltpu.InterpretParams(detect_races=True)

  def ring(q, k, v):
    return cpjax.ring_attention(
      q,
      k,
      v,
      layout=lay,
      causal=True,
      sliding_window=40,
      document_ids=meta["document_ids"][:, order],
      padding_mask=meta["padding_mask"][:, order],
      implementation="pallas_tpu",
      interpret=params,
    )

  qr, kr, vr, wr = (x[:, order] for x in (q, k, v, w))
  out, grads = jax.value_and_grad(lambda *a: jnp.sum(ring(*a) * wr), argnums=(0, 1, 2))(qr, kr, vr)
  out = ring(qr, kr, vr)
  assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
  back = np.argsort(order)
  ref_out, ref_grads = H.reference(q, k, v, w, meta=meta, causal=True, sliding_window=40)
  chex.assert_trees_all_close(np.asarray(out)[:, back], ref_out, **F32)
  for name, got, want in zip("qkv", grads, ref_grads):
    chex.assert_trees_all_close(np.asarray(got)[:, back], want, **F32, custom_message=f"d{name}")
