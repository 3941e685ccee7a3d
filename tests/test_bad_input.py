"""Every public function refuses bad input with an error that names the argument.

Organised by what each function promises: attention inputs, per-token
streams and batches, layouts and ranks, masks, meshes and contexts, Gemma 4.
Each case asserts the exception type and the message. The legitimate edge
cases at the end (one token, an empty batch, mixed float dtypes) must give
correct values, checked against a numpy re-derivation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cpjax
from cpjax.models import gemma4
from tests.helpers import cp_mesh

F = np.float32
LAYOUT1 = cpjax.ShardLayout(8, 8, 1)
LAYOUT2 = cpjax.ShardLayout(8, 8, 2)


def qkv(b=1, s=8, hq=2, hkv=1, d=4, dtype=F):
  x = np.random.default_rng(0).standard_normal((b, s, hq, d)).astype(dtype)
  y = np.random.default_rng(1).standard_normal((b, s, hkv, d)).astype(dtype)
  return x, y, y.copy()


# ------------------------------------------------------- attention inputs
# The same cases through every attention entry point: ring_attention and the
# oracle reference_attention share one validation layer, so they must agree.
def _ring(q, k, v, **kw):
  return cpjax.ring_attention(
    q, k, v, layout=cpjax.ShardLayout(np.shape(q)[1], np.shape(q)[1], 1), **kw
  )


def _reference(q, k, v, **kw):
  return cpjax.reference_attention(q, k, v, **kw)


def _global(q, k, v, **kw):
  lay = cpjax.ShardLayout(np.shape(q)[1], np.shape(q)[1], 2)
  return cpjax.context_parallel_attention(q, k, v, mesh=cp_mesh(2), layout=lay, **kw)


ENTRY_POINTS = {
  "ring_attention": _ring,
  "reference_attention": _reference,
  "context_parallel_attention": _global,
}
q8, k8, v8 = qkv()
ATTENTION_CASES = {
  "3-D q": (
    (q8[0], k8, v8),
    {},
    ValueError,
    r"q must be 4-D \[B, [LS], H, D\], got shape \(8, 2, 4\)",
  ),
  "integer q": (
    (q8.astype(np.int32), k8, v8),
    {},
    TypeError,
    "q must have a floating-point dtype .*got int32",
  ),
  "integer v": (
    (q8, k8, v8.astype(np.int8)),
    {},
    TypeError,
    "v must have a floating-point dtype .*got int8",
  ),
  "not an array": ((q8.tolist(), k8, v8), {}, TypeError, "q must be an array, got list"),
  "k and v differ": ((q8, k8, v8[:, :, :, :2]), {}, ValueError, "k and v must have the same shape"),
  "k/v length differs from q": (
    (q8, k8[:, :6], v8[:, :6]),
    {},
    ValueError,
    r"k/v must have shape \[B, [LS], Hkv, D\] = \[1, 8, Hkv, 4\]",
  ),
  "heads do not divide": (
    (qkv(hq=3, hkv=2)),
    {},
    ValueError,
    r"query heads \(3\) must be a multiple of key/value heads \(2\)",
  ),
  "window 0": (
    (q8, k8, v8),
    {"sliding_window": 0},
    ValueError,
    "sliding_window must be an int >= 1 or None, got 0",
  ),
  "negative window": (
    (q8, k8, v8),
    {"sliding_window": -2},
    ValueError,
    "sliding_window must be an int >= 1 or None, got -2",
  ),
  "float window": (
    (q8, k8, v8),
    {"sliding_window": 2.5},
    ValueError,
    "sliding_window must be an int >= 1 or None, got 2.5",
  ),
  "soft cap 0": (
    (q8, k8, v8),
    {"logits_soft_cap": 0.0},
    ValueError,
    r"logits_soft_cap must be > 0 or None, got 0.0",
  ),
  "negative soft cap": (
    (q8, k8, v8),
    {"logits_soft_cap": -1},
    ValueError,
    r"logits_soft_cap must be > 0 or None, got -1.0",
  ),
  "soft cap inf": (
    (q8, k8, v8),
    {"logits_soft_cap": float("inf")},
    ValueError,
    "logits_soft_cap must be finite, got inf",
  ),
  "scale str": (
    (q8, k8, v8),
    {"scale": "1"},
    TypeError,
    "scale must be a real number or None, got str",
  ),
  "scale nan": ((q8, k8, v8), {"scale": float("nan")}, ValueError, "scale must be finite, got nan"),
  "causal str": ((q8, k8, v8), {"causal": "yes"}, TypeError, "causal must be a bool, got str"),
  "document ids of another length": (
    (q8, k8, v8),
    {"document_ids": np.ones((1, 7), np.int32)},
    ValueError,
    r"mask array document_ids must have shape \[B, [LS]\].* = \[1, 8\], got \[1, 7\]",
  ),
  "float document ids": (
    (q8, k8, v8),
    {"document_ids": np.ones((1, 8), F)},
    TypeError,
    "mask array document_ids must have an integer dtype, got float32",
  ),
  "3-D padding mask": (
    (q8, k8, v8),
    {"padding_mask": np.zeros((1, 8, 1), bool)},
    ValueError,
    r"mask array padding_mask must be 2-D \[B, T\], got shape \[1, 8, 1\]",
  ),
  "integer padding mask": (
    (q8, k8, v8),
    {"padding_mask": np.zeros((1, 8), np.int32)},
    TypeError,
    r"mask array padding_mask must be bool \(True = pad\)",
  ),
  "int64 ids beyond int32": (
    (q8, k8, v8),
    {"document_ids": np.full((1, 8), 2**40)},
    ValueError,
    "mask array document_ids holds values outside int32",
  ),
  "mask and keywords": (
    (q8, k8, v8),
    {"mask": cpjax.AttentionMask.create(), "sliding_window": 3},
    ValueError,
    "pass either mask= or the mask keywords, not both",
  ),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_entry_points_refuse_bad_input(entry, case):
  args, kw, err, match = ATTENTION_CASES[case]
  with pytest.raises(err, match=match):
    ENTRY_POINTS[entry](*args, **kw)


def test_ring_attention_and_its_oracle_say_the_same():
  """One validation layer: the messages are identical, up to the length letter."""
  for case, (args, kw, err, _) in ATTENTION_CASES.items():
    messages = []
    for entry in ("ring_attention", "reference_attention"):
      with pytest.raises(err) as info:
        ENTRY_POINTS[entry](*args, **kw)
      messages.append(
        str(info.value)
        .replace("[B, S", "[B, L")
        .replace("(q's first two dimensions)", "")
        .replace("[B, L] (q's first two dimensions)", "")
      )
    assert messages[0].split(" = ")[0] == messages[1].split(" = ")[0], (case, messages)


def test_flax_attention_fn_refuses_bad_options():
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    cpjax.ring_attention_fn(implementation="triton")
  with pytest.raises(TypeError, match="interpret must be a bool or None, got int"):
    cpjax.ring_attention_fn(interpret=1)
  fn = cpjax.ring_attention_fn(logits_soft_cap=-1.0)
  with pytest.raises(ValueError, match="logits_soft_cap must be > 0"):
    fn(q8, k8, v8)


# ------------------------------------------------ per-token streams, batches
IDS = np.arange(1, 9, dtype=np.int32)[None]
LABELS = np.asarray(cpjax.next_token_labels(IDS))
GOOD = {"input_ids": IDS, "labels": LABELS}
BATCH_CASES = {
  "not a mapping": ([IDS], {}, TypeError, "batch must be a mapping of names to arrays, got list"),
  "no primary stream": (
    {"labels": LABELS},
    {},
    KeyError,
    "batch must hold exactly one of 'input_ids' / 'inputs_embeds'",
  ),
  "both primary streams": (
    {**GOOD, "inputs_embeds": np.ones((1, 8, 4), F)},
    {},
    KeyError,
    "exactly one of",
  ),
  "no labels": ({"input_ids": IDS}, {}, KeyError, "batch has no 'labels'"),
  "float ids": (
    {"input_ids": IDS.astype(F), "labels": LABELS},
    {},
    TypeError,
    "input_ids must have an integer dtype, got float32",
  ),
  "ids beyond int32": (
    {"input_ids": IDS.astype(np.int64) + 2**40, "labels": LABELS},
    {},
    ValueError,
    "input_ids holds values outside int32",
  ),
  "labels [B, S, 1]": (
    {**GOOD, "labels": LABELS[..., None]},
    {},
    ValueError,
    r"labels must be 2-D \[B, S\] = \[1, 8\], got shape \(1, 8, 1\)",
  ),
  "labels of another length": (
    {**GOOD, "labels": LABELS[:, :6]},
    {},
    ValueError,
    "labels must have sequence length 8",
  ),
  "padding mask [B, S, S]": (
    {**GOOD, "padding_mask": np.zeros((1, 8, 8), bool)},
    {},
    ValueError,
    r"padding_mask must be 2-D \[B, S\]",
  ),
  "float padding mask": (
    {**GOOD, "padding_mask": np.zeros((1, 8), F)},
    {},
    TypeError,
    "padding_mask must have a bool or integer dtype, got float32",
  ),
  "document ids [B, S, 1]": (
    {**GOOD, "_packed_seq_ids": np.ones((1, 8, 1), np.int32)},
    {},
    ValueError,
    r"_packed_seq_ids must be 2-D \[B, S\]",
  ),
  "attention mask [B, 2, S, 7]": (
    {**GOOD, "attention_mask": np.ones((1, 2, 8, 7), bool)},
    {},
    ValueError,
    r"attention_mask must be \[B, S\] = \[1, 8\] or "
    r"\[B, H, S, S\] = \[1, 'H', 8, 8\].*got \[1, 2, 8, 7\]",
  ),
  "attention mask of another length": (
    {**GOOD, "attention_mask": np.ones((1, 7), np.int32)},
    {},
    ValueError,
    r"attention_mask must be \[B, S\]",
  ),
  "additive 2-D attention mask": (
    {**GOOD, "attention_mask": np.full((1, 8), -np.inf, F)},
    {},
    ValueError,
    r"a 2-D attention_mask holds 1 \(real token\) "
    r"and 0 \(pad\), got values \[-inf\]",
  ),
  "position ids 4-D": (
    {**GOOD, "position_ids": np.zeros((1, 1, 1, 8), np.int32)},
    {},
    ValueError,
    r"position_ids must be \[B, S\], \[1, S\] or mRoPE",
  ),
  "loss_mask [B, S, 1] with labels": (
    GOOD,
    {"loss_mask": np.ones((1, 8, 1), np.int32)},
    ValueError,
    r"loss_mask must be 2-D \[B, S\]",
  ),
}


@pytest.mark.parametrize("case", BATCH_CASES)
@pytest.mark.parametrize("function", ["normalize_batch", "shard_batch"])
def test_batches_are_checked_before_sharding(case, function):
  batch, kw, err, match = BATCH_CASES[case]
  with pytest.raises(err, match=match):
    if function == "shard_batch":
      cpjax.shard_batch(batch, cp_mesh(2), **kw)
    else:
      cpjax.normalize_batch(batch, **kw)


@pytest.mark.parametrize(
  "kw, err, match",
  [
    ({"padding_token_id": 1.5}, TypeError, "padding_token_id must be an int, got float"),
    ({"padding_token_id": 2**40}, ValueError, "padding_token_id holds values outside int32"),
    (
      {"layout": "zigzag"},
      ValueError,
      r"layout must be one of \('contiguous', 'load_balanced', 'document_balanced'\)",
    ),
    ({"axis_name": "sp"}, ValueError, r"axis_name='sp' is not an axis of the mesh"),
    ({"batch_axis": "cp"}, ValueError, "batch_axis must differ from axis_name"),
    ({"pad_multiple": 0}, ValueError, "pad_multiple must be an int >= 1, got 0"),
    ({"extra_seq_keys": {"nope": 1}}, KeyError, "extra_seq_keys names 'nope'"),
    ({"extra_pad_values": {"labels": 0}}, KeyError, "extra_pad_values names"),
    ({"aux_only": "yes"}, TypeError, r"aux_only must be a bool, got str \('yes'\)"),
  ],
)
def test_shard_batch_options(kw, err, match):
  with pytest.raises(err, match=match):
    cpjax.shard_batch(GOOD, cp_mesh(2), **kw)


def test_shard_batch_needs_a_mesh():
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
    cpjax.shard_batch(GOOD, "cp")


@pytest.mark.parametrize(
  "call, err, match",
  [
    (
      lambda: cpjax.attention_mask_to_padding_mask({"attention_mask": np.ones((1, 8, 8))}),
      ValueError,
      r"attention_mask must be 2-D \[B, S\] or 4-D \[B, H, S, S\], got shape \(1, 8, 8\)",
    ),
    (
      lambda: cpjax.attention_mask_to_padding_mask({"attention_mask": np.ones((1, 2, 8, 7), bool)}),
      ValueError,
      r"a 4-D attention_mask must be \[B, H, S, S\], got shape \(1, 2, 8, 7\)",
    ),
    (
      lambda: cpjax.attention_mask_to_padding_mask(
        {"attention_mask": np.ones((1, 1, 8, 8), np.int32)}
      ),
      TypeError,
      "a 4-D attention_mask must be bool or additive float",
    ),
    (
      lambda: cpjax.attention_mask_to_padding_mask(None),
      TypeError,
      "batch must be a mapping of names to arrays, got NoneType",
    ),
    (
      lambda: cpjax.synthesize_document_ids({"input_ids": IDS[0]}, 8),
      ValueError,
      r"the batch's input_ids must be \[B, S, ...\], got shape \(8,\)",
    ),
    (
      lambda: cpjax.synthesize_document_ids({"input_ids": [[1, 2], [3]]}, 2),
      TypeError,
      r"batch\['input_ids'\] is a list that is not a rectangular array of numbers",
    ),
    (lambda: cpjax.synthesize_document_ids({}, -3), ValueError, "seq_len must be >= 1, got -3"),
    (
      lambda: cpjax.synthesize_document_ids({}, 4.0),
      TypeError,
      "seq_len must be an int, got float",
    ),
    (lambda: cpjax.synthesize_document_ids([IDS], 8), TypeError, "batch must be a mapping"),
    (
      lambda: cpjax.vision_group_ids(np.array([0, 1])),
      ValueError,
      r"mm_token_type_ids must be 2-D \[B, S\], got shape \[2\]",
    ),
    (
      lambda: cpjax.vision_group_ids(np.ones((1, 3), F)),
      TypeError,
      "mm_token_type_ids must have an integer dtype, got float32",
    ),
    (
      lambda: cpjax.next_token_labels(np.ones((1, 4), F)),
      ValueError,
      r"input_ids must be an integer \[B, S\] array, got float32\[1, 4\]",
    ),
    (
      lambda: cpjax.next_token_labels(IDS, IDS[:, :5]),
      ValueError,
      "document_ids must be an integer array shaped like input_ids",
    ),
    (
      lambda: cpjax.next_token_labels(IDS, ignore_index=0.5),
      TypeError,
      "ignore_index must be an int, got float",
    ),
    (
      lambda: cpjax.next_token_labels(IDS.astype(np.int64) - 2**40),
      ValueError,
      "input_ids holds values outside int32",
    ),
  ],
)
def test_stream_helpers(call, err, match):
  with pytest.raises(err, match=match):
    call()


# ---------------------------------------------------------- layouts, ranks
@pytest.mark.parametrize(
  "call, err, match",
  [
    (lambda: cpjax.ShardLayout(8, 8, 2, "zigzag"), ValueError, "kind must be one of"),
    (lambda: cpjax.ShardLayout(8, 6, 2), ValueError, r"padded_seq_len \(6\) must be >= "),
    (lambda: cpjax.ShardLayout(8, 9, 2), ValueError, "padded_seq_len must be a multiple of 2"),
    (lambda: cpjax.ShardLayout(8.0, 8, 2), TypeError, "original_seq_len must be an int, got float"),
    (lambda: cpjax.ShardLayout(8, 8, 0), ValueError, "cp_size must be >= 1, got 0"),
    (lambda: cpjax.padded_length(8, 2, kind="zz"), ValueError, "layout must be one of"),
    (lambda: cpjax.padded_length(0, 2), ValueError, "seq_len must be >= 1, got 0"),
    (
      lambda: cpjax.local_token_indices(LAYOUT2, 1.0),
      TypeError,
      r"rank must be an int or an integer scalar array, got float \(1.0\)",
    ),
    (lambda: cpjax.local_token_indices(LAYOUT2, True), TypeError, "rank must be an int"),
    (lambda: cpjax.local_token_indices(LAYOUT2, 2), ValueError, r"rank must be in \[0, 2\), got 2"),
    (
      lambda: cpjax.local_token_indices(LAYOUT2, jnp.int32(-1)),
      ValueError,
      r"rank must be in \[0, 2\), got -1",
    ),
    (
      lambda: cpjax.local_token_indices("layout", 0),
      TypeError,
      "layout must be a ShardLayout, got str",
    ),
    (lambda: cpjax.rank_order((8, 8, 2)), TypeError, "layout must be a ShardLayout, got tuple"),
    (lambda: cpjax.ring_plan("layout"), TypeError, "layout must be a ShardLayout, got str"),
    (
      lambda: cpjax.ring_plan(LAYOUT2, sliding_window=0),
      ValueError,
      "sliding_window must be an int >= 1",
    ),
    (
      lambda: cpjax.ring_plan(LAYOUT2, mask="causal"),
      TypeError,
      "mask must be an AttentionMask or a MaskRule, got str",
    ),
    (
      lambda: cpjax.ring_plan(LAYOUT2, has_vision_groups="yes"),
      TypeError,
      "has_vision_groups must be a bool, got str",
    ),
    (
      lambda: _ring(*qkv(), axis_name=3),
      TypeError,
      r"axis_name must be a mesh axis name \(str\), got int",
    ),
    (
      lambda: cpjax.to_rank_order(np.ones((1, 7)), LAYOUT2),
      ValueError,
      r"x must have layout.original_seq_len = 8",
    ),
    (
      lambda: cpjax.to_rank_order(np.ones((1, 8)), LAYOUT2, axis=2),
      ValueError,
      r"axis must be an int in \[-2, 2\)",
    ),
    (
      lambda: cpjax.from_rank_order(np.ones((1, 6)), LAYOUT2),
      ValueError,
      "x must have layout.padded_seq_len = 8",
    ),
    (
      lambda: cpjax.from_rank_order(np.ones((1, 8)), "layout"),
      TypeError,
      "layout must be a ShardLayout",
    ),
    (
      lambda: cpjax.shard_sequence(np.ones((1, 8)), LAYOUT2),
      ValueError,
      r"shard_sequence with layout.cp_size=2 must run inside shard_map over a mesh axis 'cp'",
    ),
    (
      lambda: cpjax.shard_sequence(np.ones((1, 8)), LAYOUT1, seq_axis=2),
      ValueError,
      r"seq_axis=2 is not a dimension of x, shape \(1, 8\)",
    ),
    (
      lambda: cpjax.shard_sequence(np.ones((1, 8)), LAYOUT1, seq_axis=1.0),
      TypeError,
      "seq_axis must be an int",
    ),
    (
      lambda: cpjax.shard_sequence(np.ones((1, 5)), LAYOUT1),
      ValueError,
      r"x must have length 8 \(or the padded 8\) on seq_axis=1",
    ),
    (lambda: cpjax.unshard_batch([1], LAYOUT2), TypeError, "batch must be a mapping"),
    (
      lambda: cpjax.unshard_batch({"labels": np.ones((1, 8))}, "layout"),
      TypeError,
      "layout must be a ShardLayout",
    ),
    (
      lambda: cpjax.unshard_batch({"labels": np.ones((1, 6))}, LAYOUT2),
      ValueError,
      "labels must have the padded length 8 on dim 1",
    ),
  ],
)
def test_layouts_and_ranks(call, err, match):
  with pytest.raises(err, match=match):
    call()


def test_ring_attention_checks_the_layout_against_the_mesh():
  q, k, v = qkv(s=8)
  with pytest.raises(
    ValueError, match=r"q must hold layout.local_seq_len = 8 tokens on dim 1, got 4"
  ):
    jax.shard_map(
      lambda q, k, v: cpjax.ring_attention(q, k, v, layout=cpjax.ShardLayout(16, 16, 2)),
      mesh=cp_mesh(2),
      in_specs=jax.P(None, "cp"),
      out_specs=jax.P(None, "cp"),
    )(*(jax.device_put(x, jax.NamedSharding(cp_mesh(2), jax.P(None, "cp"))) for x in (q, k, v)))
  with pytest.raises(ValueError, match=r"layout.cp_size \(4\) must equal the size of mesh axis"):
    jax.shard_map(
      lambda q, k, v: cpjax.ring_attention(q, k, v, layout=cpjax.ShardLayout(8, 8, 4)),
      mesh=cp_mesh(2),
      in_specs=jax.P(None, "cp"),
      out_specs=jax.P(None, "cp"),
    )(*(jax.device_put(x, jax.NamedSharding(cp_mesh(2), jax.P(None, "cp"))) for x in (q, k, v)))


# ------------------------------------------------------------------ masks
@pytest.mark.parametrize(
  "call, err, match",
  [
    (
      lambda: cpjax.AttentionMask.create(document_ids=np.ones((1, 2, 3), np.int32)),
      ValueError,
      r"mask array document_ids must be 2-D \[B, T\], got shape \[1, 2, 3\]",
    ),
    (
      lambda: cpjax.AttentionMask.create(document_ids=np.ones((1, 3), F)),
      TypeError,
      "mask array document_ids must have an integer dtype, got float32",
    ),
    (
      lambda: cpjax.AttentionMask.create(vision_group_ids=np.ones((1, 3), bool)),
      TypeError,
      "mask array vision_group_ids must have an integer dtype, got bool",
    ),
    (
      lambda: cpjax.AttentionMask(cpjax.SameDocument(), {}),
      KeyError,
      r"missing \['document_ids'\]",
    ),
    (
      lambda: cpjax.AttentionMask(cpjax.LocalWindow(), {"x": np.ones((1, 3))}),
      KeyError,
      r"unused \['x'\]",
    ),
    (lambda: cpjax.AttentionMask("causal"), TypeError, "rule must be a MaskRule, got str"),
    (lambda: cpjax.LocalWindow(-1, 0), ValueError, "left must be an int >= 0 or None"),
    (lambda: cpjax.LocalWindow(None, 1.5), ValueError, "right must be an int >= 0 or None"),
    (lambda: cpjax.AllOf(), ValueError, "AllOf needs at least one rule"),
    (
      lambda: cpjax.AnyOf(cpjax.LocalWindow(), "causal"),
      TypeError,
      "AnyOf takes MaskRule objects, got str",
    ),
    (lambda: cpjax.MaskSpec(causal=1), TypeError, r"causal must be a bool, got int \(1\)"),
    (
      lambda: cpjax.AttentionMask.create(sliding_window=3).allowed(),
      ValueError,
      "pass positions: the mask has no per-token array to take T from",
    ),
  ],
)
def test_masks(call, err, match):
  with pytest.raises(err, match=match):
    call()


# ------------------------------------------------------ meshes, contexts
@pytest.mark.parametrize(
  "call, err, match",
  [
    (lambda: cpjax.make_mesh(cp=0), ValueError, "mesh axis 'cp' must be a positive int, got 0"),
    (lambda: cpjax.make_mesh(cp=16), ValueError, "needs 16 devices, 8 available"),
    (
      lambda: cpjax.param_specs({"w": np.ones((4, 4))}, "mesh"),
      TypeError,
      "mesh must be a jax.sharding.Mesh, got str",
    ),
    (
      lambda: cpjax.param_specs({"w": np.ones((4, 4))}, cp_mesh(2), rule="tp"),
      TypeError,
      r"rule must be a function \(path, shape\) -> PartitionSpec, got str",
    ),
    (lambda: cpjax.CPContext((8, 8, 2)), TypeError, "layout must be a ShardLayout, got tuple"),
    (
      lambda: cpjax.CPContext(LAYOUT2, axis_name=3),
      TypeError,
      r"axis_name must be a mesh axis name \(str\), got int",
    ),
    (
      lambda: cpjax.CPContext(LAYOUT2, implementation="gpu"),
      ValueError,
      "implementation must be None or one of",
    ),
    (lambda: cpjax.CPContext(LAYOUT2, interpret="no"), TypeError, "interpret must be a bool"),
    (lambda: cpjax.ContextParallelSharder(3), TypeError, "shard_batch must be callable, got 3"),
    (
      lambda: cpjax.make_mesh(cp=2, devices=[0, 1]),
      TypeError,
      r"devices must be jax.Device objects \(jax.devices\(\)\), got \['int'\]",
    ),
    (
      lambda: cpjax.shard_params({"w": np.ones(4)}, "mesh", {"w": jax.P()}),
      TypeError,
      "mesh must be a jax.sharding.Mesh, got str",
    ),
    (
      lambda: cpjax.shard_params({"w": np.ones(4)}, cp_mesh(2), {"v": jax.P()}),
      ValueError,
      "specs must have the tree structure of params",
    ),
    (
      lambda: cpjax.shard_like_params({"mu": np.ones(4)}, {"w": np.ones(4)}),
      TypeError,
      "params must be a non-empty tree of arrays placed on a mesh",
    ),
  ],
)
def test_meshes_and_contexts(call, err, match):
  with pytest.raises(err, match=match):
    call()


# --------------------------------------------------------------- Gemma 4
CFG = gemma4.Gemma4Config.preset("tiny")


@pytest.mark.parametrize(
  "call, err, match",
  [
    (lambda: gemma4.prepare_batch([IDS], CFG), TypeError, "batch must be a mapping"),
    (
      lambda: gemma4.prepare_batch({"input_ids": IDS}, "tiny"),
      TypeError,
      "config must be a Gemma4Config or None, got str",
    ),
    (
      lambda: gemma4.prepare_batch({"input_ids": IDS + 10**6}, CFG),
      ValueError,
      r"input_ids holds token ids outside the vocabulary \[0, 512\)",
    ),
    (
      lambda: gemma4.prepare_batch({"input_ids": IDS.astype(F)}, CFG),
      TypeError,
      "input_ids must have an integer dtype",
    ),
    (
      lambda: gemma4.prepare_batch({"input_ids": IDS, "input_features": np.ones((1, 4))}, CFG),
      ValueError,
      "batch key 'input_features' is not supported",
    ),
    (
      lambda: gemma4.synthetic_batch(0, CFG, batch_size=1, seq_len=8),
      TypeError,
      r"rng must be a numpy Generator \(np.random.default_rng\(seed\)\), got int",
    ),
    (
      lambda: gemma4.synthetic_batch(np.random.default_rng(0), CFG, batch_size=-1, seq_len=8),
      ValueError,
      "batch_size must be >= 1, got -1",
    ),
    (
      lambda: gemma4.synthetic_batch(np.random.default_rng(0), CFG, batch_size=1, seq_len=8.0),
      TypeError,
      "seq_len must be an int, got float",
    ),
    (
      lambda: gemma4.synthetic_batch(np.random.default_rng(0), "tiny", batch_size=1, seq_len=8),
      TypeError,
      "config must be a Gemma4Config, got str",
    ),
    (
      lambda: gemma4.prepare_batch({"input_ids": [["a", "b"]]}, CFG),
      TypeError,
      r"batch\['input_ids'\] is a list that is not a rectangular array of numbers \(numpy "
      r"reads it as <U1\)",
    ),
    (lambda: gemma4.Gemma4Config.preset("huge"), KeyError, "unknown Gemma 4 preset 'huge'"),
    (lambda: gemma4.check_mesh(CFG, "mesh"), TypeError, "mesh must be a jax.sharding.Mesh"),
    (lambda: gemma4.check_mesh("tiny", cp_mesh(2)), TypeError, "cfg must be a Gemma4Config"),
    (
      lambda: gemma4.check_mesh(CFG, cp_mesh(2), seq_len=0),
      ValueError,
      "seq_len must be >= 1, got 0",
    ),
    (lambda: gemma4.partition_rule(CFG, tp=0), ValueError, "tp must be >= 1, got 0"),
    (lambda: gemma4.partition_rule(CFG, tp=2.0), TypeError, "tp must be an int, got float"),
    (
      lambda: gemma4.gemma4_masks(
        CFG, document_ids=np.ones(8, np.int32), padding_mask=np.zeros(8, bool)
      ),
      ValueError,
      r"mask array (document_ids|padding_mask) must be 2-D \[B, T\]",
    ),
    (
      lambda: gemma4.gemma4_masks(
        CFG, document_ids=np.ones((1, 8), F), padding_mask=np.zeros((1, 8), bool)
      ),
      TypeError,
      "mask array document_ids must have an integer dtype, got float32",
    ),
  ],
)
def test_gemma4_helpers(call, err, match):
  with pytest.raises(err, match=match):
    call()


def test_gemma4_model_call_names_what_the_batch_lacks():
  model = gemma4.Gemma4(CFG, rngs=nnx.Rngs(0))
  with pytest.raises(
    KeyError,
    match=r"the model's batch lacks \['position_ids', "
    r"'padding_mask', '_packed_seq_ids'\]: pass a batch "
    r"through gemma4.prepare_batch",
  ):
    model({"input_ids": IDS})
  with pytest.raises(TypeError, match="cp must be a cpjax.CPContext or None, got ShardLayout"):
    model(gemma4.prepare_batch({"input_ids": IDS}, CFG), cp=LAYOUT1)
  with pytest.raises(ValueError, match="layout must be one of"):
    gemma4.cp_logits(
      model, gemma4.prepare_batch({"input_ids": IDS}, CFG), cp_mesh(2), layout="zigzag"
    )
  with pytest.raises(
    ValueError,
    match=r"layout must be one of \('contiguous', 'load_balanced', 'document_balanced'\)",
  ):
    model.prepare_model_inputs_for_cp(layout="zigzag")


# ------------------------------------------------------------ edge cases
def numpy_attention(q, k, v):
  """Causal softmax attention in float64 numpy, GQA by repetition."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  t = q.shape[1]
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize(
  "shape",
  [dict(b=1, s=1), dict(b=0, s=8), dict(b=2, s=8)],
  ids=["one token", "empty batch", "plain"],
)
@pytest.mark.parametrize("entry", ["ring_attention", "reference_attention"])
def test_edge_shapes_give_correct_values(shape, entry):
  q, k, v = qkv(hq=4, hkv=2, **shape)
  out = ENTRY_POINTS[entry](q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_allclose(out, numpy_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", ["ring_attention", "reference_attention"])
def test_mixed_float_dtypes_follow_q(entry):
  """q float32, k bfloat16, v float16: computed from the given values, out in q's dtype."""
  q, k, v = qkv(hq=4, hkv=2)
  k16, v16 = k.astype(jnp.bfloat16), v.astype(np.float16)
  out = ENTRY_POINTS[entry](q, k16, v16)
  assert out.dtype == np.float32
  # The reference is the float64 numpy attention of exactly the rounded k and v.
  want = numpy_attention(q, np.asarray(k16, F), np.asarray(v16, F))
  # The ring rounds its softmax weights to v's dtype (float16: 2^-11 relative)
  # before P @ V, as flash kernels do; that alone is its error here (1.7e-4).
  tol = 4e-4 if entry == "ring_attention" else 1e-5
  np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


def test_batch_edges_shard_and_come_back():
  """One token and an empty batch shard, pad and unshard to the numpy original."""
  mesh = cp_mesh(2)
  one = {"input_ids": np.array([[7]], np.int32), "labels": np.array([[-100]], np.int32)}
  out, lay = cpjax.shard_batch(one, mesh)
  assert lay.padded_seq_len == 4
  # Rank order of the load-balanced layout: global tokens 0, 3 | 1, 2; only token 0 is real.
  np.testing.assert_array_equal(cpjax.rank_order(lay), [0, 3, 1, 2])
  np.testing.assert_array_equal(np.asarray(out["padding_mask"]), [[False, True, True, True]])
  back = cpjax.unshard_batch(out, lay)
  np.testing.assert_array_equal(np.asarray(back["input_ids"]), one["input_ids"])
  empty = {"input_ids": np.zeros((0, 6), np.int32), "labels": np.zeros((0, 6), np.int32)}
  out, lay = cpjax.shard_batch(empty, mesh)
  assert out["labels"].shape == (0, 8)
  assert cpjax.unshard_batch(out, lay)["labels"].shape == (0, 6)
