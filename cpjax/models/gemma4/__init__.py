"""Gemma4-style model pieces with the in-forward context-parallel path."""

from cpjax.models.gemma4.cp_batch import (
    make_contiguous_aux_only_shard_cp_batch as make_contiguous_aux_only_shard_cp_batch,
)
from cpjax.models.gemma4.cp_batch import (
    synthesize_single_document_seq_ids as synthesize_single_document_seq_ids,
)
