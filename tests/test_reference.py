"""The oracle itself, against hand-worked cases and a numpy re-derivation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpjax


def np_attention(q, k, v, allowed, scale=None, cap=None):
  """Loop-free numpy softmax attention with an explicit bool[B, S, S] mask."""
  b, s, hq, d = q.shape
  g = hq // k.shape[2]
  k = np.repeat(k, g, axis=2)
  v = np.repeat(v, g, axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if scale is None else scale)
  if cap is not None:
    logits = cap * np.tanh(logits / cap)
  allowed = allowed[:, None]
  logits = np.where(allowed, logits, -np.inf)
  mx = np.max(logits, axis=-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  e = np.where(allowed, np.exp(logits - mx), 0.0)
  den = e.sum(-1, keepdims=True)
  p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_hand_worked_two_tokens():
  # Equal logits: token 0 sees only itself, token 1 averages values 1 and 3.
  q = k = np.zeros((1, 2, 1, 1), np.float32)
  v = np.array([1.0, 3.0], np.float32).reshape(1, 2, 1, 1)
  assert np.asarray(cpjax.reference_attention(q, k, v)).ravel().tolist() == [1.0, 2.0]
  assert np.asarray(cpjax.reference_attention(q, k, v, causal=False)).ravel().tolist() == [2.0, 2.0]


def test_hand_worked_softmax_weights():
  # One query, keys with logits 0 and log(3): weights 1/4 and 3/4.
  q = np.array([[[[1.0]]], [[[1.0]]]], np.float32).reshape(1, 2, 1, 1)
  k = np.array([0.0, np.log(3.0)], np.float32).reshape(1, 2, 1, 1)
  v = np.array([4.0, 8.0], np.float32).reshape(1, 2, 1, 1)
  out = np.asarray(cpjax.reference_attention(q, k, v, scale=1.0))
  np.testing.assert_allclose(out.ravel(), [4.0, 0.25 * 4 + 0.75 * 8], rtol=1e-6)


def test_hand_worked_masks():
  """A 6-token row: documents [1,1,1,2,2,0], window 2, an image at tokens 1-2."""
  s = 6
  doc_ids = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
  vg = np.array([[-1, 0, 0, -1, -1, -1]], np.int32)
  # Probe the mask through v = one-hot of the key position and equal logits:
  # out[q] is the uniform distribution over allowed keys.
  q = k = np.zeros((1, s, 1, s), np.float32)
  v = np.eye(s, dtype=np.float32)[None, :, None, :]
  out = np.asarray(
    cpjax.reference_attention(q, k, v, sliding_window=2, document_ids=doc_ids, vision_group_ids=vg)
  )[0, :, 0]
  allowed = (out > 0).astype(int).tolist()
  assert allowed == [
    [1, 0, 0, 0, 0, 0],  # token 0: itself
    [1, 1, 1, 0, 0, 0],  # token 1: window {0, 1} plus its image partner 2
    [0, 1, 1, 0, 0, 0],  # token 2: window {1, 2} (image 1 is inside it)
    [0, 0, 0, 1, 0, 0],  # token 3: new document
    [0, 0, 0, 1, 1, 0],  # token 4
    [0, 0, 0, 0, 0, 0],  # token 5: document 0 = pad, nothing
  ]
  np.testing.assert_allclose(out[1], [1 / 3, 1 / 3, 1 / 3, 0, 0, 0], rtol=1e-6)


def test_padding_mask_masks_keys_only():
  q = k = np.zeros((1, 3, 1, 3), np.float32)
  v = np.eye(3, dtype=np.float32)[None, :, None, :]
  pad = np.array([[False, True, False]])
  out = np.asarray(cpjax.reference_attention(q, k, v, padding_mask=pad))[0, :, 0]
  np.testing.assert_allclose(out, [[1, 0, 0], [1, 0, 0], [0.5, 0, 0.5]], rtol=1e-6)


@pytest.mark.parametrize(
  "causal, window, cap, g",
  [(True, None, None, 1), (False, 3, None, 2), (True, 4, 5.0, 4), (False, None, 2.0, 2)],
)
def test_matches_numpy(causal, window, cap, g):
  rng = np.random.default_rng(0)
  b, s, hkv, d = 2, 12, 2, 4
  q = rng.standard_normal((b, s, hkv * g, d)).astype(np.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  doc_ids = np.array([[1] * 5 + [2] * 5 + [0] * 2, [3] * 12], np.int32)
  i, j = np.arange(s)[:, None], np.arange(s)[None]
  allowed = (j <= i) if causal else np.ones((s, s), bool)
  if window:
    allowed = allowed & (((i - j) if causal else np.abs(i - j)) < window)
  allowed = allowed[None] & (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] > 0)
  want = np_attention(q, k, v, allowed, cap=cap)
  got = cpjax.reference_attention(
    q, k, v, causal=causal, sliding_window=window, document_ids=doc_ids, logits_soft_cap=cap
  )
  chex.assert_trees_all_close(got, want.astype(np.float32), rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_with_zero_gradient():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 1, 2)), jnp.float32) for _ in range(3))
  doc_ids = np.array([[1, 1, 0, 0]], np.int32)
  f = lambda q: cpjax.reference_attention(q, k, v, document_ids=doc_ids)
  out = f(q)
  chex.assert_trees_all_equal(out[0, 2:], jnp.zeros((2, 1, 2)))
  grad = jax.grad(lambda q: jnp.sum(f(q)))(q)
  chex.assert_tree_all_finite(grad)
  chex.assert_trees_all_equal(grad[0, 2:], jnp.zeros((2, 1, 2)))


def test_mask_object_equals_the_keywords():
  """AttentionMask.create goes through the rule objects; the keywords through
  the formula written out in reference.py: the two must agree."""
  rng = np.random.default_rng(2)
  q, k, v = (rng.standard_normal((2, 10, 2, 4)).astype(np.float32) for _ in range(3))
  meta = {
    "document_ids": np.array([[1] * 6 + [2] * 3 + [0], [1] * 10], np.int32),
    "padding_mask": np.array([[False] * 9 + [True], [False] * 8 + [True] * 2]),
    "vision_group_ids": np.array([[-1, 0, 0, 0, -1, -1, 1, 1, -1, -1], [-1] * 10], np.int32),
  }
  for causal, window in ((True, 3), (False, None), (False, 2)):
    want = cpjax.reference_attention(q, k, v, causal=causal, sliding_window=window, **meta)
    mask = cpjax.AttentionMask.create(causal=causal, sliding_window=window, **meta)
    chex.assert_trees_all_equal(cpjax.reference_attention(q, k, v, mask=mask), want)
