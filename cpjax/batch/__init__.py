"""The batch half: a batch's streams normalised, laid out over the ``cp``
ranks, balanced and sharded.

* :mod:`cpjax.batch.normalize`: the streams a batch holds (document ids,
  labels, padding and loss masks) in one canonical form;
* :mod:`cpjax.batch.layout`: where every token lives (:class:`ShardLayout`)
  and moving arrays between natural and rank order;
* :mod:`cpjax.batch.balance`: whole documents reordered so that every rank
  gets the same attention work;
* :mod:`cpjax.batch.sharding`: padding and sharding a batch over a mesh
  (:func:`shard_batch`), and back.

Its functions are exported by :mod:`cpjax` itself (:func:`cpjax.shard_batch`);
this package holds the keys and helpers they share.

Example:
  >>> import numpy as np, cpjax
  >>> ids = np.arange(1, 7)[None]
  >>> rows = {"input_ids": ids, "labels": cpjax.next_token_labels(ids)}
  >>> sharded, layout = cpjax.shard_batch(rows, cpjax.make_mesh(cp=2))
  >>> layout.kind, sharded["input_ids"].shape
  ('load_balanced', (1, 8))
  >>> (np.asarray(sharded["labels"]) == cpjax.batch.IGNORE_INDEX).sum()   # 2 pad, 1 last
  np.int64(3)
"""

from cpjax.batch.balance import rank_work, renumber_documents, token_work
from cpjax.batch.layout import LAYOUT_KINDS, LayoutKind, layout_kind, take_rows
from cpjax.batch.normalize import (
  DOCUMENT_IDS_KEY,
  IGNORE_INDEX,
  SOURCE_DOCUMENT_IDS_KEY,
  SOURCE_INDEX_KEY,
  primary_key,
  primary_length,
)

# The batch half's functions that cpjax exports are its API there
# (cpjax.shard_batch): one path per name. This package holds the rest.
__all__ = [
  "DOCUMENT_IDS_KEY",
  "IGNORE_INDEX",
  "LAYOUT_KINDS",
  "LayoutKind",
  "SOURCE_DOCUMENT_IDS_KEY",
  "SOURCE_INDEX_KEY",
  "primary_key",
  "layout_kind",
  "primary_length",
  "rank_work",
  "renumber_documents",
  "take_rows",
  "token_work",
]


def __getattr__(name: str):
  # cpjax.batch was a module in 0.1: its names that cpjax now exports still
  # resolve here for one release, with a warning.
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
