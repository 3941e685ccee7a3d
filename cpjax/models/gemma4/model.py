"""Gemma 4 (transformers' ``Gemma4ForConditionalGeneration``) in Flax NNX,
with the in-forward ("sunk") context-parallel path.

Parameter paths are Hugging Face's checkpoint keys (``model.language_model.
layers.3.self_attn.q_proj.weight`` ...), so loading and saving is a rename
of nothing (:mod:`cpjax.models.gemma4.checkpoint`).

Under context parallelism the model runs inside ``jax.shard_map``: it reads
the FULL ``input_ids`` only to derive small integer streams (token ids with
the placeholders replaced, each image token's soft-token number, vision
groups), cuts them to this rank's tokens with :func:`cpjax.shard_sequence`,
and embeds only those: the token and per-layer tables are looked up, and the
soft tokens placed, on ``L = S / cp`` tokens (:meth:`Gemma4.embed`).
Every attention layer calls :func:`cpjax.ring_attention` with Gemma 4's mask
for its layer type; a K/V-sharing ``reuse`` layer hands the ring the local
K/V shards its ``store`` layer computed (no projection is recomputed).
Without a :class:`CPContext` the same model runs on one device with dense
attention (:func:`cpjax.reference_attention`).

Shape letters: ``B`` batch, ``S`` full length, ``L`` tokens here, ``D``
model width, ``V`` vocabulary, ``N`` images, ``M`` pooled bins per image.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.typing import ArrayLike, DTypeLike

from cpjax import _deprecations, checks
from cpjax.attention.cp_context import ContextParallelSharder, CPContext, HiddenStates
from cpjax.attention.reference import reference_attention
from cpjax.attention.ring import ring_attention
from cpjax.batch.layout import LayoutKind, ShardLayout, layout_kind
from cpjax.batch.normalize import DOCUMENT_IDS_KEY, SOURCE_INDEX_KEY, vision_group_ids
from cpjax.batch.sharding import shard_sequence
from cpjax.masks import AttentionMask, KeyNotPadding, LocalWindow, SameDocument, SameVisionGroup
from cpjax.models.gemma4.audio import AudioTower, Split
from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
from cpjax.models.gemma4.checkpoint import KeySharding
from cpjax.models.gemma4.config import FULL, SLIDING, Gemma4Config
from cpjax.models.gemma4.cp_batch import (
  AUDIO_OFFSET_KEY,
  IMAGE_OFFSET_KEY,
  VIDEO_OFFSET_KEY,
  VISION_INPUTS,
  image_token_offsets,
  shard_aux_only_cp_batch,
)
from cpjax.models.gemma4.embedders import UnifiedVisionEmbedder
from cpjax.models.gemma4.layers import Buffer, Linear, RMSNorm, rope_angles, scaled
from cpjax.models.gemma4.remat import remat_after_cotangent, remat_policy
from cpjax.models.gemma4.text import DecoderLayer, embed_scale
from cpjax.models.gemma4.unified_config import (
  Gemma4UnifiedAudioConfig,
  Gemma4UnifiedVisionConfig,
)
from cpjax.models.gemma4.vision import MultimodalEmbedder, VisionTower
from cpjax.models.gemma4.vision_config import Gemma4VisionConfig
from cpjax.parallel import gathered, lookup

__all__ = ["Gemma4", "gemma4_masks"]

UNSUPPORTED_INPUTS = {
  "input_features": "audio inputs: this Gemma 4 has no audio tower or embedder (audio_config "
  "is null)",
}


class Embedding(nnx.Module):
  def __init__(self, vocab: int, width: int, *, rngs: nnx.Rngs | None):
    init = (
      jax.random.normal(rngs.params(), (vocab, width)) * width**-0.5
      if rngs is not None
      else jnp.zeros((vocab, width))
    )
    self.weight = nnx.Param(init.astype(jnp.float32))


class LanguageModel(nnx.Module):
  """``model.language_model``: embeddings, per-layer inputs, layers, final norm."""

  def __init__(self, cfg: Gemma4Config, *, rngs):
    t = cfg.text
    self.embed_tokens = Embedding(t.vocab_size, t.hidden_size, rngs=rngs)
    if t.hidden_size_per_layer_input:
      width = t.num_hidden_layers * t.hidden_size_per_layer_input
      self.embed_tokens_per_layer = Embedding(t.vocab_size_per_layer_input, width, rngs=rngs)
      self.per_layer_model_projection = Linear(t.hidden_size, width, rngs=rngs)
      self.per_layer_projection_norm = RMSNorm(t.hidden_size_per_layer_input, eps=t.rms_norm_eps)
    self.layers = nnx.List([DecoderLayer(t, i, rngs=rngs) for i in range(t.num_hidden_layers)])
    self.norm = RMSNorm(t.hidden_size, eps=t.rms_norm_eps)


class Gemma4Model(nnx.Module):
  """``model``: language model, vision tower and ``embed_vision``, audio tower
  and ``embed_audio`` (E2B, E4B); the unified model's ``vision_embedder``,
  ``embed_vision`` and ``embed_audio`` in their place."""

  def __init__(self, cfg: Gemma4Config, *, rngs):
    self.language_model = LanguageModel(cfg, rngs=rngs)
    d = cfg.text.hidden_size
    if cfg.unified:
      v, a = cfg.vision, cfg.audio
      if isinstance(v, Gemma4UnifiedVisionConfig):
        self.vision_embedder = UnifiedVisionEmbedder(v, rngs=rngs)
        self.embed_vision = MultimodalEmbedder(v.mm_embed_dim, d, eps=v.rms_norm_eps, rngs=rngs)
      if isinstance(a, Gemma4UnifiedAudioConfig):
        self.embed_audio = MultimodalEmbedder(a.audio_embed_dim, d, eps=a.rms_norm_eps, rngs=rngs)
    elif isinstance(cfg.vision, Gemma4VisionConfig):
      self.vision_tower = VisionTower(cfg.vision, rngs=rngs)
      self.embed_vision = MultimodalEmbedder(
        cfg.vision.hidden_size, cfg.text.hidden_size, eps=cfg.vision.rms_norm_eps, rngs=rngs
      )
    if isinstance(cfg.audio, Gemma4AudioConfig):
      self.audio_tower = AudioTower(cfg.audio, rngs=rngs)
      self.embed_audio = MultimodalEmbedder(
        cfg.audio.output_proj_dims, d, eps=cfg.audio.rms_norm_eps, rngs=rngs
      )


@_deprecations.renamed_keywords("cpjax.models.gemma4.gemma4_masks", segment_ids="document_ids")
def gemma4_masks(
  cfg: Gemma4Config,
  *,
  document_ids: jax.Array,
  padding_mask: jax.Array,
  vision_group_ids: jax.Array | None = None,
) -> dict[str, AttentionMask]:
  """Build Gemma 4's attention mask of each layer type, as transformers builds them.

  * full: causal (``k <= q``); sliding: ``q - W < k <= q``;
  * sliding with vision groups (``use_bidirectional_attention == "vision"``
    and ``mm_token_type_ids`` given): ``k > q - W and (k <= q or same
    group)``: later tokens of the same image are visible without limit,
    earlier ones only within the window. Full layers stay causal;
  * the unified model (its forward's masks): every layer type ORs the
    group in, ``k <= q or same group`` and ``q - W < k <= q or same group``;
  * ``"all"``: full layers see every key, sliding ``|q - k| <= W // 2 + 1``;

  and always: keys of the same document (``document_ids``), not padding.

  Args:
    cfg: the :class:`Gemma4Config`.
    document_ids: [B, S] document ids.
    padding_mask: [B, S] (True = pad).
    vision_group_ids: [B, S] vision groups (-1 for text), or None.

  Returns:
    ``{layer type: AttentionMask}``.

  >>> import numpy as np
  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> cfg = Gemma4Config.preset("tiny-moe")
  >>> masks = gemma4_masks(cfg, document_ids=np.ones((1, 4), np.int32),
  ...                      padding_mask=np.zeros((1, 4), bool),
  ...                      vision_group_ids=np.array([[-1, 0, 0, -1]]))
  >>> np.asarray(masks["sliding_attention"].allowed(np.arange(4))[0]).astype(int).tolist()
  [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
  """
  t = cfg.text
  w = t.effective_sliding_window
  common = SameDocument() & KeyNotPadding()
  arrays = {"document_ids": document_ids, "padding_mask": padding_mask}
  if t.use_bidirectional_attention == "all":
    rules = {FULL: LocalWindow(None, None), SLIDING: LocalWindow(w, w)}
  elif vision_group_ids is not None and t.use_bidirectional_attention == "vision" and cfg.unified:
    rules = {
      FULL: LocalWindow(None, 0) | SameVisionGroup(),
      SLIDING: LocalWindow(w - 1, 0) | SameVisionGroup(),
    }
  elif vision_group_ids is not None and t.use_bidirectional_attention == "vision":
    rules = {
      FULL: LocalWindow(None, 0),
      SLIDING: LocalWindow(w - 1, None) & (LocalWindow(None, 0) | SameVisionGroup()),
    }
  else:
    rules = {FULL: LocalWindow(None, 0), SLIDING: LocalWindow(w - 1, 0)}
  out = {}
  for kind, rule in rules.items():
    extra = {}
    if "vision_group_ids" in rule.array_kinds():
      assert vision_group_ids is not None  # only the rules built with them read them
      extra = {"vision_group_ids": vision_group_ids}
    out[kind] = AttentionMask(rule & common, {**arrays, **extra})
  return out


def _once_across_ranks(features, cp: CPContext | None, *inputs):
  """``features(*inputs)`` (a tower over images or clips, batched on axis 0)
  with each item computed once across the cp ranks: rank r runs it on items
  ``r * P ... r * P + P - 1`` (``P = ceil(N / cp)``, wrapping around to real
  items where ``cp`` does not divide ``N``) and an all-gather gives every
  rank every result. The tower's work and activations per rank fall by
  ``cp``; its gradient returns to the rank that computed each item."""
  inputs = tuple(jnp.asarray(x) for x in inputs)
  if cp is None or cp.layout.cp_size == 1:
    return features(*inputs)
  n = inputs[0].shape[0]
  per = -(-n // cp.layout.cp_size)
  mine = (jax.lax.axis_index(cp.axis_name) * per + jnp.arange(per)) % n
  out = features(*(x[mine] for x in inputs))
  gather = functools.partial(jax.lax.all_gather, axis_name=cp.axis_name, axis=0, tiled=True)
  return jax.tree.map(lambda y: gather(y)[:n], out)


def _slot_sources(valid: jax.Array, slot: jax.Array) -> jax.Array:
  """Where each token's soft token lives: the flat index of the ``slot``-th
  True of ``valid`` [K] (the real bins, patches or frames, in order), for
  slots int[B, L] (-1: none; any index is returned there)."""
  k = valid.shape[0]
  rank = jnp.cumsum(valid) - 1
  where_real = (
    jnp.zeros((k,), jnp.int32)
    .at[jnp.where(valid, rank, k)]
    .set(jnp.arange(k, dtype=jnp.int32), mode="drop")
  )
  return where_real[jnp.clip(slot, 0, k - 1)]


# What the model reads from every batch (prepare_batch and the sharder add them).
MODEL_INPUTS = ("input_ids", "position_ids", "padding_mask", DOCUMENT_IDS_KEY)


def _path(table: str) -> tuple[str, ...]:
  """The state path of the language model's ``table``'s weight (for :class:`CPContext`)."""
  return ("model", "language_model", table, "weight")


class Gemma4(nnx.Module):
  """Gemma 4: ``logits = model(batch, cp=...)``.

  Args:
    cfg: the :class:`Gemma4Config`.
    rngs: initialisation randomness (None: zeros, for loading over).
    dtype: activation dtype.
    param_dtype: dtype the parameters are stored in.
    remat: per-layer rematerialisation, one of :data:`REMAT_POLICIES`
      (True means ``"full"``, False ``"none"``).

  Example:
    >>> import numpy as np
    >>> from cpjax.models.gemma4 import Gemma4, Gemma4Config, prepare_batch
    >>> cfg = Gemma4Config.preset("tiny")
    >>> model = Gemma4(cfg, rngs=nnx.Rngs(0))
    >>> batch = prepare_batch({"input_ids": np.ones((1, 8), np.int32)}, cfg)
    >>> model(batch).shape
    (1, 8, 512)
  """

  # State stored split over cp (cpjax.parallel.STATE_AXES) that the forward
  # gathers where it is used: each decoder layer inside its remat scope, the
  # tables looked up round the ring, the head left to the vocabulary-parallel
  # loss. The training step gathers the rest when it starts.
  GATHERED_AT_USE = (
    ("model", "language_model", "layers"),
    ("model", "language_model", "embed_tokens"),
    ("model", "language_model", "embed_tokens_per_layer"),
    ("lm_head",),
  )

  def __init__(
    self,
    cfg: Gemma4Config,
    *,
    rngs: nnx.Rngs | None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    remat: bool | str = False,
  ):
    if not isinstance(cfg, Gemma4Config):
      raise TypeError(f"cfg must be a Gemma4Config, got {type(cfg).__name__}")
    self.cfg = cfg
    self.dtype = dtype
    self.remat = remat_policy(remat)
    self.model = Gemma4Model(cfg, rngs=rngs)
    if not cfg.text.tie_word_embeddings:
      self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, rngs=rngs)
    if param_dtype != jnp.float32:
      for _, var in nnx.iter_graph(self):
        if isinstance(var, (nnx.Param, Buffer)):
          var.set_value(var.get_value().astype(param_dtype))

  # ------------------------------------------------------------ checkpoints
  @classmethod
  def from_pretrained(
    cls,
    path: str | os.PathLike[str],
    *,
    dtype: DTypeLike = jnp.float32,
    mesh: Mesh | None = None,
    sharding: KeySharding | None = None,
    remat: bool | str = False,
  ) -> Gemma4:
    """Load a Hugging Face checkpoint directory (``config.json`` plus
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``).

    Strict and streaming (see :mod:`cpjax.models.gemma4.checkpoint`).
    ``dtype`` is the parameter and activation dtype; ``mesh`` places every
    tensor as it is read, replicated or per ``sharding(key, shape) ->
    PartitionSpec``.
    """
    from cpjax.models.gemma4.checkpoint import load_pretrained

    return load_pretrained(cls, path, dtype=dtype, mesh=mesh, sharding=sharding, remat=remat)

  def example_inputs(self) -> tuple[tuple, dict]:
    """Return the ``(args, kwargs)`` of a one-row, 8-token call of :meth:`hidden_states`.

    It is what :func:`cpjax.training.lora.apply_lora` runs the model on to
    create its adapters (any values of the right structure do).

    Returns:
      ``(args, kwargs)``.
    """
    import numpy as np

    from cpjax.models.gemma4.cp_batch import prepare_batch

    ids = np.full((1, 8), self.cfg.text.pad_token_id + 1, np.int32)
    return (prepare_batch({"input_ids": ids}, self.cfg),), {}

  def save_pretrained(
    self, path: str | os.PathLike[str], *, max_shard_bytes: int = 4 << 30
  ) -> list[str]:
    """Write a checkpoint transformers' ``Gemma4ForConditionalGeneration.
    from_pretrained`` loads; ``from_pretrained`` reads it back bit for bit."""
    from cpjax.models.gemma4.checkpoint import save_pretrained

    return save_pretrained(self, path, max_shard_bytes=max_shard_bytes)

  # ------------------------------------------------------------- embeddings
  def token_streams(self, batch: Mapping[str, Any]) -> dict:
    """Compute the integer streams the embeddings need, on the FULL row [B, S].

    They are cheap: under CP they are cut to this rank's tokens before any
    float work.

    Args:
      batch: the model's batch.

    Returns:
      ``text_ids`` (placeholders replaced by the pad id), ``image_slot`` (each
      image token's index among the global batch's image tokens, -1 elsewhere),
      ``video_slot`` (the same for video tokens; None for a batch without
      video frames), ``audio_slot`` (the same for audio tokens; None for a
      model without audio) and ``vision_groups`` (or None).
    """
    cfg, t = self.cfg, self.cfg.text
    for key, why in UNSUPPORTED_INPUTS.items():
      if batch.get(key) is not None and not (key == "input_features" and cfg.audio is not None):
        raise ValueError(f"batch key {key!r} is not supported: {why}")
    ids = jnp.asarray(batch["input_ids"])
    placeholder = jnp.isin(ids, jnp.asarray(cfg.placeholder_token_ids))

    def slots(is_token, offset_key):
      # A data-parallel shard holds only some rows: batch[offset_key] int[B]
      # says how many such tokens precede each of its rows.
      offsets = batch.get(offset_key)
      if offsets is None:
        offsets = image_token_offsets(is_token)
      slot = jnp.asarray(offsets)[:, None] + jnp.cumsum(is_token, axis=1, dtype=jnp.int32) - 1
      return jnp.where(is_token, slot, -1).astype(jnp.int32)

    groups = None
    types = batch.get("mm_token_type_ids")
    if types is not None and t.use_bidirectional_attention == "vision":
      groups = vision_group_ids(jnp.asarray(types))
    return {
      "text_ids": jnp.where(placeholder, t.pad_token_id, ids),
      "image_slot": slots(ids == cfg.image_token_id, IMAGE_OFFSET_KEY),
      "video_slot": None
      if batch.get("pixel_values_videos") is None
      else slots(ids == cfg.video_token_id, VIDEO_OFFSET_KEY),
      # Only a model with audio places it (the others refuse it above).
      "audio_slot": None
      if cfg.audio is None
      else slots(ids == cfg.audio_token_id, AUDIO_OFFSET_KEY),
      "vision_groups": groups,
    }

  def embed(
    self, batch: Mapping[str, Any], cp: CPContext | None = None
  ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Embed this device's tokens.

    Only :meth:`token_streams` see the full row; the table lookups, the
    soft-token placement and the per-layer projection run on the ``L``
    local tokens, so no float tensor of the full row exists. Positions the
    layout pads on get zeros, as if the full-row embeddings were padded.

    Args:
      batch: the model's batch.
      cp: the :class:`CPContext`, or None on one device.

    Returns:
      Embeddings [B, L, D], per-layer inputs [B, L, layers, P] (or None) and
      vision group ids [B, L] (or None) of this device's tokens.
    """
    t, dt = self.cfg.text, self.dtype
    lm = self.model.language_model
    streams = self.token_streams(batch)
    text_ids, slot, groups = streams["text_ids"], streams["image_slot"], streams["vision_groups"]
    audio_slot, video_slot = streams["audio_slot"], streams["video_slot"]
    inside = jnp.ones(text_ids.shape, bool)
    if cp is not None:
      cut = functools.partial(
        shard_sequence,
        layout=cp.layout,
        axis_name=cp.axis_name,
        source_index=batch.get(SOURCE_INDEX_KEY),
      )
      text_ids, slot = cut(text_ids, pad_value=t.pad_token_id), cut(slot, pad_value=-1)
      audio_slot = None if audio_slot is None else cut(audio_slot, pad_value=-1)
      video_slot = None if video_slot is None else cut(video_slot, pad_value=-1)
      groups = None if groups is None else cut(groups, pad_value=-1)
      inside = cut(inside, pad_value=False)

    def table_lookup(name):
      table = getattr(lm, name).weight[...]
      return lookup(table, text_ids) if cp is None else cp.lookup(table, text_ids, _path(name))

    x = table_lookup("embed_tokens").astype(dt) * embed_scale(t.hidden_size, dt)
    if batch.get("pixel_values") is not None:
      x = self._place_vision(x, slot, batch, cp, "image")
    if video_slot is not None:
      x = self._place_vision(x, video_slot, batch, cp, "video")
    if audio_slot is not None and batch.get("input_features") is not None:
      x = self._place_audio(x, audio_slot, batch, cp)
    x = jnp.where(inside[..., None], x, 0)
    per_layer = None
    if t.hidden_size_per_layer_input:
      b, l = text_ids.shape
      p = t.hidden_size_per_layer_input
      shape = (b, l, t.num_hidden_layers, p)
      token = (table_lookup("embed_tokens_per_layer").astype(dt) * embed_scale(p, dt)).reshape(
        shape
      )
      # Both scales are Python numbers in transformers (scaled).
      context = scaled(lm.per_layer_model_projection(x), t.hidden_size**-0.5)
      context = lm.per_layer_projection_norm(context.reshape(shape))
      per_layer = scaled(context + token, 2**-0.5)
      per_layer = jnp.where(inside[..., None, None], per_layer, 0)
    return x, per_layer, groups

  def image_features(
    self, pixel_values: ArrayLike, image_position_ids: ArrayLike
  ) -> tuple[jax.Array, jax.Array]:
    """Compute the soft tokens of every image.

    Args:
      pixel_values: [N, P, F] images.
      image_position_ids: int[N, P, 2] patch positions.

    Returns:
      ([N, M, D] in the activation dtype, bool[N, M]).
    """
    if self.cfg.vision is None:
      raise ValueError(
        "this Gemma 4 has no vision tower (vision_config is null) but the batch has pixel_values"
      )
    if self.cfg.unified:  # every real patch is a soft token
      positions = jnp.asarray(image_position_ids)
      patches = self.model.vision_embedder(pixel_values, positions, self.dtype)
      soft = self.model.embed_vision(patches).astype(self.dtype)
      return soft, ~jnp.all(positions == -1, axis=-1)
    pooled, valid = self.model.vision_tower(
      jnp.asarray(pixel_values), jnp.asarray(image_position_ids), self.dtype
    )
    return self.model.embed_vision(pooled).astype(self.dtype), valid

  def audio_features(
    self, input_features: ArrayLike, input_features_mask: ArrayLike
  ) -> tuple[jax.Array, jax.Array]:
    """Compute the soft tokens of every clip (E2B, E4B's audio tower).

    Args:
      input_features: [A, T, F] log-mel frames.
      input_features_mask: bool[A, T], False on padding frames.

    Returns:
      ([A, U, D] in the activation dtype, bool[A, U] the soft tokens of real
      frames: ``U = ceil(ceil(T / 2) / 2)``).
    """
    if not isinstance(self.cfg.audio, Gemma4AudioConfig):
      raise ValueError(
        "this Gemma 4 has no audio tower (audio_config is null, or it is the unified "
        "model's embedder) but audio_features was called"
      )
    soft, real = self.model.audio_tower(input_features, input_features_mask, self.dtype)
    return self.model.embed_audio(soft).astype(self.dtype), real

  def _split_audio_features(self, frames, real, cp: CPContext):
    """:meth:`audio_features` with every clip's frames split in order over the
    cp ranks (padded, as not real, to whole attention blocks a rank), each
    rank's soft tokens all-gathered: ([A, U', D], bool[A, U']) with ``U' >=
    U`` (the padding's are not real)."""
    cfg, size = self.cfg.audio, cp.layout.cp_size
    assert isinstance(cfg, Gemma4AudioConfig)
    quantum = Split.quantum(cfg) * size
    t = frames.shape[1]
    padded = -(-t // quantum) * quantum
    frames = jnp.pad(frames, ((0, 0), (0, padded - t), (0, 0)))
    real = jnp.pad(real, ((0, 0), (0, padded - t)))
    run = padded // size
    start = jax.lax.axis_index(cp.axis_name) * run
    mine = functools.partial(
      jax.lax.dynamic_slice_in_dim, start_index=start, slice_size=run, axis=1
    )
    split = Split(cp.axis_name, size)
    soft, valid = self.model.audio_tower(mine(frames), mine(real), self.dtype, split=split)
    soft = self.model.embed_audio(soft).astype(self.dtype)
    gather = functools.partial(jax.lax.all_gather, axis_name=cp.axis_name, axis=1, tiled=True)
    return gather(soft), gather(valid)

  def _split_image_features(self, pixel_values, image_position_ids, cp: CPContext | None):
    """:meth:`image_features` with each image computed once across the cp ranks
    (:func:`_once_across_ranks`)."""
    return _once_across_ranks(self.image_features, cp, pixel_values, image_position_ids)

  def _place_vision(self, x, slot, batch, cp: CPContext | None, kind: str):
    """Soft tokens, numbered row-major over the GLOBAL batch, replace the
    image (``kind="image"``) or video (``"video"``) tokens: ``slot`` int[B,
    L] is each such token's number (-1 for the rest)."""
    pixels_key, positions_key = VISION_INPUTS[kind][:2]
    if self.cfg.unified:
      # Each soft token is its own patch's: embed only this device's.
      pixels, positions = (
        jnp.asarray(batch[pixels_key]),
        jnp.asarray(batch[positions_key]),
      )
      n, m = positions.shape[:2]
      source = _slot_sources(~jnp.all(positions == -1, axis=-1).reshape(n * m), slot)
      patches = pixels.reshape(n * m, -1)[source], positions.reshape(n * m, 2)[source]
      soft = self.model.embed_vision(self.model.vision_embedder(*patches, self.dtype))
      return jnp.where((slot >= 0)[..., None], soft.astype(x.dtype), x)
    soft, valid = self._split_image_features(batch[pixels_key], batch[positions_key], cp)
    n, m, d = soft.shape
    source = _slot_sources(valid.reshape(n * m), slot)
    return jnp.where((slot >= 0)[..., None], gathered(soft.reshape(n * m, d))[source], x)

  def _place_audio(self, x, slot, batch, cp: CPContext | None):
    """Audio soft tokens, numbered row-major over the GLOBAL batch, replace the
    audio tokens (``slot`` as in :meth:`_place_vision`).

    E2B, E4B: every soft token of a real frame is placed. Under CP with
    fewer clips than ranks (a long clip in a row), each clip's frames are
    split over the ranks and the tower runs on each rank's run, taking its
    neighbours' frames where it reads across (:class:`~cpjax.models.gemma4.
    audio.Split`); otherwise each clip runs whole on one rank. The unified
    model: each real frame of ``input_features`` [A, T, samples]
    (``input_features_mask`` bool[A, T]) is one soft token, and only this
    device's frames are embedded."""
    frames = jnp.asarray(batch["input_features"])
    a, t, width = frames.shape
    real = batch.get("input_features_mask")
    real = jnp.ones((a, t), bool) if real is None else jnp.asarray(real, bool)
    if isinstance(self.cfg.audio, Gemma4AudioConfig):
      if cp is not None and 1 < cp.layout.cp_size and a < cp.layout.cp_size:
        soft, valid = self._split_audio_features(frames, real, cp)
      else:
        soft, valid = _once_across_ranks(self.audio_features, cp, frames, real)
      a, u, d = soft.shape
      source = _slot_sources(valid.reshape(a * u), slot)
      return jnp.where((slot >= 0)[..., None], gathered(soft.reshape(a * u, d))[source], x)
    source = _slot_sources(real.reshape(a * t), slot)
    soft = self.model.embed_audio(frames.reshape(a * t, width)[source].astype(self.dtype))
    return jnp.where((slot >= 0)[..., None], soft.astype(x.dtype), x)

  # ---------------------------------------------------------------- forward
  def __call__(self, batch: Mapping[str, Any], *, cp: CPContext | None = None):
    """Logits float32[B, L, V] of this device's tokens (all S without ``cp``).

    Training does not call this: :meth:`hidden_states` hands the loss the
    final hidden states and the head, and the loss never holds these logits.

    ``batch`` holds the full-length primary streams (``input_ids``,
    ``mm_token_type_ids``, ``pixel_values``, ``image_position_ids``) and the
    per-token streams of the tokens computed here (``position_ids``,
    ``padding_mask``, the document ids ``_packed_seq_ids`` under NeMo's
    name): local parts under CP, as the
    model's sharder (:meth:`prepare_model_inputs_for_cp`) produces them.
    """
    out = self.hidden_states(batch, cp=cp)
    logits = jnp.einsum("bld,vd->blv", out.hidden, out.head, preferred_element_type=jnp.float32)
    cap = out.logits_soft_cap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

  def hidden_states(self, batch: Mapping[str, Any], *, cp: CPContext | None = None) -> HiddenStates:
    """Return the final hidden states of this device's tokens, the output head and the soft cap.

    What :func:`cpjax.training.step.make_train_step` trains through
    (:func:`cpjax.training.loss.linear_cross_entropy`). Same arguments as
    calling the model.

    Args:
      batch: the model's batch, as when calling the model.
      cp: the :class:`CPContext`, or None on one device.

    Returns:
      :class:`HiddenStates`: the final hidden states [B, L, D] of this
      device's tokens, the output head [V, D] and the final soft cap.
    """
    checks.mapping("batch", batch)
    missing = [k for k in MODEL_INPUTS if k not in batch]
    if missing:
      raise KeyError(
        f"the model's batch lacks {missing}: pass a batch through "
        f"gemma4.prepare_batch (one device) or the model's sharder (CP), which "
        f"add them; got keys {sorted(batch)}"
      )
    if cp is not None and not isinstance(cp, CPContext):
      raise TypeError(f"cp must be a cpjax.CPContext or None, got {type(cp).__name__}")
    x, per_layer, groups = self.embed(batch, cp)
    return self.decode(x, per_layer, groups, batch, cp)

  def decode(
    self,
    x: jax.Array,
    per_layer: jax.Array | None,
    groups: jax.Array | None,
    batch: Mapping[str, Any],
    cp: CPContext | None,
  ) -> HiddenStates:
    """Run the decoder on this device's tokens: embeddings x [B, L, D] -> :class:`HiddenStates`.

    Args:
      x: embeddings [B, L, D].
      per_layer: per-layer inputs [B, L, layers, P], or None.
      groups: vision group ids [B, L], or None.
      batch: the model's batch.
      cp: the :class:`CPContext`, or None on one device.

    Returns:
      The :class:`HiddenStates`.
    """
    t = self.cfg.text
    assert t.layer_types is not None  # Gemma4TextConfig.__post_init__ fills it
    if cp is not None:
      cp.check_layer_kinds(t.layer_types)
    positions = jnp.asarray(batch["position_ids"])
    masks = gemma4_masks(
      self.cfg,
      document_ids=jnp.asarray(batch[DOCUMENT_IDS_KEY]),
      padding_mask=jnp.asarray(batch["padding_mask"]),
      vision_group_ids=groups,
    )
    ropes = {}
    for i, kind in enumerate(t.layer_types):
      if kind not in ropes:
        ropes[kind] = rope_angles(positions, t.rope_inv_freq(i), x.dtype)

    def make_attend(masks):
      def attend(q, k, v, layer):
        mask = masks[t.layer_types[layer]]
        if cp is None:
          out = reference_attention(q, k, v, mask=mask, scale=1.0)
        else:
          out = ring_attention(
            q,
            k,
            v,
            layout=cp.layout,
            axis_name=cp.axis_name,
            mask=mask,
            scale=1.0,
            **cp.attention_options(t.layer_types[layer]),
          )
        return checkpoint_name(out, "attention_out")

      return attend

    experts = {} if cp is None else cp.expert_options()
    shared_kv: dict = {}
    stats = []
    for i, layer in enumerate(self.model.language_model.layers):
      kind = t.layer_types[i]
      pl = None if per_layer is None else per_layer[:, :, i]
      prefix = ("model", "language_model", "layers", str(i))
      if self.remat == "none":
        if cp is not None and cp.gathered:
          graphdef, state = nnx.split(layer)
          layer = nnx.merge(graphdef, cp.gather(state, prefix))
        x, kv, layer_stats = _run_layer(
          layer, x, pl, shared_kv, rope=ropes[kind], attend=make_attend(masks), **experts
        )
      else:
        # Everything the layer reads is an argument (no array is closed
        # over), as a custom VJP needs.
        graphdef, state = nnx.split(layer)

        def body(st, x, pl, kv, rope, masks, graphdef=graphdef, prefix=prefix):
          if cp is not None:  # this layer's weights, whole, only inside its remat scope
            st = cp.gather(st, prefix)
          return _run_layer(
            nnx.merge(graphdef, st), x, pl, kv, rope=rope, attend=make_attend(masks), **experts
          )

        if self.remat == "full":
          run = remat_after_cotangent(body)
        else:
          run = jax.checkpoint(
            body, policy=jax.checkpoint_policies.save_only_these_names("attention_out")
          )
        x, kv, layer_stats = run(state, x, pl, dict(shared_kv), ropes[kind], masks)
      if t.kv_sharing_modes[i] == "store":
        shared_kv[kind] = kv
      if layer_stats is not None:
        stats.append(layer_stats)
    x = self.model.language_model.norm(x)
    if t.tie_word_embeddings:
      head, path = self.model.language_model.embed_tokens.weight[...], _path("embed_tokens")
    else:
      head, path = self.lm_head.weight[...], ("lm_head", "weight")
    head_axis = None
    if cp is not None:
      head, head_axis = cp.head(head, path)
    metrics = None
    if stats:  # what the routers did, per MoE layer: the step reports it
      metrics = {
        "expert_tokens": jax.lax.stop_gradient(jnp.stack([s.tokens for s in stats])),
        "expert_dropped": jax.lax.stop_gradient(jnp.stack([s.dropped for s in stats])),
      }
    return HiddenStates(x, head.astype(x.dtype), t.final_logit_softcapping, metrics, head_axis)

  def prepare_model_inputs_for_cp(
    self,
    batch: Mapping[str, Any] | None = None,
    *,
    layout: LayoutKind | ShardLayout = "contiguous",
  ) -> dict:
    """Return the model's :class:`ContextParallelSharder`: the aux-only sharder.

    Its ``shard_batch`` is the aux-only sharder; the CP dispatch calls it
    instead of a generic one.

    Args:
      batch: unused (the sharder is the same for every batch of this model).
      layout: a :data:`~cpjax.batch.LayoutKind`, ``"contiguous"`` as the
        original, ``"load_balanced"`` or ``"document_balanced"``, whose stripes
        are no shorter than the sliding window and whose balance counts the
        work of each layer, sliding and full; or a :class:`cpjax.ShardLayout`
        to shard exactly that way (as :func:`cpjax.shard_batch`).

    Returns:
      ``{"cp_sharder": ContextParallelSharder}``.
    """
    del batch  # the sharder is the same for every batch of this model
    layout_kind(layout)  # checked now, not at the first batch
    t = self.cfg.text
    assert t.layer_types is not None  # Gemma4TextConfig.__post_init__ fills it
    return {
      "cp_sharder": ContextParallelSharder(
        shard_batch=functools.partial(
          _sharder_call,
          layout=layout,
          image_token_id=self.cfg.image_token_id,
          audio_token_id=self.cfg.audio_token_id if self.cfg.audio is not None else None,
          video_token_id=self.cfg.video_token_id,
          # document_balanced: stripes no shorter than the window keep its ring
          # at one hop, and the balance counts each layer's own work.
          min_stripe_len=t.effective_sliding_window,
          layer_windows=tuple(
            t.effective_sliding_window if kind == SLIDING else None for kind in t.layer_types
          ),
        )
      )
    }


def _run_layer(layer, x, per_layer_input, shared_kv, *, rope, attend, **experts):
  return layer(x, per_layer_input, rope, attend, shared_kv, **experts)


def _sharder_call(batch, mesh, *, layout, image_token_id, **kw):
  """``shard_batch(batch, mesh, **kw)`` argument order for the Gemma 4 sharder."""
  return shard_aux_only_cp_batch(mesh, batch, layout=layout, image_token_id=image_token_id, **kw)
