"""Batch normalisation against hand-worked cases from the original's tests."""

import chex
import jax
import numpy as np
import pytest

import cpjax


def test_document_ids_from_padding_mask():
  pad = np.array([[0, 0, 0, 0, 1, 1]], bool)
  out = cpjax.synthesize_document_ids(
    {"input_ids": np.zeros((1, 6), np.int32), "padding_mask": pad}, 6
  )
  assert np.asarray(out["_packed_seq_ids"]).tolist() == [[1, 1, 1, 1, 0, 0]]


def test_document_ids_default_all_ones_and_no_op_when_present():
  batch = {"input_ids": np.zeros((2, 5), np.int32)}
  out = cpjax.synthesize_document_ids(batch, 5)
  chex.assert_trees_all_equal(out["_packed_seq_ids"], np.ones((2, 5), np.int32))
  assert "_packed_seq_ids" not in batch  # the input is not mutated
  packed = {"input_ids": batch["input_ids"], "_packed_seq_ids": np.array([[1, 1, 2, 2, 0]] * 2)}
  assert cpjax.synthesize_document_ids(packed, 5)["_packed_seq_ids"] is packed["_packed_seq_ids"]


@pytest.mark.parametrize(
  "mask, expected",
  [
    (np.array([[1, 1, 1, 0]]), [[False, False, False, True]]),
    # 4-D bool: diagonal of mask[:, 0] (True = attend).
    (
      np.array([[[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]]], bool),
      [[False, False, False, True]],
    ),
    # 4-D additive: 0 = attend, large negative = masked.
    (
      np.where(np.eye(4, dtype=bool)[None, None] & (np.arange(4) < 2), 0.0, -1e9),
      [[False, False, True, True]],
    ),
  ],
)
def test_attention_mask_to_padding_mask(mask, expected):
  batch = {"attention_mask": mask}
  out = cpjax.attention_mask_to_padding_mask(batch)
  assert "attention_mask" not in out and "attention_mask" in batch
  assert np.asarray(out["padding_mask"]).tolist() == expected


def test_existing_padding_mask_wins():
  pad = np.array([[False, True]])
  out = cpjax.attention_mask_to_padding_mask(
    {"attention_mask": np.ones((1, 2)), "padding_mask": pad}
  )
  assert out["padding_mask"] is pad and "attention_mask" not in out


def test_attention_mask_bad_rank():
  with pytest.raises(ValueError, match=r"attention_mask must be 2-D .* got shape \(1, 2, 2\)"):
    cpjax.attention_mask_to_padding_mask({"attention_mask": np.ones((1, 2, 2))})


def test_vision_group_ids():
  got = cpjax.vision_group_ids(np.array([[0, 1, 1, 0, 2, 2], [1, 2, 0, 0, 1, 0]]))
  assert np.asarray(got).tolist() == [[-1, 0, 0, -1, 1, 1], [0, 0, -1, -1, 1, -1]]


def test_next_token_labels_never_cross_documents():
  ids = np.array([[10, 11, 12, 13, 14, 15, 0, 0]], np.int32)
  docs = np.array([[1, 1, 1, 2, 2, 3, 0, 0]], np.int32)
  got = np.asarray(cpjax.next_token_labels(ids, docs)).tolist()
  assert got == [[11, 12, -100, 14, -100, -100, -100, -100]]
  plain = np.asarray(cpjax.next_token_labels(ids, ignore_index=-1)).tolist()
  assert plain == [[11, 12, 13, 14, 15, 0, 0, -1]]


def test_normalize_defaults_and_validation():
  batch = {
    "input_ids": np.arange(8, dtype=np.int32).reshape(2, 4),
    "position_ids": np.arange(4, dtype=np.int32)[None],
  }
  out = cpjax.normalize_batch(batch, loss_mask=np.array([[1, 1, 0, 0]] * 2, bool))
  chex.assert_trees_all_equal(out["position_ids"], np.tile(np.arange(4, dtype=np.int32), (2, 1)))
  chex.assert_trees_all_equal(out["labels"], np.array([[1, 1, 0, 0]] * 2, np.int32))
  chex.assert_trees_all_equal(out["padding_mask"], np.zeros((2, 4), bool))
  assert "loss_mask" not in out
  with pytest.raises(KeyError, match="no 'labels'"):
    cpjax.normalize_batch(batch)
  with pytest.raises(TypeError, match="labels must have an integer dtype, got float32"):
    cpjax.normalize_batch({**batch, "labels": np.zeros((2, 4), np.float32)})
  with pytest.raises(TypeError, match="input_ids must have an integer dtype"):
    cpjax.normalize_batch({"input_ids": np.zeros((2, 4), np.float32), "labels": batch["input_ids"]})


def test_normalize_is_jittable():
  batch = {
    "input_ids": np.arange(8, dtype=np.int32).reshape(2, 4),
    "attention_mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0]]),
  }
  eager = cpjax.normalize_batch(batch, loss_mask=batch["attention_mask"])
  jitted = jax.jit(lambda b: cpjax.normalize_batch(b, loss_mask=b["attention_mask"]))(batch)
  chex.assert_trees_all_equal(eager, jitted)


def test_the_originals_answers_on_inputs_it_accepts():
  """Four inputs the original accepts, with its answers (replayed from its code):
  a 4-D mask with several heads reads head 0; mm_token_type_ids codes other
  than 1 and 2 are not vision; seq_len makes only the all-ones ids; and
  lists are taken as numpy takes them."""
  from cpjax.models import gemma4

  head0 = np.tril(np.ones((6, 6), bool)) & (np.arange(6) < 4)
  mask = np.stack([head0, np.ones((6, 6), bool)])[None]  # head 1 says "no padding"
  assert np.asarray(
    cpjax.attention_mask_to_padding_mask({"attention_mask": mask})["padding_mask"]
  ).tolist() == [[False] * 4 + [True] * 2]
  batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None], "attention_mask": mask}
  back = cpjax.unshard_batch(
    *cpjax.shard_batch(batch, jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2]))
  )
  assert np.asarray(back["padding_mask"]).tolist() == [[False] * 4 + [True] * 2]

  # transformers' processor writes 3 on audio tokens: not a vision group.
  types = np.array([[0, 1, 1, 3, 3, 2, 2, 0, 5]])
  assert np.asarray(cpjax.vision_group_ids(types)).tolist() == [[-1, 0, 0, -1, -1, 1, 1, -1, -1]]

  # The seed's function takes both, with the same answers.
  mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
  seed, _ = gemma4.make_contiguous_aux_only_shard_cp_batch(
    mesh,
    {
      "input_ids": np.arange(6)[None],
      "labels": np.arange(6)[None],
      "attention_mask": mask,
      "mm_token_type_ids": np.array([[0, 1, 3, 3, 2, 0]]),
    },
  )
  # padded to 8 = a multiple of 2 cp
  assert np.asarray(seed["_packed_seq_ids"]).tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]]
  assert np.asarray(seed["padding_mask"]).tolist() == [[False] * 4 + [True] * 4]

  for synthesize in (cpjax.synthesize_document_ids, gemma4.synthesize_single_document_seq_ids):
    ones = synthesize({"input_ids": np.zeros((2, 6), np.int32)}, 8)["_packed_seq_ids"]
    chex.assert_trees_all_equal(ones, np.ones((2, 8), np.int32))
    pad = np.array([[False, False, True]])
    from_pad = synthesize({"input_ids": np.zeros((1, 3), np.int32), "padding_mask": pad}, 8)
    assert np.asarray(from_pad["_packed_seq_ids"]).tolist() == [[1, 1, 0]]

  as_lists = {
    "input_ids": [[5, 6, 7, 8]],
    "labels": [[6, 7, 8, -100]],
    "attention_mask": [[1, 1, 1, 0]],
  }
  as_numpy = {k: np.asarray(v) for k, v in as_lists.items()}
  chex.assert_trees_all_equal(cpjax.normalize_batch(as_lists), cpjax.normalize_batch(as_numpy))
  chex.assert_trees_all_equal(gemma4.prepare_batch(as_lists), gemma4.prepare_batch(as_numpy))
