"""cpjax: context-parallel training for JAX.

Batch preparation (pad and shard the token streams over a named ``cp`` mesh
axis: contiguous, load-balanced, or document-balanced for packed rows) and
ring attention, as pure functions.

This module is the public API of the context-parallel core: meshes and
placement (:mod:`cpjax.parallel`), masks (:mod:`cpjax.masks`), the batch half
(:mod:`cpjax.batch`) and the attention half (:mod:`cpjax.attention`). Layers
build on it, each importing only those below: :mod:`cpjax.data`,
:mod:`cpjax.models`, :mod:`cpjax.training`, then the command line
:mod:`cpjax.cli` (the README's Architecture section).
"""

from cpjax import _deprecations
from cpjax.attention.cp_context import ContextParallelSharder, CPContext
from cpjax.attention.flax_attention import ring_attention_fn, use_cp
from cpjax.attention.global_attention import context_parallel_attention
from cpjax.attention.reference import reference_attention
from cpjax.attention.ring import RingPlan, ring_attention, ring_plan
from cpjax.batch.balance import balance_documents
from cpjax.batch.layout import (
  ShardLayout,
  default_stripes,
  from_rank_order,
  local_token_indices,
  padded_length,
  rank_order,
  to_rank_order,
)
from cpjax.batch.normalize import (
  attention_mask_to_padding_mask,
  next_token_labels,
  normalize_batch,
  synthesize_document_ids,
  vision_group_ids,
)
from cpjax.batch.sharding import shard_batch, shard_sequence, token_ranks, unshard_batch
from cpjax.masks import (
  AllOf,
  AnyOf,
  AttentionMask,
  KeyNotPadding,
  LocalWindow,
  MaskRule,
  MaskSpec,
  SameDocument,
  SameVisionGroup,
)
from cpjax.parallel import make_mesh, param_specs, shard_like_params, shard_params

__all__ = [
  "balance_documents",
  "attention_mask_to_padding_mask",
  "next_token_labels",
  "normalize_batch",
  "synthesize_document_ids",
  "vision_group_ids",
  "context_parallel_attention",
  "from_rank_order",
  "to_rank_order",
  "ContextParallelSharder",
  "CPContext",
  "ring_attention_fn",
  "use_cp",
  "ShardLayout",
  "default_stripes",
  "local_token_indices",
  "padded_length",
  "rank_order",
  "AllOf",
  "AnyOf",
  "AttentionMask",
  "KeyNotPadding",
  "LocalWindow",
  "MaskRule",
  "MaskSpec",
  "SameDocument",
  "SameVisionGroup",
  "make_mesh",
  "param_specs",
  "shard_like_params",
  "shard_params",
  "reference_attention",
  "RingPlan",
  "ring_attention",
  "ring_plan",
  "shard_batch",
  "shard_sequence",
  "token_ranks",
  "unshard_batch",
]

__version__ = "0.1.0"

_deprecations.install()


def __getattr__(name: str):
  # Renamed names (cpjax.SameSegment), cpjax.sharding and the other module
  # paths of 0.1, with their warning.
  if (__name__, name) in _deprecations.MOVED_NAMES:
    return _deprecations.moved_attribute(__name__, name)
  return _deprecations.module_attribute(name)
