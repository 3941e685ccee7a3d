"""Mask rules: token predicate against numpy, block classifier and reach against the predicate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpjax
from cpjax.masks import Tokens

KINDS = ("contiguous", "load_balanced")


def np_standard_mask(s, *, causal=True, window=None, doc_ids=None, pad=None, vg=None):
  """bool[B, S, S] of the standard rule, one pair at a time."""
  rows = next((x.shape[0] for x in (doc_ids, pad, vg) if x is not None), 1)
  out = np.zeros((rows, s, s), bool)
  for b in range(rows):
    for i in range(s):
      for j in range(s):
        ok = (j <= i) if causal else True
        if window is not None:
          ok = ok and ((i - j) < window if causal else abs(i - j) < window)
        if vg is not None:
          ok = ok or (vg[b, i] == vg[b, j] and vg[b, i] >= 0)
        if doc_ids is not None:
          ok = ok and doc_ids[b, i] == doc_ids[b, j] and doc_ids[b, i] > 0
        if pad is not None:
          ok = ok and not pad[b, j]
        out[b, i, j] = ok
  return out


def random_arrays(rng, b, s, *, docs=True, pad=True, vision=True):
  arrays = {}
  if docs:
    cuts = np.sort(rng.integers(0, s, (b, 3)), axis=1)
    arrays["document_ids"] = (1 + (np.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1)).astype(
      np.int32
    )
  if pad:
    tail = rng.integers(0, s // 2 + 1)
    p = np.zeros((b, s), bool)
    p[:, s - tail :] = True
    p |= rng.random((b, s)) < 0.1  # stray pads too: the classifier must not care
    arrays["padding_mask"] = p
    if docs:
      arrays["document_ids"] = np.where(p, 0, arrays["document_ids"]).astype(np.int32)
  if vision:
    types = (rng.random((b, s)) < 0.3).astype(np.int32)
    arrays["vision_group_ids"] = np.asarray(cpjax.vision_group_ids(types))
  return arrays


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
@pytest.mark.parametrize("with_arrays", [False, True])
def test_standard_mask_matches_numpy(causal, window, with_arrays):
  s = 12
  arrays = random_arrays(np.random.default_rng(0), 2, s) if with_arrays else {}
  mask = cpjax.AttentionMask.create(causal=causal, sliding_window=window, **arrays)
  want = np_standard_mask(
    s,
    causal=causal,
    window=window,
    doc_ids=arrays.get("document_ids"),
    pad=arrays.get("padding_mask"),
    vg=arrays.get("vision_group_ids"),
  )
  got = np.asarray(jnp.broadcast_to(mask.allowed(np.arange(s)), want.shape))
  np.testing.assert_array_equal(got, want)


def test_rule_tree_of_the_standard_mask():
  arrays = random_arrays(np.random.default_rng(1), 1, 8)
  mask = cpjax.AttentionMask.create(sliding_window=4, **arrays)
  assert mask.rule == cpjax.AllOf(
    cpjax.AnyOf(cpjax.LocalWindow(3, 0), cpjax.SameVisionGroup()),
    cpjax.SameDocument(),
    cpjax.KeyNotPadding(),
  )
  assert hash(mask.rule) == hash(
    (cpjax.LocalWindow(3, 0) | cpjax.SameVisionGroup())
    & cpjax.SameDocument()
    & cpjax.KeyNotPadding()
  )
  assert sorted(mask.arrays) == ["document_ids", "padding_mask", "vision_group_ids"]


def test_mask_is_a_pytree_with_a_static_rule():
  mask = cpjax.AttentionMask.create(document_ids=np.array([[1, 1, 2, 2]]))
  leaves, treedef = jax.tree.flatten(mask)
  assert len(leaves) == 1 and leaves[0].shape == (1, 4)
  back = jax.tree.unflatten(treedef, leaves)
  assert back.rule == mask.rule
  traced = jax.jit(lambda m: m.allowed(jnp.arange(4)))(mask)
  chex.assert_trees_all_equal(traced, mask.allowed(np.arange(4)))


def test_gemma4_vision_rule_is_one_expression():
  """Gemma 4's sliding layers: (k > q - W) and (k <= q or same image); the
  window still cuts earlier image tokens but never later ones."""
  w, s = 3, 10
  vg = np.full((1, s), -1, np.int32)
  vg[0, 2:9] = 0
  rule = cpjax.LocalWindow(w - 1, None) & (cpjax.LocalWindow(None, 0) | cpjax.SameVisionGroup())
  mask = cpjax.AttentionMask(rule, {"vision_group_ids": vg})
  got = np.asarray(mask.allowed())[0]
  for i in range(s):
    for j in range(s):
      same = vg[0, i] == vg[0, j] and vg[0, i] >= 0
      assert got[i, j] == ((j > i - w) and (j <= i or same)), (i, j)
  assert rule.reach() == cpjax.masks.Reach(w - 1, None)
  lay = cpjax.ShardLayout(64, 64, 8, "contiguous")
  assert cpjax.ring_plan(lay, mask=rule) == cpjax.RingPlan(7, 0)  # later image tokens: any rank


# ------------------------------------------------------- classifier and reach
RULES = {
  "causal": cpjax.LocalWindow(None, 0),
  "full": cpjax.LocalWindow(None, None),
  "window": cpjax.LocalWindow(4, 0),
  "bidirectional_window": cpjax.LocalWindow(2, 2),
  "standard": (
    (cpjax.LocalWindow(5, 0) | cpjax.SameVisionGroup())
    & cpjax.SameDocument()
    & cpjax.KeyNotPadding()
  ),
  "gemma4_vision": (
    cpjax.LocalWindow(3, None)
    & (cpjax.LocalWindow(None, 0) | cpjax.SameVisionGroup())
    & cpjax.SameDocument()
  ),
  "documents_or_images": cpjax.SameDocument() | cpjax.SameVisionGroup(),
}


@given(
  rule=st.sampled_from(sorted(RULES)),
  cp=st.sampled_from([1, 2, 4]),
  kind=st.sampled_from(KINDS),
  chunk=st.sampled_from([4, 6, 8]),
  block_q=st.sampled_from([1, 2, 4]),
  block_kv=st.sampled_from([1, 2, 4]),
  q_rank=st.integers(0, 3),
  k_rank=st.integers(0, 3),
  seed=st.integers(0, 2**16),
)
def test_block_classifier_never_contradicts_the_token_predicate(
  rule, cp, kind, chunk, block_q, block_kv, q_rank, k_rank, seed
):
  """ "Empty" never hides an allowed pair, "full" never covers a masked pair."""
  if chunk % block_q or chunk % block_kv:
    block_q, block_kv = 2, 2
  rule = RULES[rule]
  chunks = cp * (2 if kind == "load_balanced" else 1)
  s = chunks * chunk
  lay = cpjax.ShardLayout(s, s, cp, kind)
  arrays = random_arrays(np.random.default_rng(seed), 2, s)
  arrays = {name: arrays[name] for name in rule.array_kinds()}
  order = cpjax.rank_order(lay)
  l = lay.local_seq_len

  def tokens(rank):
    sl = order[(rank % cp) * l : (rank % cp + 1) * l]  # the global tokens this rank holds
    return Tokens(jnp.asarray(sl, jnp.int32), {n: jnp.asarray(x[:, sl]) for n, x in arrays.items()})

  q, k = tokens(q_rank), tokens(k_rank)
  allowed = np.asarray(jnp.broadcast_to(rule.allowed(q, k), (2, l, l)))
  blocks = rule.classify(q, k, block_q, block_kv)
  some = np.asarray(jnp.broadcast_to(blocks.any, (2, l // block_q, l // block_kv)))
  every = np.asarray(jnp.broadcast_to(blocks.all, some.shape))
  tiles = allowed.reshape(2, l // block_q, block_q, l // block_kv, block_kv)
  truly_any = tiles.any(axis=(2, 4))
  truly_all = tiles.all(axis=(2, 4))
  assert not np.any(truly_any & ~some), "a block called empty has an allowed pair"
  assert not np.any(every & ~truly_all), "a block called full has a masked pair"
  # Reach: every allowed pair lies within it.
  behind, ahead = rule.reach()
  dist = np.asarray(q.positions)[:, None] - np.asarray(k.positions)[None, :]
  if behind is not None:
    assert not np.any(allowed & (dist > behind)[None])
  if ahead is not None:
    assert not np.any(allowed & (-dist > ahead)[None])


def test_classifier_is_exact_on_consecutive_positions():
  """Tiles of consecutive positions: causal and window blocks are classified exactly."""
  t = Tokens(jnp.arange(8), {})
  states = cpjax.LocalWindow(2, 0).classify(t, t, 2, 2).states()[0]
  # rows: query blocks [0,1] [2,3] [4,5] [6,7]; window 3 tokens (q - k <= 2)
  assert np.asarray(states).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


# ------------------------------------------------------------------ bad input
def test_bad_masks():
  with pytest.raises(
    KeyError,
    match=r"reads per-token arrays \['document_ids'\], got arrays "
    r"\[\] \(missing \['document_ids'\]",
  ):
    cpjax.AttentionMask(cpjax.SameDocument())
  with pytest.raises(KeyError, match=r"unused \['padding_mask'\]"):
    cpjax.AttentionMask(cpjax.LocalWindow(), {"padding_mask": np.zeros((1, 4), bool)})
  with pytest.raises(TypeError, match="rule must be a MaskRule, got str"):
    cpjax.AttentionMask("causal")

  class FloatRule(cpjax.SameDocument):
    arrays = {"weights": "float"}

  with pytest.raises(ValueError, match=r"kinds must be one of \('int', 'bool'\), got \{'weights'"):
    cpjax.AttentionMask(FloatRule(), {"weights": np.zeros((1, 4))})
  with pytest.raises(ValueError, match="left must be an int >= 0 or None"):
    cpjax.LocalWindow(-1, 0)
  with pytest.raises(TypeError, match="AllOf takes MaskRule objects, got int"):
    cpjax.AllOf(cpjax.LocalWindow(), 3)
  mask = cpjax.AttentionMask.create(document_ids=np.zeros((2, 5), np.int32))
  with pytest.raises(
    ValueError,
    match=r"mask array document_ids must have shape \[B, S\] = "
    r"\[2, 6\], got \[2, 5\]",
  ):
    mask.validate(2, 6)
  with pytest.raises(
    TypeError, match="mask array document_ids must have an integer dtype, got float32"
  ):
    cpjax.AttentionMask.create(document_ids=np.zeros((2, 5), np.float32)).validate(2, 5)
  with pytest.raises(
    TypeError,
    match=r"mask array padding_mask must be bool \(True = pad\), "
    "got int32",
  ):
    cpjax.AttentionMask.create(padding_mask=np.zeros((2, 5), np.int32)).validate(2, 5)
  with pytest.raises(
    ValueError,
    match=r"pass either mask= or the mask keywords, not both; "
    r"got mask and \['sliding_window'\]",
  ):
    cpjax.masks.resolve_mask(mask, sliding_window=3)
  with pytest.raises(TypeError, match=r"unexpected mask keyword\(s\) \['window'\]"):
    cpjax.masks.resolve_mask(window=3)
