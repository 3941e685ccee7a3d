"""Gemma 4's configuration: text decoder, vision tower, and the model around them.

Field names are Hugging Face's (``transformers`` 5.24 ``Gemma4TextConfig``,
``Gemma4VisionConfig``, ``Gemma4Config``) so that a ``config.json`` maps onto
them one to one. :meth:`Gemma4Config.from_hf` reads both spellings of the
full-attention overrides (the Hub's ``global_head_dim`` /
``num_global_key_value_heads``, or a re-saved ``per_layer_config``);
:meth:`Gemma4Config.to_hf` writes what transformers 5.24 writes.

Presets: :data:`PRESETS` holds the four published sizes (``e2b``, ``e4b``,
``a4b`` for 26B-A4B, ``31b``) and ``tiny`` ones of the same architecture for
tests and the demo.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Gemma4Config", "Gemma4TextConfig", "Gemma4VisionConfig", "IGNORED_CONFIG_KEYS", "PRESETS"]

FULL, SLIDING = "full_attention", "sliding_attention"
_BIDIRECTIONAL = (None, "vision", "all")
_ACTIVATION = "gelu_pytorch_tanh"


def _require_positive(obj, names):
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{type(obj).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Gemma4TextConfig:
  """The text decoder (transformers' ``Gemma4TextConfig``).

  ``layer_types`` defaults to Gemma 4's 5 : 1 pattern (layer i is full iff
  ``(i + 1) % 6 == 0``) and the last layer is always full. Full layers use
  ``global_head_dim`` and, when set, ``num_global_key_value_heads``; sliding
  layers ``head_dim`` and ``num_key_value_heads``. ``sliding_window`` is the
  ``config.json`` value: with ``use_bidirectional_attention == "all"`` the
  layers use ``sliding_window // 2 + 1`` as transformers does
  (:attr:`effective_sliding_window`).

  Example:
    >>> cfg = Gemma4TextConfig(num_hidden_layers=8, num_kv_shared_layers=2)
    >>> cfg.layer_types[5], cfg.layer_types[7], cfg.kv_sharing_modes[4:]
    ('full_attention', 'full_attention', ('store', 'store', 'reuse', 'reuse'))
  """

  vocab_size: int = 262144
  hidden_size: int = 2304
  intermediate_size: int = 9216
  num_hidden_layers: int = 30
  num_attention_heads: int = 8
  num_key_value_heads: int = 4
  head_dim: int = 256
  global_head_dim: int = 512
  num_global_key_value_heads: int | None = None
  layer_types: tuple[str, ...] | None = None
  sliding_window: int = 512
  sliding_rope_theta: float = 10_000.0
  full_rope_theta: float = 1_000_000.0
  full_rope_type: str = "proportional"
  full_partial_rotary_factor: float = 0.25
  final_logit_softcapping: float | None = None
  use_bidirectional_attention: str | None = None
  vocab_size_per_layer_input: int = 262144
  hidden_size_per_layer_input: int = 256
  attention_k_eq_v: bool = False
  num_kv_shared_layers: int = 0
  enable_moe_block: bool = False
  use_double_wide_mlp: bool = False
  num_experts: int | None = None
  top_k_experts: int | None = None
  moe_intermediate_size: int | None = None
  rms_norm_eps: float = 1e-6
  pad_token_id: int = 0
  eos_token_id: int | tuple[int, ...] = 1
  bos_token_id: int = 2
  max_position_embeddings: int = 131072
  tie_word_embeddings: bool = True

  def __post_init__(self):
    _require_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim",
                             "global_head_dim", "sliding_window", "max_position_embeddings"))
    layers = self.num_hidden_layers
    types = self.layer_types
    if types is None:
      types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers))
    types = tuple(types)
    if len(types) != layers or set(types) - {FULL, SLIDING}:
      raise ValueError(f"layer_types must be {layers} entries of {FULL!r} / {SLIDING!r}, got "
                       f"{list(types)}")
    # As transformers: the last layer is always full attention.
    object.__setattr__(self, "layer_types", types[:-1] + (FULL,))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    for i in range(layers):
      if self.num_attention_heads % self.kv_heads(i):
        raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                         f"layer {i}'s KV heads ({self.kv_heads(i)})")
    if self.head_dim % 2 or self.global_head_dim % 2:
      raise ValueError(f"head_dim and global_head_dim must be even (RoPE), got {self.head_dim} "
                       f"and {self.global_head_dim}")
    if self.use_bidirectional_attention not in _BIDIRECTIONAL:
      raise ValueError(f"use_bidirectional_attention must be one of {_BIDIRECTIONAL}, got "
                       f"{self.use_bidirectional_attention!r}")
    if self.full_rope_type not in ("default", "proportional"):
      raise ValueError(f"full_rope_type must be 'default' or 'proportional', got "
                       f"{self.full_rope_type!r}")
    if not 0 < self.full_partial_rotary_factor <= 1:
      raise ValueError(f"full_partial_rotary_factor must be in (0, 1], got "
                       f"{self.full_partial_rotary_factor}")
    if not 0 <= self.num_kv_shared_layers <= layers:
      raise ValueError(f"num_kv_shared_layers must be in [0, {layers}], got "
                       f"{self.num_kv_shared_layers}")
    if self.hidden_size_per_layer_input < 0:
      raise ValueError(f"hidden_size_per_layer_input must be >= 0, got "
                       f"{self.hidden_size_per_layer_input}")
    if self.hidden_size_per_layer_input:
      _require_positive(self, ("vocab_size_per_layer_input",))
    if self.enable_moe_block:
      _require_positive(self, ("num_experts", "top_k_experts", "moe_intermediate_size"))
      if self.top_k_experts > self.num_experts:
        raise ValueError(f"top_k_experts ({self.top_k_experts}) must be <= num_experts "
                         f"({self.num_experts})")
    self.kv_sharing_modes  # noqa: B018  (validates that every reused type has a store layer)

  # ------------------------------------------------------------ per layer
  def is_full(self, layer: int) -> bool:
    return self.layer_types[layer] == FULL

  def layer_head_dim(self, layer: int) -> int:
    return self.global_head_dim if self.is_full(layer) else self.head_dim

  def kv_heads(self, layer: int) -> int:
    if self.is_full(layer) and self.num_global_key_value_heads is not None:
      return self.num_global_key_value_heads
    return self.num_key_value_heads

  def mlp_size(self, layer: int) -> int:
    double = self.use_double_wide_mlp and self.kv_sharing_modes[layer] == "reuse"
    return self.intermediate_size * (2 if double else 1)

  @property
  def kv_sharing_modes(self) -> tuple[str | None, ...]:
    """Per layer: ``"store"`` (its K/V are reused later), ``"reuse"`` (it
    attends to the K/V of the store layer of its own type) or None."""
    layers, shared = self.num_hidden_layers, self.num_kv_shared_layers
    if shared == layers:
      # transformers: every layer reuses, nothing stores; it cannot run.
      raise ValueError("num_kv_shared_layers equal to num_hidden_layers leaves no layer to "
                       "compute K/V")
    first = layers - shared
    modes: list[str | None] = [None if i < first else "reuse" for i in range(layers)]
    if shared:
      for kind in set(self.layer_types[first:]):
        owners = [i for i in range(first) if self.layer_types[i] == kind]
        if not owners:
          raise ValueError(f"reuse layers of type {kind!r} need an earlier {kind!r} layer "
                           f"below layer {first} to store their K/V")
      for kind in set(self.layer_types):
        owners = [i for i in range(first) if self.layer_types[i] == kind]
        if owners:
          modes[owners[-1]] = "store"
    return tuple(modes)

  def store_layer(self, layer: int) -> int:
    """The layer whose K/V a reuse layer attends to."""
    kind = self.layer_types[layer]
    return max(i for i, m in enumerate(self.kv_sharing_modes)
               if m == "store" and self.layer_types[i] == kind)

  @property
  def effective_sliding_window(self) -> int:
    """The window the sliding layers use (transformers' ``config.sliding_window``
    after its ``__post_init__``)."""
    if self.use_bidirectional_attention == "all":
      return self.sliding_window // 2 + 1
    return self.sliding_window

  def rope_inv_freq(self, layer: int):
    """float64 numpy [head_dim // 2]: RoPE inverse frequencies of ``layer``.

    Sliding: ``theta^(-2j/d)``. Full, proportional: the first
    ``int(factor * d // 2)`` pairs rotate with exponent denominator the FULL
    head dim ``d``; the rest have frequency 0 (identity).

    >>> cfg = Gemma4TextConfig(num_hidden_layers=1, global_head_dim=16)
    >>> [round(float(f), 4) for f in cfg.rope_inv_freq(0)]
    [1.0, 0.1778, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    import numpy as np

    d = self.layer_head_dim(layer)
    if not self.is_full(layer):
      theta, rotated = self.sliding_rope_theta, d // 2
    else:
      theta = self.full_rope_theta
      rotated = (int(self.full_partial_rotary_factor * d // 2)
                 if self.full_rope_type == "proportional" else d // 2)
    # float32 as transformers computes them, so positions * inv_freq agree bit for bit.
    exponents = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(d)
    freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    return np.concatenate([freq, np.zeros(d // 2 - rotated, np.float32)])


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
  """The vision tower (transformers' ``Gemma4VisionConfig``).

  >>> Gemma4VisionConfig().hidden_size
  768
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 16
  num_attention_heads: int = 12
  num_key_value_heads: int = 12
  head_dim: int = 64
  patch_size: int = 16
  pooling_kernel_size: int = 3
  position_embedding_size: int = 10240
  rope_theta: float = 100.0
  use_clipped_linears: bool = False
  standardize: bool = False
  rms_norm_eps: float = 1e-6

  def __post_init__(self):
    _require_positive(self, ("hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim",
                             "patch_size", "pooling_kernel_size", "position_embedding_size"))
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                       f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim % 4:
      raise ValueError(f"head_dim must be a multiple of 4 (2-D RoPE), got {self.head_dim}")

  @property
  def patch_features(self) -> int:
    """3 * patch_size**2: the last dim of ``pixel_values``."""
    return 3 * self.patch_size ** 2


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
  """Gemma 4 (transformers' ``Gemma4Config``): text decoder plus vision tower.

  ``vision`` None is a text-only model. ``has_audio`` records that the source
  checkpoint had an audio tower; cpjax does not port it (audio inputs are
  rejected, its weights are not loaded).

  Example:
    >>> cfg = Gemma4Config.preset("e2b")
    >>> cfg.text.hidden_size, cfg.text.kv_sharing_modes[13:16], cfg.vision.use_clipped_linears
    (1536, ('store', 'store', 'reuse'), True)
  """

  text: Gemma4TextConfig = dataclasses.field(default_factory=Gemma4TextConfig)
  vision: Gemma4VisionConfig | None = dataclasses.field(default_factory=Gemma4VisionConfig)
  image_token_id: int = 258880
  boi_token_id: int = 255999
  eoi_token_id: int = 258882
  video_token_id: int = 258884
  audio_token_id: int = 258881
  boa_token_id: int = 256000
  eoa_token_index: int = 258883
  has_audio: bool = False

  def __post_init__(self):
    if not isinstance(self.text, Gemma4TextConfig):
      raise TypeError(f"text must be a Gemma4TextConfig, got {type(self.text).__name__}")
    if self.vision is not None and not isinstance(self.vision, Gemma4VisionConfig):
      raise TypeError(f"vision must be a Gemma4VisionConfig or None, got "
                      f"{type(self.vision).__name__}")

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
    ids = {*self.placeholder_token_ids, self.boi_token_id, self.eoi_token_id, self.boa_token_id,
           self.eoa_token_index, t.pad_token_id, t.bos_token_id, *eos}
    return tuple(sorted(ids))

  @classmethod
  def preset(cls, name: str, **text_overrides) -> "Gemma4Config":
    """A published size (``e2b``, ``e4b``, ``a4b``, ``31b``) or a tiny test
    model (see :data:`PRESETS`), with optional text-config overrides."""
    if name not in PRESETS:
      raise KeyError(f"unknown Gemma 4 preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if text_overrides:
      cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, **text_overrides))
    return cfg

  # ------------------------------------------------------------ config.json
  @classmethod
  def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "Gemma4Config":
    """From a Hugging Face ``config.json`` (a directory, the file, or its dict).

    Reads both ways of writing the full-attention overrides: the Hub's
    ``global_head_dim`` (default 512) / ``num_global_key_value_heads`` (used
    only with ``attention_k_eq_v``, as transformers does), or a
    ``per_layer_config`` saved by transformers 5.24. Settings cpjax does not
    implement (other activations, attention biases, other RoPE types) are a
    ``ValueError``.
    """
    if not isinstance(source, Mapping):
      path = os.fspath(source)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      with open(path) as f:
        source = json.load(f)
    raw = dict(source)
    model_type = raw.get("model_type", "gemma4")
    if model_type == "gemma4_text":
      raw = {"text_config": raw, "vision_config": None}
    elif model_type != "gemma4":
      raise ValueError(f"config.json model_type must be 'gemma4' or 'gemma4_text', got "
                       f"{model_type!r}")
    if "text_config" not in raw:
      raise KeyError("config.json has no 'text_config'")
    _check_keys(raw, "config.json", {"text_config", "vision_config", "audio_config",
                                     "tie_word_embeddings", "eoa_token_id", *_TOKEN_IDS})
    # The Hub's files carry both spellings of the end-of-audio id.
    if raw.get("eoa_token_id", raw.get("eoa_token_index")) != raw.get("eoa_token_index",
                                                                       raw.get("eoa_token_id")):
      raise ValueError(f"config.json eoa_token_id ({raw['eoa_token_id']}) and eoa_token_index "
                       f"({raw['eoa_token_index']}) disagree")
    if "eoa_token_index" not in raw and "eoa_token_id" in raw:
      raw["eoa_token_index"] = raw["eoa_token_id"]
    text = _text_from_hf(dict(raw["text_config"]))
    if raw.get("tie_word_embeddings", text.tie_word_embeddings) != text.tie_word_embeddings:
      raise ValueError(f"config.json tie_word_embeddings ({raw['tie_word_embeddings']}) and "
                       f"text_config.tie_word_embeddings ({text.tie_word_embeddings}) disagree")
    vision = None if raw.get("vision_config") is None else _vision_from_hf(dict(raw["vision_config"]))
    ids = {k: int(raw.get(k, v)) for k, v in _TOKEN_IDS.items()}
    return cls(text=text, vision=vision, has_audio=raw.get("audio_config") is not None, **ids)

  def to_hf(self) -> dict:
    """The ``config.json`` dict transformers 5.24 writes for this model
    (without an audio tower: cpjax does not carry one)."""
    t = self.text
    full = {}
    for i in range(t.num_hidden_layers):
      if t.is_full(i):
        full[str(i)] = {"head_dim": t.global_head_dim, "num_key_value_heads": t.kv_heads(i)}
    sliding_rope = {"rope_theta": t.sliding_rope_theta, "rope_type": "default"}
    full_rope = {"rope_theta": t.full_rope_theta, "rope_type": t.full_rope_type}
    if t.full_rope_type == "proportional":
      full_rope["partial_rotary_factor"] = t.full_partial_rotary_factor
    text = {
        "model_type": "gemma4_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "per_layer_config": full, "layer_types": list(t.layer_types),
        "sliding_window": t.sliding_window,
        "rope_parameters": {SLIDING: sliding_rope, FULL: full_rope},
        "final_logit_softcapping": t.final_logit_softcapping,
        "use_bidirectional_attention": t.use_bidirectional_attention,
        "vocab_size_per_layer_input": t.vocab_size_per_layer_input,
        "hidden_size_per_layer_input": t.hidden_size_per_layer_input,
        "attention_k_eq_v": t.attention_k_eq_v, "num_kv_shared_layers": t.num_kv_shared_layers,
        "enable_moe_block": t.enable_moe_block, "use_double_wide_mlp": t.use_double_wide_mlp,
        "num_experts": t.num_experts, "top_k_experts": t.top_k_experts,
        "moe_intermediate_size": t.moe_intermediate_size, "rms_norm_eps": t.rms_norm_eps,
        "pad_token_id": t.pad_token_id,
        "eos_token_id": list(t.eos_token_id) if isinstance(t.eos_token_id, tuple)
        else t.eos_token_id,
        "bos_token_id": t.bos_token_id, "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": t.tie_word_embeddings, "hidden_activation": _ACTIVATION,
        "attention_bias": False,
    }
    out = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": text, "audio_config": None,
           "tie_word_embeddings": t.tie_word_embeddings,
           **{k: getattr(self, k) for k in _TOKEN_IDS}}
    v = self.vision
    out["vision_config"] = None if v is None else {
        "model_type": "gemma4_vision", "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size, "num_hidden_layers": v.num_hidden_layers,
        "num_attention_heads": v.num_attention_heads,
        "num_key_value_heads": v.num_key_value_heads, "head_dim": v.head_dim,
        "patch_size": v.patch_size, "pooling_kernel_size": v.pooling_kernel_size,
        "position_embedding_size": v.position_embedding_size,
        "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"},
        "use_clipped_linears": v.use_clipped_linears, "standardize": v.standardize,
        "rms_norm_eps": v.rms_norm_eps, "hidden_activation": _ACTIVATION,
        "attention_bias": False,
    }
    return out


# The multimodal token ids, as transformers' Gemma4Config defaults them.
_TOKEN_IDS = {f.name: f.default for f in dataclasses.fields(Gemma4Config)
              if f.name.endswith(("_token_id", "_token_index"))}

# config.json keys that cpjax reads and leaves without effect, on purpose: none
# changes the model's mathematics. Bookkeeping (versions, names, output
# switches), generation settings, the initialiser of fresh weights, and the
# storage dtype (cpjax's ``dtype=`` chooses the compute and parameter dtype).
# Every other key is either read into the config, checked to hold the one
# value cpjax implements, or an unknown key (a ``ValueError`` naming it).
_BOOKKEEPING = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "initializer_range", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "use_cache", "model_type"})
IGNORED_CONFIG_KEYS: dict[str, frozenset[str]] = {
    # eos_token_id: generation's stop tokens. vision_soft_tokens_per_image:
    # the processor's soft-token budget per image (it sizes the placeholder
    # run in the text; the model reads the image as it comes).
    "config.json": _BOOKKEEPING | {"eos_token_id", "vision_soft_tokens_per_image"},
    "text_config": _BOOKKEEPING,
    # The vision tower's patch positions come from position_embedding_size;
    # its max_position_embeddings is unused by transformers' vision model.
    # default_output_length: the processor's soft tokens per image, as above.
    "vision_config": _BOOKKEEPING | {"max_position_embeddings", "default_output_length"},
}
# Keys that must hold the one value cpjax implements (transformers' defaults).
_REQUIRED_VALUES = {"hidden_activation": _ACTIVATION, "attention_bias": False,
                    "attention_dropout": 0.0}


def _check_keys(raw: dict, where: str, read: set[str]) -> None:
  """``ValueError`` for keys that are neither read, checked nor ignored."""
  for key, want in _REQUIRED_VALUES.items():
    value = raw.get(key, want)
    if value != want and not (value is None and key != "hidden_activation"):
      raise ValueError(f"{where}.{key} must be {want!r} (the only value cpjax implements), "
                       f"got {value!r}")
  unknown = sorted(set(raw) - read - set(_REQUIRED_VALUES) - IGNORED_CONFIG_KEYS[where])
  if unknown:
    raise ValueError(f"{where} has keys cpjax does not know: {unknown}; they may change the "
                     f"model's mathematics, so they are not ignored (keys ignored on purpose: "
                     f"cpjax.models.gemma4.config.IGNORED_CONFIG_KEYS)")


_TEXT_READ = ({f.name for f in dataclasses.fields(Gemma4TextConfig)}
              | {"rope_parameters", "per_layer_config", "is_causal", "expert_intermediate_size"})
_VISION_READ = ({f.name for f in dataclasses.fields(Gemma4VisionConfig)}
                | {"rope_parameters", "global_head_dim"})


def _text_from_hf(raw: dict) -> Gemma4TextConfig:
  _check_keys(raw, "text_config", _TEXT_READ)
  fields = {f.name for f in dataclasses.fields(Gemma4TextConfig)}
  # The full-layer overrides are decided below, as transformers decides them.
  kw = {k: v for k, v in raw.items()
        if k in fields and k not in ("global_head_dim", "num_global_key_value_heads")}
  if kw.get("layer_types") is not None:
    kw["layer_types"] = tuple(kw["layer_types"])
  # transformers writes is_causal = false exactly when every token sees both ways.
  causal = kw.get("use_bidirectional_attention") != "all"
  if raw.get("is_causal", causal) != causal:
    raise ValueError(f"text_config.is_causal={raw['is_causal']} contradicts "
                     f"use_bidirectional_attention={kw.get('use_bidirectional_attention')!r}")
  rope = raw.get("rope_parameters") or {}
  unknown = sorted(set(rope) - {SLIDING, FULL})
  if unknown:
    raise ValueError(f"text_config.rope_parameters must be keyed by {SLIDING!r} and {FULL!r}, "
                     f"got {unknown}")
  if SLIDING in rope:
    _check_rope(rope[SLIDING], f"text_config.rope_parameters.{SLIDING}", ("default",))
    kw["sliding_rope_theta"] = float(rope[SLIDING]["rope_theta"])
  if FULL in rope:
    _check_rope(rope[FULL], f"text_config.rope_parameters.{FULL}", ("default", "proportional"))
    kw["full_rope_type"] = rope[FULL].get("rope_type", "default")
    kw["full_rope_theta"] = float(rope[FULL]["rope_theta"])
    if kw["full_rope_type"] == "proportional":
      kw["full_partial_rotary_factor"] = float(rope[FULL].get("partial_rotary_factor", 1.0))
  # The release-day spelling of moe_intermediate_size (the 31B file still
  # carries it, as null). transformers 5.24 does not read it: accepted only
  # where it says the same as moe_intermediate_size.
  alias = raw.get("expert_intermediate_size")
  if alias is not None:
    if kw.get("moe_intermediate_size") not in (None, alias):
      raise ValueError(f"text_config.expert_intermediate_size ({alias}) and "
                       f"moe_intermediate_size ({kw['moe_intermediate_size']}) disagree")
    kw["moe_intermediate_size"] = alias
  # A dense model's config.json may spell its MoE fields as null.
  for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
    if kw.get(key) is not None and not kw.get("enable_moe_block", False):
      kw[key] = None
  per_layer = raw.get("per_layer_config")
  base = Gemma4TextConfig(**{**kw, "num_global_key_value_heads": None})
  if per_layer is not None:
    full = {int(i): o for i, o in per_layer.items()}
    dims = {o.get("head_dim", base.head_dim) for o in full.values()}
    heads = {o.get("num_key_value_heads", base.num_key_value_heads) for o in full.values()}
    want = {i for i in range(base.num_hidden_layers) if base.is_full(i)}
    if set(full) != want or len(dims) != 1 or len(heads) != 1:
      raise ValueError(f"text_config.per_layer_config must give every full layer {sorted(want)} "
                       f"the same head_dim and num_key_value_heads, got {per_layer}")
    kw["global_head_dim"], heads = dims.pop(), heads.pop()
    # None: "as the sliding layers" (the canonical spelling of no override).
    kw["num_global_key_value_heads"] = None if heads == base.num_key_value_heads else heads
  else:
    kw["global_head_dim"] = raw.get("global_head_dim") or 512
    # transformers applies the full-layer KV-head override only with k_eq_v.
    if kw.get("attention_k_eq_v", False):
      kw["num_global_key_value_heads"] = raw.get("num_global_key_value_heads")
  return Gemma4TextConfig(**kw)


def _check_rope(rope: dict, where: str, types: tuple[str, ...]) -> None:
  """Only the RoPE kinds cpjax implements, without scaling."""
  kind = rope.get("rope_type", "default")
  if kind not in types:
    raise ValueError(f"{where}.rope_type must be one of {list(types)}, got {kind!r}")
  if rope.get("factor", 1.0) != 1.0:
    raise ValueError(f"{where}.factor must be 1.0 (no RoPE scaling), got {rope['factor']}")
  if "rope_theta" not in rope:
    raise KeyError(f"{where} has no 'rope_theta'")
  unknown = sorted(set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
  if unknown:
    raise ValueError(f"{where} has keys cpjax does not implement: {unknown}")


def _vision_from_hf(raw: dict) -> Gemma4VisionConfig:
  _check_keys(raw, "vision_config", _VISION_READ)
  fields = {f.name for f in dataclasses.fields(Gemma4VisionConfig)}
  kw = {k: v for k, v in raw.items() if k in fields}
  # The tower has no full-attention layers: the converter writes its head_dim here too.
  if raw.get("global_head_dim", kw.get("head_dim")) != kw.get("head_dim"):
    raise ValueError(f"vision_config.global_head_dim ({raw['global_head_dim']}) must equal its "
                     f"head_dim ({kw.get('head_dim')}): the vision tower has no full layers")
  rope = raw.get("rope_parameters") or {}
  # The Hub's files say "default"; transformers reads that as the tower's
  # only kind, "axial" (standardize_rope_params with default_rope_type).
  if rope:
    _check_rope(rope, "vision_config.rope_parameters", ("default", "axial"))
    kw["rope_theta"] = float(rope["rope_theta"])
  return Gemma4VisionConfig(**kw)


def _pattern(layers: int, period: int) -> tuple[str, ...]:
  return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(layers))


_SMALL_VISION = Gemma4VisionConfig(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
    num_key_value_heads=12, head_dim=64, use_clipped_linears=True)
_LARGE_VISION = Gemma4VisionConfig(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, head_dim=72, standardize=True)
_PUBLISHED = dict(vocab_size=262144, head_dim=256, global_head_dim=512,
                  final_logit_softcapping=30.0, tie_word_embeddings=True)
# Tiny vision tower: patches of 4 pixels, 3x3 pooling, 2 layers.
_TINY_VISION = Gemma4VisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
             final_logit_softcapping=30.0, vocab_size_per_layer_input=512,
             max_position_embeddings=1 << 20)

PRESETS: dict[str, Gemma4Config] = {
    # --- the published sizes (transformers' converter and Google's gemma library)
    "e2b": Gemma4Config(text=Gemma4TextConfig(
        **_PUBLISHED, hidden_size=1536, num_hidden_layers=35, layer_types=_pattern(35, 5),
        num_attention_heads=8, num_key_value_heads=1, intermediate_size=6144,
        use_double_wide_mlp=True, sliding_window=512, hidden_size_per_layer_input=256,
        num_kv_shared_layers=20), vision=_SMALL_VISION, has_audio=True),
    "e4b": Gemma4Config(text=Gemma4TextConfig(
        **_PUBLISHED, hidden_size=2560, num_hidden_layers=42, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=10240, sliding_window=512,
        hidden_size_per_layer_input=256, num_kv_shared_layers=18),
        vision=_SMALL_VISION, has_audio=True),
    "a4b": Gemma4Config(text=Gemma4TextConfig(
        **_PUBLISHED, hidden_size=2816, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
        intermediate_size=2112, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, sliding_window=1024, hidden_size_per_layer_input=0,
        use_bidirectional_attention="vision", max_position_embeddings=262144),
        vision=_LARGE_VISION),
    "31b": Gemma4Config(text=Gemma4TextConfig(
        **_PUBLISHED, hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
        intermediate_size=21504, sliding_window=1024, hidden_size_per_layer_input=0,
        use_bidirectional_attention="vision", max_position_embeddings=262144),
        vision=_LARGE_VISION),
    # --- tiny models of the same architecture (tests, `cpjax train --model tiny`)
    # E2B-like: per-layer inputs, K/V sharing with a double-wide MLP in the
    # reuse layers, 4:1 pattern, clipped vision linears.
    "tiny": Gemma4Config(text=Gemma4TextConfig(
        **_TINY, num_hidden_layers=6, layer_types=_pattern(6, 3), hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True),
        vision=dataclasses.replace(_TINY_VISION, use_clipped_linears=True)),
    # 26B-A4B-like: MoE beside the dense MLP, k_eq_v with fewer full-layer KV
    # heads, vision groups bidirectional on sliding layers, standardize.
    "tiny-moe": Gemma4Config(text=Gemma4TextConfig(
        **{**_TINY, "intermediate_size": 48}, num_hidden_layers=4, layer_types=_pattern(4, 2),
        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=24, hidden_size_per_layer_input=0,
        use_bidirectional_attention="vision"),
        vision=dataclasses.replace(_TINY_VISION, standardize=True)),
    # use_bidirectional_attention="all" (every token sees both ways; no
    # published model uses it), default RoPE on full layers, untied head.
    "tiny-bidirectional": Gemma4Config(text=Gemma4TextConfig(
        **{**_TINY, "tie_word_embeddings": False}, num_hidden_layers=3, layer_types=_pattern(3, 2),
        hidden_size_per_layer_input=0, use_bidirectional_attention="all",
        full_rope_type="default"), vision=_TINY_VISION),
}
