"""The grain packing pipeline against a numpy re-derivation of its contract."""

import os
from collections import Counter

import numpy as np
import pytest

from cpjax.data import corpus

CORPUS = os.path.join(os.path.dirname(__file__), "data", "tiny_corpus.array_record")


def read_all(path):
  from array_record.python import array_record_module

  reader = array_record_module.ArrayRecordReader(path)
  docs = [np.frombuffer(r, "<i4") for r in reader.read_all()]
  reader.close()
  return docs


def documents_of(rows):
  """Every (document piece) of packed rows, as token tuples, re-derived from
  the document ids; also checks labels, positions and the mask row by row."""
  pieces = []
  for row in rows:
    ids, docs, pos, labels = (
      row[k] for k in ("input_ids", "_packed_seq_ids", "position_ids", "labels")
    )
    np.testing.assert_array_equal(row["attention_mask"], docs > 0)
    for d in np.unique(docs[docs > 0]):
      idx = np.flatnonzero(docs == d)
      assert np.all(np.diff(idx) == 1), "a document is contiguous in its row"
      np.testing.assert_array_equal(pos[idx], np.arange(idx.size))
      np.testing.assert_array_equal(labels[idx[:-1]], ids[idx[1:]])
      assert labels[idx[-1]] == -100  # never crosses into the next document
      pieces.append(tuple(ids[idx].tolist()))
    assert np.all(labels[docs == 0] == -100)
  return pieces


def expected_pieces(docs, seq_len):
  return Counter(
    tuple(d[i : i + seq_len].tolist()) for d in docs for i in range(0, len(d), seq_len)
  )


def one_epoch(seq_len=256, **kw):
  kw = {"process_index": 0, "process_count": 1, **kw}
  return list(corpus.packed_rows(CORPUS, seq_len=seq_len, num_epochs=1, **kw))


def test_one_epoch_packs_every_document_once_with_per_document_labels():
  rows = one_epoch()
  assert {k: (v.shape, v.dtype) for k, v in rows[0].items()} == {
    k: ((256,), np.dtype(np.int32))
    for k in ("input_ids", "_packed_seq_ids", "position_ids", "labels", "attention_mask")
  }
  # Documents longer than S (up to 400 > 256 tokens) come as S-token pieces.
  assert Counter(documents_of(rows)) == expected_pieces(read_all(CORPUS), 256)
  fill = np.mean([np.mean(r["attention_mask"]) for r in rows])
  assert fill > 0.9  # first-fit packing wastes little


def test_deterministic_and_seeded():
  first = lambda seed: [r["input_ids"] for r in one_epoch(seed=seed)[:5]]
  np.testing.assert_array_equal(first(1), first(1))
  assert not np.array_equal(first(1), first(2))


def test_processes_share_the_documents_exactly():
  # As multisets: the two shares add up to the corpus, each piece exactly once.
  parts = [documents_of(one_epoch(process_index=i, process_count=2)) for i in range(2)]
  assert Counter(parts[0]) + Counter(parts[1]) == expected_pieces(read_all(CORPUS), 256)
  assert min(len(parts[0]), len(parts[1])) > 0.4 * (len(parts[0]) + len(parts[1]))


def test_resume_from_iterator_state_continues_exactly():
  make = lambda: iter(
    corpus.packed_batches(
      CORPUS, batch_size=2, seq_len=128, seed=3, process_index=0, process_count=1
    )
  )
  it = make()
  for _ in range(7):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(5)]
  resumed = make()
  resumed.set_state(state)
  for a, b in zip(want, [next(resumed) for _ in range(5)]):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_bad_inputs_are_clear_errors(tmp_path):
  missing = tmp_path / "none.array_record"
  with pytest.raises(FileNotFoundError, match="none.array_record does not exist"):
    corpus.packed_rows(missing, seq_len=8)
  with pytest.raises(FileNotFoundError, match="holds no .array_record files"):
    corpus.packed_rows(tmp_path, seq_len=8)
  corrupt = tmp_path / "corrupt.array_record"
  corrupt.write_bytes(os.urandom(1000))
  with pytest.raises(ValueError, match="corrupt.array_record"):
    next(iter(corpus.packed_rows(corrupt, seq_len=8, process_index=0, process_count=1)))
  odd = tmp_path / "odd.array_record"
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(str(odd), "group_size:1")
  writer.write(b"12345")
  writer.close()
  with pytest.raises(ValueError, match=r"odd.array_record is 5 bytes"):
    next(iter(corpus.packed_rows(odd, seq_len=8, process_index=0, process_count=1)))
  with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
    corpus.packed_rows(CORPUS, seq_len=1)
  with pytest.raises(ValueError, match="non-empty 1-D"):
    corpus.write_documents(tmp_path / "x.array_record", [[1, 2], []])
