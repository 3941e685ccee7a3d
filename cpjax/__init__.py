"""cpjax: context-parallel training for JAX.

Batch preparation (pad and shard the token streams over a named ``cp`` mesh
axis: contiguous, load-balanced, or document-balanced for packed rows) and
ring attention, as pure functions.

This module is the public API of the context-parallel core (the modules at
the package's top level, with :mod:`cpjax.masks` and :mod:`cpjax.ring.kernels`).
Layers build on it, each importing only those below: :mod:`cpjax.data`,
:mod:`cpjax.models`, :mod:`cpjax.training`, then the command line
:mod:`cpjax.cli` (the README's Architecture section).
"""

from cpjax.balance import balance_documents as balance_documents
from cpjax.batch import attention_mask_to_padding_mask as attention_mask_to_padding_mask
from cpjax.batch import next_token_labels as next_token_labels
from cpjax.batch import normalize_batch as normalize_batch
from cpjax.batch import synthesize_document_ids as synthesize_document_ids
from cpjax.batch import vision_group_ids as vision_group_ids
from cpjax.cp_context import ContextParallelSharder as ContextParallelSharder
from cpjax.cp_context import CPContext as CPContext
from cpjax.flax_attention import ring_attention_fn as ring_attention_fn
from cpjax.flax_attention import use_cp as use_cp
from cpjax.global_attention import context_parallel_attention as context_parallel_attention
from cpjax.global_attention import from_rank_order as from_rank_order
from cpjax.global_attention import to_rank_order as to_rank_order
from cpjax.layout import ShardLayout as ShardLayout
from cpjax.layout import default_stripes as default_stripes
from cpjax.layout import local_token_indices as local_token_indices
from cpjax.layout import padded_length as padded_length
from cpjax.layout import rank_order as rank_order
from cpjax.masks import AllOf as AllOf
from cpjax.masks import AnyOf as AnyOf
from cpjax.masks import AttentionMask as AttentionMask
from cpjax.masks import KeyNotPadding as KeyNotPadding
from cpjax.masks import LocalWindow as LocalWindow
from cpjax.masks import MaskRule as MaskRule
from cpjax.masks import MaskSpec as MaskSpec
from cpjax.masks import SameSegment as SameSegment
from cpjax.masks import SameVisionGroup as SameVisionGroup
from cpjax.parallel import make_mesh as make_mesh
from cpjax.parallel import param_specs as param_specs
from cpjax.parallel import shard_like_params as shard_like_params
from cpjax.parallel import shard_params as shard_params
from cpjax.reference import reference_attention as reference_attention
from cpjax.ring import RingPlan as RingPlan
from cpjax.ring import ring_attention as ring_attention
from cpjax.ring import ring_plan as ring_plan
from cpjax.sharding import shard_batch as shard_batch
from cpjax.sharding import shard_sequence as shard_sequence
from cpjax.sharding import unshard_batch as unshard_batch

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
  "SameSegment",
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
  "unshard_batch",
]

__version__ = "0.1.0"
