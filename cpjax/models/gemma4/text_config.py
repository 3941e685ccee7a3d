"""Gemma 4's text decoder configuration (transformers' ``Gemma4TextConfig``).

Field names are Hugging Face's, so that a ``config.json`` maps onto them one
to one (:mod:`cpjax.models.gemma4.hf_config` reads it). The per-layer
attention kinds are :data:`FULL` and :data:`SLIDING`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import numpy as np

__all__ = ["FULL", "Gemma4TextConfig", "SLIDING"]

FULL, SLIDING = "full_attention", "sliding_attention"
_BIDIRECTIONAL = (None, "vision", "all")
ACTIVATION = "gelu_pytorch_tanh"


def require_positive(obj: object, names: Iterable[str]) -> None:
  """Raise a ``ValueError`` naming the first of ``obj``'s fields ``names`` that is not positive."""
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
    require_positive(
      self,
      (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "global_head_dim",
        "sliding_window",
        "max_position_embeddings",
      ),
    )
    layers = self.num_hidden_layers
    types = self.layer_types
    if types is None:
      types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers))
    types = tuple(types)
    if len(types) != layers or set(types) - {FULL, SLIDING}:
      raise ValueError(
        f"layer_types must be {layers} entries of {FULL!r} / {SLIDING!r}, got {list(types)}"
      )
    # As transformers: the last layer is always full attention.
    object.__setattr__(self, "layer_types", types[:-1] + (FULL,))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    for i in range(layers):
      if self.num_attention_heads % self.kv_heads(i):
        raise ValueError(
          f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
          f"layer {i}'s KV heads ({self.kv_heads(i)})"
        )
    if self.head_dim % 2 or self.global_head_dim % 2:
      raise ValueError(
        f"head_dim and global_head_dim must be even (RoPE), got {self.head_dim} "
        f"and {self.global_head_dim}"
      )
    if self.use_bidirectional_attention not in _BIDIRECTIONAL:
      raise ValueError(
        f"use_bidirectional_attention must be one of {_BIDIRECTIONAL}, got "
        f"{self.use_bidirectional_attention!r}"
      )
    if self.full_rope_type not in ("default", "proportional"):
      raise ValueError(
        f"full_rope_type must be 'default' or 'proportional', got {self.full_rope_type!r}"
      )
    if not 0 < self.full_partial_rotary_factor <= 1:
      raise ValueError(
        f"full_partial_rotary_factor must be in (0, 1], got {self.full_partial_rotary_factor}"
      )
    if not 0 <= self.num_kv_shared_layers <= layers:
      raise ValueError(
        f"num_kv_shared_layers must be in [0, {layers}], got {self.num_kv_shared_layers}"
      )
    if self.hidden_size_per_layer_input < 0:
      raise ValueError(
        f"hidden_size_per_layer_input must be >= 0, got {self.hidden_size_per_layer_input}"
      )
    if self.hidden_size_per_layer_input:
      require_positive(self, ("vocab_size_per_layer_input",))
    if self.enable_moe_block:
      require_positive(self, ("num_experts", "top_k_experts", "moe_intermediate_size"))
      assert self.top_k_experts is not None and self.num_experts is not None  # ints >= 1 now
      if self.top_k_experts > self.num_experts:
        raise ValueError(
          f"top_k_experts ({self.top_k_experts}) must be <= num_experts ({self.num_experts})"
        )
    self.kv_sharing_modes  # noqa: B018  (validates that every reused type has a store layer)

  # ------------------------------------------------------------ per layer
  def is_full(self, layer: int) -> bool:
    """Return whether ``layer`` is a full attention layer.

    Args:
      layer: the layer's index.

    Returns:
      True when its type is :data:`FULL`.
    """
    assert self.layer_types is not None  # __post_init__ fills it
    return self.layer_types[layer] == FULL

  def layer_head_dim(self, layer: int) -> int:
    """Return the head dim of ``layer``: ``global_head_dim`` if full, else ``head_dim``.

    Args:
      layer: the layer's index.

    Returns:
      The head dim.
    """
    return self.global_head_dim if self.is_full(layer) else self.head_dim

  def kv_heads(self, layer: int) -> int:
    """Return the key/value heads of ``layer``.

    ``num_global_key_value_heads`` for a full layer when it is set, else
    ``num_key_value_heads``.

    Args:
      layer: the layer's index.

    Returns:
      The key/value heads.
    """
    if self.is_full(layer) and self.num_global_key_value_heads is not None:
      return self.num_global_key_value_heads
    return self.num_key_value_heads

  def mlp_size(self, layer: int) -> int:
    """Return the MLP width of ``layer``.

    ``intermediate_size``, doubled for a K/V reuse layer when ``use_double_wide_mlp``.

    Args:
      layer: the layer's index.

    Returns:
      The MLP's intermediate size.
    """
    double = self.use_double_wide_mlp and self.kv_sharing_modes[layer] == "reuse"
    return self.intermediate_size * (2 if double else 1)

  @property
  def kv_sharing_modes(self) -> tuple[str | None, ...]:
    """Per layer: ``"store"`` (its K/V are reused later), ``"reuse"`` (it
    attends to the K/V of the store layer of its own type) or None."""
    layers, shared = self.num_hidden_layers, self.num_kv_shared_layers
    if shared == layers:
      # transformers: every layer reuses, nothing stores; it cannot run.
      raise ValueError(
        "num_kv_shared_layers equal to num_hidden_layers leaves no layer to compute K/V"
      )
    first = layers - shared
    modes: list[str | None] = [None if i < first else "reuse" for i in range(layers)]
    assert self.layer_types is not None  # __post_init__ fills it
    if shared:
      for kind in set(self.layer_types[first:]):
        owners = [i for i in range(first) if self.layer_types[i] == kind]
        if not owners:
          raise ValueError(
            f"reuse layers of type {kind!r} need an earlier {kind!r} layer "
            f"below layer {first} to store their K/V"
          )
      for kind in set(self.layer_types):
        owners = [i for i in range(first) if self.layer_types[i] == kind]
        if owners:
          modes[owners[-1]] = "store"
    return tuple(modes)

  def store_layer(self, layer: int) -> int:
    """Return the layer whose K/V a reuse layer attends to.

    Args:
      layer: the reuse layer's index.

    Returns:
      The store layer's index.
    """
    assert self.layer_types is not None  # __post_init__ fills it
    kind = self.layer_types[layer]
    return max(
      i for i, m in enumerate(self.kv_sharing_modes) if m == "store" and self.layer_types[i] == kind
    )

  @property
  def effective_sliding_window(self) -> int:
    """The window the sliding layers use (transformers' ``config.sliding_window``
    after its ``__post_init__``)."""
    if self.use_bidirectional_attention == "all":
      return self.sliding_window // 2 + 1
    return self.sliding_window

  def rope_inv_freq(self, layer: int) -> np.ndarray:
    """Return the RoPE inverse frequencies of ``layer``.

    Sliding: ``theta^(-2j/d)``. Full, proportional: the first
    ``int(factor * d // 2)`` pairs rotate with exponent denominator the FULL
    head dim ``d``; the rest have frequency 0 (identity).

    Args:
      layer: the layer's index.

    Returns:
      float64 numpy [head_dim // 2]: RoPE inverse frequencies of ``layer``.

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
      rotated = (
        int(self.full_partial_rotary_factor * d // 2)
        if self.full_rope_type == "proportional"
        else d // 2
      )
    # float32 as transformers computes them, so positions * inv_freq agree bit for bit.
    exponents = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(d)
    freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    return np.concatenate([freq, np.zeros(d // 2 - rotated, np.float32)])
