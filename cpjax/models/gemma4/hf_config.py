"""Reading a Hugging Face ``config.json`` into Gemma 4's text and vision configurations.

Every key is read into the config, checked to hold the one value cpjax
implements, ignored on purpose (:data:`IGNORED_CONFIG_KEYS`, none of which
changes the model's mathematics), or refused: an unknown key is a
``ValueError`` naming it. Both spellings of the full-attention overrides are
read: the Hub's ``global_head_dim`` / ``num_global_key_value_heads``, or a
``per_layer_config`` saved by transformers 5.24.

>>> text_from_hf({"hidden_size": 64, "mystery": 1})
Traceback (most recent call last):
...
ValueError: text_config has keys cpjax does not know: ['mystery']; ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cpjax.models.gemma4.text_config import ACTIVATION, FULL, SLIDING, Gemma4TextConfig
from cpjax.models.gemma4.vision_config import Gemma4VisionConfig

__all__ = ["IGNORED_CONFIG_KEYS"]


# config.json keys that cpjax reads and leaves without effect, on purpose: none
# changes the model's mathematics. Bookkeeping (versions, names, output
# switches), generation settings, the initialiser of fresh weights, and the
# storage dtype (cpjax's ``dtype=`` chooses the compute and parameter dtype).
# Every other key is either read into the config, checked to hold the one
# value cpjax implements, or an unknown key (a ``ValueError`` naming it).
_BOOKKEEPING = frozenset(
  {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "initializer_range",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "use_cache",
    "model_type",
  }
)
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
  # E2B and E4B's audio tower, and the 12B unified model's audio embedder.
  "audio_config": _BOOKKEEPING,
}
# Keys that must hold the one value cpjax implements (transformers' defaults).
_REQUIRED_VALUES = {
  "hidden_activation": ACTIVATION,
  "attention_bias": False,
  "attention_dropout": 0.0,
}


def check_keys(raw: dict, where: str, read: set[str]) -> None:
  """Raise a ``ValueError`` for keys that are neither read, checked nor ignored."""
  for key, want in _REQUIRED_VALUES.items():
    value = raw.get(key, want)
    if value != want and not (value is None and key != "hidden_activation"):
      raise ValueError(
        f"{where}.{key} must be {want!r} (the only value cpjax implements), got {value!r}"
      )
  unknown = sorted(set(raw) - read - set(_REQUIRED_VALUES) - IGNORED_CONFIG_KEYS[where])
  if unknown:
    raise ValueError(
      f"{where} has keys cpjax does not know: {unknown}; they may change the "
      f"model's mathematics, so they are not ignored (keys ignored on purpose: "
      f"cpjax.models.gemma4.config.IGNORED_CONFIG_KEYS)"
    )


_TEXT_READ = {f.name for f in dataclasses.fields(Gemma4TextConfig)} | {
  "rope_parameters",
  "per_layer_config",
  "is_causal",
  "expert_intermediate_size",
}
_VISION_READ = {f.name for f in dataclasses.fields(Gemma4VisionConfig)} | {
  "rope_parameters",
  "global_head_dim",
}


def text_from_hf(raw: dict) -> Gemma4TextConfig:
  """Read transformers' ``text_config`` dict as a :class:`Gemma4TextConfig`."""
  check_keys(raw, "text_config", _TEXT_READ)
  fields = {f.name for f in dataclasses.fields(Gemma4TextConfig)}
  # The full-layer overrides are decided below, as transformers decides them.
  kw: dict[str, Any] = {
    k: v
    for k, v in raw.items()
    if k in fields and k not in ("global_head_dim", "num_global_key_value_heads")
  }
  if kw.get("layer_types") is not None:
    kw["layer_types"] = tuple(kw["layer_types"])
  # transformers writes is_causal = false exactly when every token sees both ways.
  causal = kw.get("use_bidirectional_attention") != "all"
  if raw.get("is_causal", causal) != causal:
    raise ValueError(
      f"text_config.is_causal={raw['is_causal']} contradicts "
      f"use_bidirectional_attention={kw.get('use_bidirectional_attention')!r}"
    )
  rope = raw.get("rope_parameters") or {}
  unknown = sorted(set(rope) - {SLIDING, FULL})
  if unknown:
    raise ValueError(
      f"text_config.rope_parameters must be keyed by {SLIDING!r} and {FULL!r}, got {unknown}"
    )
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
      raise ValueError(
        f"text_config.expert_intermediate_size ({alias}) and "
        f"moe_intermediate_size ({kw['moe_intermediate_size']}) disagree"
      )
    kw["moe_intermediate_size"] = alias
  # A dense model's config.json may spell its MoE fields as null.
  for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
    if kw.get(key) is not None and not kw.get("enable_moe_block", False):
      kw[key] = None
  per_layer = raw.get("per_layer_config")
  base = Gemma4TextConfig(**kw, num_global_key_value_heads=None)  # kw leaves it out
  if per_layer is not None:
    full = {int(i): o for i, o in per_layer.items()}
    dims = {o.get("head_dim", base.head_dim) for o in full.values()}
    heads = {o.get("num_key_value_heads", base.num_key_value_heads) for o in full.values()}
    want = {i for i in range(base.num_hidden_layers) if base.is_full(i)}
    if set(full) != want or len(dims) != 1 or len(heads) != 1:
      raise ValueError(
        f"text_config.per_layer_config must give every full layer {sorted(want)} "
        f"the same head_dim and num_key_value_heads, got {per_layer}"
      )
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


def vision_from_hf(raw: dict) -> Gemma4VisionConfig:
  """Read transformers' ``vision_config`` dict as a :class:`Gemma4VisionConfig`."""
  check_keys(raw, "vision_config", _VISION_READ)
  fields = {f.name for f in dataclasses.fields(Gemma4VisionConfig)}
  kw = {k: v for k, v in raw.items() if k in fields}
  # The tower has no full-attention layers: the converter writes its head_dim here too.
  if raw.get("global_head_dim", kw.get("head_dim")) != kw.get("head_dim"):
    raise ValueError(
      f"vision_config.global_head_dim ({raw['global_head_dim']}) must equal its "
      f"head_dim ({kw.get('head_dim')}): the vision tower has no full layers"
    )
  rope = raw.get("rope_parameters") or {}
  # The Hub's files say "default"; transformers reads that as the tower's
  # only kind, "axial" (standardize_rope_params with default_rope_type).
  if rope:
    _check_rope(rope, "vision_config.rope_parameters", ("default", "axial"))
    kw["rope_theta"] = float(rope["rope_theta"])
  return Gemma4VisionConfig(**kw)
