"""Gemma 4's configuration: text decoder, vision tower, and the model around them.

The 12B unified model (transformers' ``Gemma4UnifiedForConditionalGeneration``)
is a :class:`Gemma4Config` with ``unified=True``: the same decoder (no
per-layer inputs, no MoE), and in place of the towers the encoder-free image
and audio embedders of :mod:`~cpjax.models.gemma4.unified_config`. E2B and
E4B carry an audio tower (:mod:`~cpjax.models.gemma4.audio_config`).

Field names are Hugging Face's (``transformers`` 5.24 ``Gemma4TextConfig``,
``Gemma4VisionConfig``, ``Gemma4Config``) so that a ``config.json`` maps onto
them one to one. :meth:`Gemma4Config.from_hf` reads both spellings of the
full-attention overrides (the Hub's ``global_head_dim`` /
``num_global_key_value_heads``, or a re-saved ``per_layer_config``);
:meth:`Gemma4Config.to_hf` writes what transformers 5.24 writes.

Presets: :data:`PRESETS` holds the five published sizes (``e2b``, ``e4b``,
``a4b`` for 26B-A4B, ``31b`` and the unified ``12b``) and ``tiny`` ones of the
same architectures for tests and the demo.

The text decoder's configuration is :mod:`~cpjax.models.gemma4.text_config`,
the vision tower's :mod:`~cpjax.models.gemma4.vision_config`, and reading
their ``config.json`` sections :mod:`~cpjax.models.gemma4.hf_config`; their
names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from cpjax.models.gemma4.audio_config import Gemma4AudioConfig, audio_from_hf
from cpjax.models.gemma4.hf_config import (
  IGNORED_CONFIG_KEYS,
  check_keys,
  text_from_hf,
  vision_from_hf,
)
from cpjax.models.gemma4.text_config import ACTIVATION, FULL, SLIDING, Gemma4TextConfig
from cpjax.models.gemma4.unified_config import (
  UNIFIED_TEXT_DEFAULTS,
  Gemma4UnifiedAudioConfig,
  Gemma4UnifiedVisionConfig,
  unified_audio_from_hf,
  unified_vision_from_hf,
)
from cpjax.models.gemma4.vision_config import Gemma4VisionConfig

__all__ = ["FULL", "Gemma4Config", "IGNORED_CONFIG_KEYS", "PRESETS", "SLIDING"]


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
  """Gemma 4 (transformers' ``Gemma4Config``): text decoder, vision tower and
  (E2B, E4B) audio tower.

  ``vision`` None is a model without images; ``audio`` None one without audio
  (a :class:`Gemma4AudioConfig` is the conformer audio tower). ``has_audio``
  says that the source checkpoint had an audio tower (``from_hf`` sets both).

  ``unified`` is the 12B unified model (``Gemma4UnifiedConfig``): ``vision`` is
  then a :class:`Gemma4UnifiedVisionConfig` (or None) and ``audio`` a
  :class:`Gemma4UnifiedAudioConfig` (or None), both encoder-free embedders.

  Example:
    >>> cfg = Gemma4Config.preset("e2b")
    >>> cfg.text.hidden_size, cfg.text.kv_sharing_modes[13:16], cfg.vision.use_clipped_linears
    (1536, ('store', 'store', 'reuse'), True)
  """

  text: Gemma4TextConfig = dataclasses.field(default_factory=Gemma4TextConfig)
  vision: Gemma4VisionConfig | Gemma4UnifiedVisionConfig | None = dataclasses.field(
    default_factory=Gemma4VisionConfig
  )
  image_token_id: int = 258880
  boi_token_id: int = 255999
  eoi_token_id: int = 258882
  video_token_id: int = 258884
  audio_token_id: int = 258881
  boa_token_id: int = 256000
  eoa_token_index: int = 258883
  has_audio: bool = False
  unified: bool = False
  audio: Gemma4AudioConfig | Gemma4UnifiedAudioConfig | None = None

  def __post_init__(self):
    if not isinstance(self.text, Gemma4TextConfig):
      raise TypeError(f"text must be a Gemma4TextConfig, got {type(self.text).__name__}")
    vision = Gemma4UnifiedVisionConfig if self.unified else Gemma4VisionConfig
    if self.vision is not None and not isinstance(self.vision, vision):
      raise TypeError(
        f"vision must be a {vision.__name__} or None"
        f"{' (unified=True)' if self.unified else ''}, got {type(self.vision).__name__}"
      )
    audio = Gemma4UnifiedAudioConfig if self.unified else Gemma4AudioConfig
    if self.audio is not None and not isinstance(self.audio, audio):
      raise TypeError(
        f"audio must be a {audio.__name__} or None"
        f"{' (unified=True)' if self.unified else ''}, got {type(self.audio).__name__}"
      )
    t = self.text
    if self.unified and (t.hidden_size_per_layer_input or t.enable_moe_block):
      raise ValueError(
        "the unified model's decoder has no per-layer inputs and no MoE: got "
        f"hidden_size_per_layer_input={t.hidden_size_per_layer_input}, "
        f"enable_moe_block={t.enable_moe_block}"
      )

  @property
  def placeholder_token_ids(self) -> tuple[int, int, int]:
    """Image, video and audio placeholders: embedded as the pad token."""
    return self.image_token_id, self.video_token_id, self.audio_token_id

  @property
  def special_token_ids(self) -> tuple[int, ...]:
    """Every placeholder and control id: image, video, audio, begin / end of
    image and audio, pad, bos and eos (sorted)."""
    t = self.text
    eos = t.eos_token_id if isinstance(t.eos_token_id, tuple) else (t.eos_token_id,)
    ids = {
      *self.placeholder_token_ids,
      self.boi_token_id,
      self.eoi_token_id,
      self.boa_token_id,
      self.eoa_token_index,
      t.pad_token_id,
      t.bos_token_id,
      *eos,
    }
    return tuple(sorted(ids))

  @classmethod
  def preset(cls, name: str, **text_overrides: Any) -> "Gemma4Config":
    """Return a published size (``e2b``, ``e4b``, ``a4b``, ``31b``) or a tiny test model.

    See :data:`PRESETS`; with optional text-config overrides.

    Args:
      name: the preset's name.
      **text_overrides: text-config fields to replace.

    Returns:
      The :class:`Gemma4Config`.
    """
    if name not in PRESETS:
      raise KeyError(f"unknown Gemma 4 preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if text_overrides:
      cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, **text_overrides))
    return cfg

  # ------------------------------------------------------------ config.json
  @classmethod
  def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "Gemma4Config":
    """Read the config from a Hugging Face ``config.json`` (a directory, the file, or its dict).

    Reads both ways of writing the full-attention overrides: the Hub's
    ``global_head_dim`` (default 512) / ``num_global_key_value_heads`` (used
    only with ``attention_k_eq_v``, as transformers does), or a
    ``per_layer_config`` saved by transformers 5.24. Settings cpjax does not
    implement (other activations, attention biases, other RoPE types) are a
    ``ValueError``.

    Args:
      source: a directory holding ``config.json``, the file, or its dict.

    Returns:
      The :class:`Gemma4Config`.
    """
    if not isinstance(source, Mapping):
      path = os.fspath(source)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      with open(path) as f:
        source = json.load(f)
    raw: dict[str, Any] = dict(source)
    model_type = raw.get("model_type", "gemma4")
    if model_type in ("gemma4_text", "gemma4_unified_text"):
      raw = {"text_config": raw, "vision_config": None, "model_type": model_type[: -len("_text")]}
    elif model_type not in ("gemma4", "gemma4_unified"):
      raise ValueError(
        "config.json model_type must be 'gemma4', 'gemma4_text', 'gemma4_unified' or "
        f"'gemma4_unified_text', got {model_type!r}"
      )
    unified = raw.get("model_type") == "gemma4_unified"
    if "text_config" not in raw:
      raise KeyError("config.json has no 'text_config'")
    check_keys(
      raw,
      "config.json",
      {
        "text_config",
        "vision_config",
        "audio_config",
        "tie_word_embeddings",
        "eoa_token_id",
        *_TOKEN_IDS,
      },
    )
    # The Hub's files carry both spellings of the end-of-audio id.
    if raw.get("eoa_token_id", raw.get("eoa_token_index")) != raw.get(
      "eoa_token_index", raw.get("eoa_token_id")
    ):
      raise ValueError(
        f"config.json eoa_token_id ({raw['eoa_token_id']}) and eoa_token_index "
        f"({raw['eoa_token_index']}) disagree"
      )
    if "eoa_token_index" not in raw and "eoa_token_id" in raw:
      raw["eoa_token_index"] = raw["eoa_token_id"]
    # A unified text_config that leaves a key out means the unified default.
    defaults = UNIFIED_TEXT_DEFAULTS if unified else {}
    text = text_from_hf({**defaults, **raw["text_config"]})
    if raw.get("tie_word_embeddings", text.tie_word_embeddings) != text.tie_word_embeddings:
      raise ValueError(
        f"config.json tie_word_embeddings ({raw['tie_word_embeddings']}) and "
        f"text_config.tie_word_embeddings ({text.tie_word_embeddings}) disagree"
      )
    ids: dict[str, Any] = {k: int(raw.get(k, v)) for k, v in _TOKEN_IDS.items()}
    vision, audio = raw.get("vision_config"), raw.get("audio_config")
    if unified:
      return cls(
        text=text,
        vision=None if vision is None else unified_vision_from_hf(dict(vision)),
        audio=None if audio is None else unified_audio_from_hf(dict(audio)),
        unified=True,
        **ids,
      )
    vision = None if vision is None else vision_from_hf(dict(vision))
    audio = None if audio is None else audio_from_hf(dict(audio))
    return cls(text=text, vision=vision, audio=audio, has_audio=audio is not None, **ids)

  def to_hf(self) -> dict:
    """Return the ``config.json`` dict transformers 5.24 writes for this model.

    Returns:
      The ``config.json`` dict.
    """
    t = self.text
    assert t.layer_types is not None  # Gemma4TextConfig.__post_init__ fills it
    full = {}
    for i in range(t.num_hidden_layers):
      if t.is_full(i):
        full[str(i)] = {"head_dim": t.global_head_dim, "num_key_value_heads": t.kv_heads(i)}
    sliding_rope = {"rope_theta": t.sliding_rope_theta, "rope_type": "default"}
    full_rope = {"rope_theta": t.full_rope_theta, "rope_type": t.full_rope_type}
    if t.full_rope_type == "proportional":
      full_rope["partial_rotary_factor"] = t.full_partial_rotary_factor
    text = {
      "model_type": "gemma4_unified_text" if self.unified else "gemma4_text",
      "vocab_size": t.vocab_size,
      "hidden_size": t.hidden_size,
      "intermediate_size": t.intermediate_size,
      "num_hidden_layers": t.num_hidden_layers,
      "num_attention_heads": t.num_attention_heads,
      "num_key_value_heads": t.num_key_value_heads,
      "head_dim": t.head_dim,
      "per_layer_config": full,
      "layer_types": list(t.layer_types),
      "sliding_window": t.sliding_window,
      "rope_parameters": {SLIDING: sliding_rope, FULL: full_rope},
      "final_logit_softcapping": t.final_logit_softcapping,
      "use_bidirectional_attention": t.use_bidirectional_attention,
      "vocab_size_per_layer_input": t.vocab_size_per_layer_input,
      "hidden_size_per_layer_input": t.hidden_size_per_layer_input,
      "attention_k_eq_v": t.attention_k_eq_v,
      "num_kv_shared_layers": t.num_kv_shared_layers,
      "enable_moe_block": t.enable_moe_block,
      "use_double_wide_mlp": t.use_double_wide_mlp,
      "num_experts": t.num_experts,
      "top_k_experts": t.top_k_experts,
      "moe_intermediate_size": t.moe_intermediate_size,
      "rms_norm_eps": t.rms_norm_eps,
      "pad_token_id": t.pad_token_id,
      "eos_token_id": list(t.eos_token_id) if isinstance(t.eos_token_id, tuple) else t.eos_token_id,
      "bos_token_id": t.bos_token_id,
      "max_position_embeddings": t.max_position_embeddings,
      "tie_word_embeddings": t.tie_word_embeddings,
      "hidden_activation": ACTIVATION,
      "attention_bias": False,
    }
    out = {
      "architectures": ["Gemma4ForConditionalGeneration"],
      "model_type": "gemma4",
      "text_config": text,
      "audio_config": None,
      "tie_word_embeddings": t.tie_word_embeddings,
      **{k: getattr(self, k) for k in _TOKEN_IDS},
    }
    if self.unified:
      return self._unified_to_hf(out)
    v = self.vision
    out["vision_config"] = (
      None
      if not isinstance(v, Gemma4VisionConfig)
      else {
        "model_type": "gemma4_vision",
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_hidden_layers": v.num_hidden_layers,
        "num_attention_heads": v.num_attention_heads,
        "num_key_value_heads": v.num_key_value_heads,
        "head_dim": v.head_dim,
        "patch_size": v.patch_size,
        "pooling_kernel_size": v.pooling_kernel_size,
        "position_embedding_size": v.position_embedding_size,
        "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"},
        "use_clipped_linears": v.use_clipped_linears,
        "standardize": v.standardize,
        "rms_norm_eps": v.rms_norm_eps,
        "hidden_activation": ACTIVATION,
        "attention_bias": False,
      }
    )
    if isinstance(self.audio, Gemma4AudioConfig):
      a = self.audio
      out["audio_config"] = {
        "model_type": "gemma4_audio",
        **dataclasses.asdict(a),
        "subsampling_conv_channels": list(a.subsampling_conv_channels),
        "hidden_act": "silu",
      }
    return out

  def _unified_to_hf(self, out: dict) -> dict:
    """:meth:`to_hf` of the unified model: its names and its embedders' configs."""
    v, a = self.vision, self.audio
    vision = None
    if isinstance(v, Gemma4UnifiedVisionConfig):
      vision = {
        "model_type": "gemma4_unified_vision",
        **{f.name: getattr(v, f.name) for f in dataclasses.fields(v)},
      }
    audio = None
    if a is not None:
      audio = {"model_type": "gemma4_unified_audio", **dataclasses.asdict(a)}
    return {
      **out,
      "architectures": ["Gemma4UnifiedForConditionalGeneration"],
      "model_type": "gemma4_unified",
      "vision_config": vision,
      "audio_config": audio,
    }


# The multimodal token ids, as transformers' Gemma4Config defaults them.
_TOKEN_IDS = {
  f.name: f.default
  for f in dataclasses.fields(Gemma4Config)
  if f.name.endswith(("_token_id", "_token_index"))
}


def _pattern(layers: int, period: int) -> tuple[str, ...]:
  return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(layers))


_SMALL_VISION = Gemma4VisionConfig(
  hidden_size=768,
  intermediate_size=3072,
  num_hidden_layers=16,
  num_attention_heads=12,
  num_key_value_heads=12,
  head_dim=64,
  use_clipped_linears=True,
)
_LARGE_VISION = Gemma4VisionConfig(
  hidden_size=1152,
  intermediate_size=4304,
  num_hidden_layers=27,
  num_attention_heads=16,
  num_key_value_heads=16,
  head_dim=72,
  standardize=True,
)
_PUBLISHED = dict(
  vocab_size=262144,
  head_dim=256,
  global_head_dim=512,
  final_logit_softcapping=30.0,
  tie_word_embeddings=True,
)
# Tiny vision tower: patches of 4 pixels, 3x3 pooling, 2 layers.
_TINY_VISION = Gemma4VisionConfig(
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=2,
  num_key_value_heads=2,
  head_dim=16,
  patch_size=4,
  position_embedding_size=64,
)
_TINY = dict(
  vocab_size=512,
  hidden_size=64,
  intermediate_size=96,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  global_head_dim=32,
  sliding_window=8,
  final_logit_softcapping=30.0,
  vocab_size_per_layer_input=512,
  max_position_embeddings=1 << 20,
)

PRESETS: dict[str, Gemma4Config] = {
  # --- the published sizes (transformers' converter and Google's gemma library)
  "e2b": Gemma4Config(
    text=Gemma4TextConfig(
      **_PUBLISHED,
      hidden_size=1536,
      num_hidden_layers=35,
      layer_types=_pattern(35, 5),
      num_attention_heads=8,
      num_key_value_heads=1,
      intermediate_size=6144,
      use_double_wide_mlp=True,
      sliding_window=512,
      hidden_size_per_layer_input=256,
      num_kv_shared_layers=20,
    ),
    vision=_SMALL_VISION,
    audio=Gemma4AudioConfig(),
    has_audio=True,
  ),
  "e4b": Gemma4Config(
    text=Gemma4TextConfig(
      **_PUBLISHED,
      hidden_size=2560,
      num_hidden_layers=42,
      num_attention_heads=8,
      num_key_value_heads=2,
      intermediate_size=10240,
      sliding_window=512,
      hidden_size_per_layer_input=256,
      num_kv_shared_layers=18,
    ),
    vision=_SMALL_VISION,
    audio=Gemma4AudioConfig(),
    has_audio=True,
  ),
  "a4b": Gemma4Config(
    text=Gemma4TextConfig(
      **_PUBLISHED,
      hidden_size=2816,
      num_hidden_layers=30,
      num_attention_heads=16,
      num_key_value_heads=8,
      num_global_key_value_heads=2,
      attention_k_eq_v=True,
      intermediate_size=2112,
      enable_moe_block=True,
      num_experts=128,
      top_k_experts=8,
      moe_intermediate_size=704,
      sliding_window=1024,
      hidden_size_per_layer_input=0,
      use_bidirectional_attention="vision",
      max_position_embeddings=262144,
    ),
    vision=_LARGE_VISION,
  ),
  "31b": Gemma4Config(
    text=Gemma4TextConfig(
      **_PUBLISHED,
      hidden_size=5376,
      num_hidden_layers=60,
      num_attention_heads=32,
      num_key_value_heads=16,
      num_global_key_value_heads=4,
      attention_k_eq_v=True,
      intermediate_size=21504,
      sliding_window=1024,
      hidden_size_per_layer_input=0,
      use_bidirectional_attention="vision",
      max_position_embeddings=262144,
    ),
    vision=_LARGE_VISION,
  ),
  # The unified model: the 31B's decoder design at 3840 wide, 48 layers,
  # encoder-free image and audio embedders (google/gemma-4-12B's config.json).
  "12b": Gemma4Config(
    text=Gemma4TextConfig(
      **_PUBLISHED,
      hidden_size=3840,
      num_hidden_layers=48,
      num_attention_heads=16,
      num_key_value_heads=8,
      num_global_key_value_heads=1,
      attention_k_eq_v=True,
      intermediate_size=15360,
      **UNIFIED_TEXT_DEFAULTS,
    ),
    vision=Gemma4UnifiedVisionConfig(),
    audio=Gemma4UnifiedAudioConfig(),
    unified=True,
  ),
  # --- tiny models of the same architecture (tests, `cpjax train --model tiny`)
  # E2B-like: per-layer inputs, K/V sharing with a double-wide MLP in the
  # reuse layers, 4:1 pattern, clipped vision linears.
  "tiny": Gemma4Config(
    text=Gemma4TextConfig(
      **_TINY,
      num_hidden_layers=6,
      layer_types=_pattern(6, 3),
      hidden_size_per_layer_input=8,
      num_kv_shared_layers=2,
      use_double_wide_mlp=True,
    ),
    vision=dataclasses.replace(_TINY_VISION, use_clipped_linears=True),
  ),
  # 26B-A4B-like: MoE beside the dense MLP, k_eq_v with fewer full-layer KV
  # heads, vision groups bidirectional on sliding layers, standardize.
  "tiny-moe": Gemma4Config(
    text=Gemma4TextConfig(
      **{**_TINY, "intermediate_size": 48},
      num_hidden_layers=4,
      layer_types=_pattern(4, 2),
      num_global_key_value_heads=1,
      attention_k_eq_v=True,
      enable_moe_block=True,
      num_experts=4,
      top_k_experts=2,
      moe_intermediate_size=24,
      hidden_size_per_layer_input=0,
      use_bidirectional_attention="vision",
    ),
    vision=dataclasses.replace(_TINY_VISION, standardize=True),
  ),
  # 12B-like: the unified model's embedders (48-pixel patches of 4 x 2 px:
  # 48 features), k_eq_v, vision groups bidirectional on every layer.
  "tiny-unified": Gemma4Config(
    text=Gemma4TextConfig(
      **{**_TINY, **UNIFIED_TEXT_DEFAULTS, "sliding_window": 8, "max_position_embeddings": 1 << 20},
      num_hidden_layers=4,
      layer_types=_pattern(4, 2),
      num_global_key_value_heads=1,
      attention_k_eq_v=True,
    ),
    vision=Gemma4UnifiedVisionConfig(
      patch_size=2, pooling_kernel_size=2, mm_embed_dim=24, mm_posemb_size=16, output_proj_dims=24
    ),
    audio=Gemma4UnifiedAudioConfig(audio_embed_dim=8),
    unified=True,
  ),
  # use_bidirectional_attention="all" (every token sees both ways; no
  # published model uses it), default RoPE on full layers, untied head.
  "tiny-bidirectional": Gemma4Config(
    text=Gemma4TextConfig(
      **{**_TINY, "tie_word_embeddings": False},
      num_hidden_layers=3,
      layer_types=_pattern(3, 2),
      hidden_size_per_layer_input=0,
      use_bidirectional_attention="all",
      full_rope_type="default",
    ),
    vision=_TINY_VISION,
  ),
}
