"""ShardLayout and local_token_indices against hand-worked and numpy-derived maps."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpjax


def _expected_indices(padded: int, cp: int, kind: str, rank: int) -> list[int]:
  """Independent re-derivation by enumerating chunk owners."""
  if kind == "contiguous":
    n = padded // cp
    return [t for t in range(padded) if t // n == rank]
  c = padded // (2 * cp)
  owner_chunks = [rank, 2 * cp - 1 - rank]
  return [t for ch in owner_chunks for t in range(padded) if t // c == ch]


def test_hand_worked_maps():
  lay = cpjax.ShardLayout(6, 8, 2, "load_balanced")
  assert [np.asarray(cpjax.local_token_indices(lay, r)).tolist() for r in range(2)] == [
    [0, 1, 6, 7],
    [2, 3, 4, 5],
  ]
  lay = cpjax.ShardLayout(6, 8, 2, "contiguous")
  assert [np.asarray(cpjax.local_token_indices(lay, r)).tolist() for r in range(2)] == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]
  assert cpjax.padded_length(6, 2) == 8  # the original's 6 -> 8 case
  assert cpjax.padded_length(8, 2) == 8
  assert cpjax.padded_length(9, 4, pad_multiple=4) == 16
  assert cpjax.padded_length(5, 2, kind="load_balanced", pad_multiple=3) == 12  # lcm(6, 4)
  assert cpjax.padded_length(5, 2, pad_multiple=3) == 6  # contiguous: 2 * 3, not a multiple of 4


@given(
  cp=st.sampled_from([1, 2, 3, 4, 8]),
  kind=st.sampled_from(cpjax.batch.layout.LAYOUT_KINDS),
  n_chunks=st.integers(1, 5),
)
def test_indices_are_a_permutation_of_the_padded_range(cp, kind, n_chunks):
  padded = n_chunks * cp * 2
  lay = cpjax.ShardLayout(padded, padded, cp, kind)
  maps = [np.asarray(cpjax.local_token_indices(lay, r)) for r in range(cp)]
  for r, m in enumerate(maps):
    chex.assert_shape(m, (lay.local_seq_len,))
    assert m.tolist() == _expected_indices(padded, cp, kind, r)
  np.testing.assert_array_equal(np.sort(np.concatenate(maps)), np.arange(padded))
  np.testing.assert_array_equal(cpjax.rank_order(lay), np.concatenate(maps))


def test_traced_rank_matches_python_rank():
  lay = cpjax.ShardLayout(30, 32, 4, "load_balanced")
  f = jax.jit(lambda r: cpjax.local_token_indices(lay, r))
  for r in range(4):
    chex.assert_trees_all_equal(f(jnp.int32(r)), cpjax.local_token_indices(lay, r))


def test_layout_is_hashable_and_static():
  a = cpjax.ShardLayout(6, 8, 2, "load_balanced", replicated_keys=("input_ids",))
  b = cpjax.ShardLayout(6, 8, 2, "load_balanced")
  assert a == b and hash(a) == hash(b)
  assert jax.tree_util.tree_leaves(a) == []
  out = jax.jit(lambda x: (x, a))(1.0)[1]
  assert out == a


@pytest.mark.parametrize(
  "args, kwargs, err, match",
  [
    ((6, 7, 2), {}, ValueError, "multiple of 2"),
    ((6, 6, 2), {"kind": "load_balanced"}, ValueError, "multiple of 4"),
    ((6, 8, 2), {"kind": "zigzag"}, ValueError, "kind must be one of"),
    ((9, 8, 2), {}, ValueError, "must be >= original_seq_len"),
    ((6, 8, 0), {}, ValueError, "cp_size must be >= 1"),
    ((6.0, 8, 2), {}, TypeError, "original_seq_len must be an int"),
  ],
)
def test_layout_validation(args, kwargs, err, match):
  with pytest.raises(err, match=match):
    cpjax.ShardLayout(*args, **kwargs)


def test_rank_out_of_range():
  with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
    cpjax.local_token_indices(cpjax.ShardLayout(8, 8, 2), 2)
