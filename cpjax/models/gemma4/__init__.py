"""Gemma 4 (transformers' ``Gemma4ForConditionalGeneration``, and the 12B
``Gemma4UnifiedForConditionalGeneration``) with the
in-forward context-parallel path, Hugging Face checkpoints and CP evaluation.

The models layer: a model may import the core and :mod:`cpjax.data`, never
the training layer or the command line.

* ``config`` (with ``text_config``, ``vision_config``, ``audio_config``,
  ``unified_config``, ``hf_config``): the configuration, its presets and
  ``config.json``;
* ``layers``, ``text``, ``vision``, ``audio``, ``embedders``, ``model``,
  ``remat``: the network (``audio``: E2B and E4B's audio tower;
  ``embedders``: the unified model's image embedder);
* ``cp_batch``: its batches and their sharder; ``cp_forward``: CP logits;
* ``checkpoint``: safetensors in and out; ``partitioning``: its mesh rules.
"""

from cpjax.models.gemma4.audio_config import Gemma4AudioConfig as Gemma4AudioConfig
from cpjax.models.gemma4.config import PRESETS as PRESETS
from cpjax.models.gemma4.config import Gemma4Config as Gemma4Config
from cpjax.models.gemma4.cp_batch import (
  make_contiguous_aux_only_shard_cp_batch as make_contiguous_aux_only_shard_cp_batch,
)
from cpjax.models.gemma4.cp_batch import prepare_batch as prepare_batch
from cpjax.models.gemma4.cp_batch import shard_aux_only_cp_batch as shard_aux_only_cp_batch
from cpjax.models.gemma4.cp_batch import (
  synthesize_single_document_seq_ids as synthesize_single_document_seq_ids,
)
from cpjax.models.gemma4.cp_batch import synthetic_batch as synthetic_batch
from cpjax.models.gemma4.cp_forward import cp_logits as cp_logits
from cpjax.models.gemma4.model import Gemma4 as Gemma4
from cpjax.models.gemma4.model import gemma4_masks as gemma4_masks
from cpjax.models.gemma4.partitioning import check_expert_axes as check_expert_axes
from cpjax.models.gemma4.partitioning import check_mesh as check_mesh
from cpjax.models.gemma4.partitioning import partition_rule as partition_rule
from cpjax.models.gemma4.remat import REMAT_POLICIES as REMAT_POLICIES
from cpjax.models.gemma4.text_config import Gemma4TextConfig as Gemma4TextConfig
from cpjax.models.gemma4.unified_config import Gemma4UnifiedAudioConfig as Gemma4UnifiedAudioConfig
from cpjax.models.gemma4.unified_config import (
  Gemma4UnifiedVisionConfig as Gemma4UnifiedVisionConfig,
)
from cpjax.models.gemma4.vision_config import Gemma4VisionConfig as Gemma4VisionConfig
