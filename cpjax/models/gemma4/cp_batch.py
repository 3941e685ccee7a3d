"""Gemma4's aux-only contiguous CP batch preparation, under the seed's names.

Gemma4 embeds, splices vision features, builds per-layer inputs and vision
group ids on the FULL row inside its forward and slices them there with
:func:`cpjax.shard_sequence`; the dispatch-time sharder therefore touches only
the auxiliary streams. The one Gemma4-specific piece is the document ids,
``_packed_seq_ids`` (NeMo's name for them, which the model reads and
produces, as the original): their pad zeros depend on the global pad tail,
which a rank holding only its slice cannot reconstruct, so they are
synthesized on the full pre-pad batch and sharded here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from cpjax import checks
from cpjax.batch import normalize as batch_lib
from cpjax.batch.layout import MIN_STRIPE_LEN, LayoutKind, ShardLayout
from cpjax.batch.sharding import shard_batch
from cpjax.models.gemma4.audio_config import Gemma4AudioConfig
from cpjax.models.gemma4.config import Gemma4Config
from cpjax.models.gemma4.unified_config import Gemma4UnifiedVisionConfig

__all__ = [
  "AUDIO_OFFSET_KEY",
  "IMAGE_OFFSET_KEY",
  "VIDEO_OFFSET_KEY",
  "VISION_INPUTS",
  "documents_from_positions",
  "synthetic_batch",
  "image_token_offsets",
  "make_contiguous_aux_only_shard_cp_batch",
  "prepare_batch",
  "shard_aux_only_cp_batch",
  "synthesize_single_document_seq_ids",
]

# Per-row count of image tokens in the global rows before it (see
# image_token_offsets): how a data-parallel shard finds its images.
IMAGE_OFFSET_KEY = "_image_token_offset"
# The same for audio tokens and video tokens.
AUDIO_OFFSET_KEY = "_audio_token_offset"
VIDEO_OFFSET_KEY = "_video_token_offset"


def image_token_offsets(is_image: ArrayLike) -> jax.Array:
  """Count the image tokens in the rows before each row.

  Args:
    is_image: bool[B, S], marks the image placeholders (an int array is read
      as ``mm_token_type_ids``: type 1 is an image).

  Returns:
    int32[B]: image tokens in the rows before each row.

  >>> import numpy as np
  >>> image_token_offsets(np.array([[1, 1, 0], [0, 0, 0], [0, 1, 0]])).tolist()
  [0, 2, 2]
  """
  is_image = jnp.asarray(is_image)
  if is_image.dtype != jnp.bool_:
    is_image = is_image == 1
  counts = jnp.sum(is_image, axis=1, dtype=jnp.int32)
  return jnp.cumsum(counts) - counts


def synthesize_single_document_seq_ids(batch: Mapping, seq_len: int) -> dict:
  """Run the original's ``_synthesize_single_document_seq_ids``, returning a new dict.

  The document ids, under NeMo's name ``_packed_seq_ids``, as
  :func:`cpjax.synthesize_document_ids` makes them.

  Args:
    batch: the batch.
    seq_len: its sequence length.

  Returns:
    A new dict, as :func:`cpjax.synthesize_document_ids` returns it.

  >>> import numpy as np
  >>> out = synthesize_single_document_seq_ids({"input_ids": np.zeros((2, 3), int)}, 3)
  >>> np.asarray(out["_packed_seq_ids"]).tolist()
  [[1, 1, 1], [1, 1, 1]]
  """
  return batch_lib.synthesize_document_ids(batch, seq_len)


def shard_aux_only_cp_batch(
  mesh: Mesh,
  batch: Mapping[str, Any],
  *,
  layout: LayoutKind | ShardLayout = "contiguous",
  axis_name: str = "cp",
  loss_mask: ArrayLike | None = None,
  padding_token_id: int = 0,
  extra_seq_keys: Mapping[str, int] | None = None,
  extra_pad_values: Mapping[str, Any] | None = None,
  pad_multiple: int = 1,
  batch_axis: str | None = None,
  image_token_id: int | None = None,
  implementation: str | None = None,
  min_stripe_len: int = MIN_STRIPE_LEN,
  layer_windows: Sequence[int | None] | None = None,
  audio_token_id: int | None = None,
  video_token_id: int | None = None,
) -> tuple[dict, ShardLayout]:
  """Shard a batch as Gemma4's aux-only CP shard, in any layout.

  Converts ``attention_mask``, synthesizes the document ids
  ``_packed_seq_ids`` (NeMo's name for them) from the full
  pre-pad ``padding_mask`` (its pad zeros depend on the global pad tail,
  which a rank holding only its slice cannot reconstruct), then shards
  ``labels`` / ``position_ids`` / ``loss_mask`` / ``padding_mask`` /
  ``_packed_seq_ids`` (padded with 0) and the extra keys over ``axis_name``,
  leaving ``input_ids`` / ``inputs_embeds``, ``mm_token_type_ids``,
  ``pixel_values`` / ``image_position_ids`` and their video counterparts full
  length and replicated for the model to slice. With images, each row's count of earlier image
  placeholders over the global batch is added as ``IMAGE_OFFSET_KEY``
  (placeholders are ``input_ids == image_token_id``, or
  ``mm_token_type_ids == 1`` without ``image_token_id``).

  Args:
    mesh: a mesh with an ``axis_name`` axis.
    batch: dict of [B, S, ...] arrays.
    layout: a :data:`~cpjax.batch.LayoutKind`, ``"contiguous"`` (default),
      ``"load_balanced"`` or ``"document_balanced"``, or a
      :class:`cpjax.ShardLayout` to shard exactly that way (as
      :func:`cpjax.shard_batch`).
    axis_name, loss_mask, padding_token_id, extra_seq_keys, extra_pad_values,
      pad_multiple, batch_axis, implementation, min_stripe_len, layer_windows:
      as :func:`cpjax.shard_batch`.
    image_token_id: the image placeholder id (None: placeholders are
      ``mm_token_type_ids == 1``).
    audio_token_id: the audio placeholder id: with ``input_features`` (the
      audio clips, kept whole like the images) each row's count of earlier
      audio placeholders is added as ``AUDIO_OFFSET_KEY``.
    video_token_id: the video placeholder id: with ``pixel_values_videos``
      each row's count of earlier video placeholders is added as
      ``VIDEO_OFFSET_KEY``.

  Returns:
    ``(sharded_batch, layout)`` as :func:`cpjax.shard_batch`.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None]}
    >>> out, lay = shard_aux_only_cp_batch(mesh, batch, layout="load_balanced")
    >>> lay.kind, np.asarray(out["position_ids"]).tolist(), out["input_ids"].shape
    ('load_balanced', [[0, 1, 6, 7, 2, 3, 4, 5]], (1, 6))
  """
  batch = batch_lib.attention_mask_to_padding_mask(batch)
  seq_len = batch_lib.primary_length(batch)
  batch = synthesize_single_document_seq_ids(batch, seq_len)
  out, shard_layout = shard_batch(
    batch,
    mesh,
    axis_name=axis_name,
    layout=layout,
    aux_only=True,
    loss_mask=loss_mask,
    padding_token_id=padding_token_id,
    extra_seq_keys=extra_seq_keys,
    extra_pad_values=extra_pad_values,
    pad_multiple=pad_multiple,
    batch_axis=batch_axis,
    implementation=implementation,
    min_stripe_len=min_stripe_len,
    layer_windows=layer_windows,
  )
  if image_token_id is not None and "input_ids" in batch:
    is_image = jnp.asarray(batch["input_ids"]) == image_token_id
  elif "mm_token_type_ids" in batch:
    is_image = jnp.asarray(batch["mm_token_type_ids"]) == 1
  else:
    is_image = None
  if is_image is not None:
    # A data-parallel shard sees only its rows but must know which images are
    # theirs: record each row's first image-token slot over the global batch.
    offsets = image_token_offsets(is_image)
    out[IMAGE_OFFSET_KEY] = jax.device_put(offsets, NamedSharding(mesh, P(batch_axis)))
  if audio_token_id is not None and batch.get("input_features") is not None:
    offsets = image_token_offsets(jnp.asarray(batch["input_ids"]) == audio_token_id)
    out[AUDIO_OFFSET_KEY] = jax.device_put(offsets, NamedSharding(mesh, P(batch_axis)))
  if video_token_id is not None and batch.get("pixel_values_videos") is not None:
    offsets = image_token_offsets(jnp.asarray(batch["input_ids"]) == video_token_id)
    out[VIDEO_OFFSET_KEY] = jax.device_put(offsets, NamedSharding(mesh, P(batch_axis)))
  return out, shard_layout


def make_contiguous_aux_only_shard_cp_batch(
  mesh: Mesh,
  batch: Mapping[str, Any],
  *,
  axis_name: str = "cp",
  loss_mask: ArrayLike | None = None,
  padding_token_id: int = 0,
  extra_seq_keys: Mapping[str, int] | None = None,
  extra_pad_values: Mapping[str, Any] | None = None,
) -> tuple[dict, ShardLayout]:
  """Shard a batch aux-only and contiguously for Gemma4's in-forward ("sunk") pre-embed.

  The seed's function under its familiar name:
  :func:`shard_aux_only_cp_batch` with ``layout="contiguous"`` (the document
  ids, synthesized where absent, under NeMo's name ``_packed_seq_ids``).

  Args:
    mesh, batch, axis_name, loss_mask, padding_token_id, extra_seq_keys,
      extra_pad_values: as :func:`shard_aux_only_cp_batch`.

  Returns:
    ``(sharded_batch, layout)`` as :func:`cpjax.shard_batch`.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    >>> batch = {"input_ids": np.arange(6)[None], "labels": np.arange(6)[None],
    ...          "attention_mask": np.array([[1, 1, 1, 1, 0, 0]])}
    >>> out, lay = make_contiguous_aux_only_shard_cp_batch(mesh, batch)
    >>> np.asarray(out["_packed_seq_ids"]).tolist(), out["input_ids"].shape
    ([[1, 1, 1, 1, 0, 0, 0, 0]], (1, 6))
  """
  return shard_aux_only_cp_batch(
    mesh,
    batch,
    layout="contiguous",
    axis_name=axis_name,
    loss_mask=loss_mask,
    padding_token_id=padding_token_id,
    extra_seq_keys=extra_seq_keys,
    extra_pad_values=extra_pad_values,
  )


def prepare_batch(
  batch: Mapping[str, Any],
  config: Gemma4Config | None = None,
  *,
  loss_mask: ArrayLike | None = None,
) -> dict:
  """Turn a batch as users have it into the model's single-device input.

  Accepts the Gemma 4 processor's keys (``input_ids``, ``attention_mask``,
  ``position_ids``, ``mm_token_type_ids``, ``pixel_values`` [N, P, 3 p^2],
  ``image_position_ids`` int[N, P, 2]; a video's frames as
  ``pixel_values_videos`` [N, P, 3 p^2] and ``video_position_ids``, with
  ``num_frames_per_video`` [V]; audio as ``input_features`` [A, T, W] and
  ``input_features_mask`` [A, T]) and NeMo's (``_packed_seq_ids``, its
  name for the document ids,
  ``padding_mask``, ``labels``, ``loss_mask``). ``attention_mask`` becomes
  ``padding_mask``. ``_packed_seq_ids`` gives the document boundaries and
  ``position_ids`` the positions (default ``arange(S)``, also under left
  padding, as transformers). Without ``_packed_seq_ids``: a batch with
  ``position_ids`` and no ``attention_mask`` / ``padding_mask`` is packed
  the way transformers reads it (a document starts wherever the position
  does not follow the previous one: :func:`documents_from_positions`);
  otherwise every row is one document (0 on padding). Labels are optional here (an evaluation batch
  has none). Vision groups come only from ``mm_token_type_ids``, as in
  transformers.

  With ``config`` (a :class:`Gemma4Config`) the images, video frames and
  audio clips are checked before any compute: ``image_position_ids``
  present and shaped like ``pixel_values``, the patch width, and the number
  of image placeholders (``input_ids == image_token_id``) equal to the soft
  tokens the images yield, and the same for video frames and audio clips; a
  mismatch is a ``ValueError`` giving both counts. So are token ids outside
  the vocabulary (when ``input_ids`` is concrete).

  Args:
    batch: the batch, with the keys above.
    config: a :class:`Gemma4Config` to check the images and ids against, or
      None.
    loss_mask: as :func:`cpjax.normalize_batch`.

  Returns:
    The model's single-device input, a new dict.

  Example:
    >>> import numpy as np
    >>> ones = np.ones((1, 3), np.int32)
    >>> out = prepare_batch({"input_ids": ones, "labels": ones})
    >>> sorted(out)
    ['_packed_seq_ids', 'input_ids', 'labels', 'padding_mask', 'position_ids']
  """
  batch = checks.mapping("batch", batch)
  if config is not None and not isinstance(config, Gemma4Config):
    raise TypeError(f"config must be a Gemma4Config or None, got {type(config).__name__}")
  audio = config is not None and config.audio is not None
  for key in ("input_features", "input_features_mask"):
    if batch.get(key) is not None and not audio:
      raise ValueError(
        f"batch key {key!r} is not supported here: audio needs the config of a model "
        f"with an audio tower (E2B, E4B) or the 12B unified model's audio embedder "
        f"(pass it to prepare_batch)"
      )
  if config is not None:
    for kind in VISION_INPUTS:
      _check_vision(batch, config, kind)
    _check_audio(batch, config)
    _check_vocabulary(batch, config)
  out = batch_lib.attention_mask_to_padding_mask(batch)
  if (
    batch_lib.DOCUMENT_IDS_KEY not in out
    and "padding_mask" not in out
    and out.get("position_ids") is not None
  ):
    out[batch_lib.DOCUMENT_IDS_KEY] = documents_from_positions(out["position_ids"])
  out = synthesize_single_document_seq_ids(out, batch_lib.primary_length(out))
  out = batch_lib.normalize_batch(out, loss_mask=loss_mask, require_labels=False)
  for pixels, positions, _ in VISION_INPUTS.values():
    if out.get(pixels) is not None:
      out[pixels] = jnp.asarray(out[pixels], jnp.float32)
      out[positions] = jnp.asarray(out[positions], jnp.int32)
  if out.get("input_features") is not None:
    out["input_features"] = jnp.asarray(out["input_features"], jnp.float32)
    if out.get("input_features_mask") is not None:
      out["input_features_mask"] = jnp.asarray(out["input_features_mask"], bool)
  return out


def documents_from_positions(position_ids: ArrayLike) -> jax.Array:
  """Return the document ids (from 1) of a packed row, read off its positions.

  A document starts wherever a position is not the previous one plus 1
  (transformers' rule for packed sequences without an attention mask).

  Args:
    position_ids: int[B, S] positions.

  Returns:
    int32[B, S] document ids (from 1).

  >>> import numpy as np
  >>> documents_from_positions(np.array([[0, 1, 2, 0, 1, 0]])).tolist()
  [[1, 1, 1, 2, 2, 3]]
  """
  pos = jnp.asarray(position_ids)
  if pos.ndim != 2:
    raise ValueError(
      f"position_ids must be [B, S] to find packed documents, got shape {tuple(pos.shape)}"
    )
  starts = jnp.diff(pos, axis=1, prepend=pos[:, :1] - 1) != 1
  return 1 + jnp.cumsum(starts, axis=1, dtype=jnp.int32)  # 0 would mean padding


# Images and video frames: both are patches for the vision tower (or the
# unified model's embedder), in order, into their placeholders (transformers'
# get_video_features); only their keys and placeholder differ:
# kind -> (pixels key, patch positions key, the placeholder's config field).
VISION_INPUTS = {
  "image": ("pixel_values", "image_position_ids", "image_token_id"),
  "video": ("pixel_values_videos", "video_position_ids", "video_token_id"),
}


def _check_vision(batch: Mapping[str, Any], config, kind: str) -> None:
  """Shapes of the image (``kind="image"``) or video frame inputs and
  placeholder/soft-token agreement (host side)."""
  import numpy as np

  from cpjax.models.gemma4.vision import soft_token_counts

  pixels_key, positions_key, token = VISION_INPUTS[kind]
  what = "images" if kind == "image" else "video frames"
  token_id = getattr(config, token)
  ids = np.asarray(batch["input_ids"])
  placeholders = int(np.sum(ids == token_id))
  pixels = batch.get(pixels_key)
  if pixels is None:
    if placeholders:
      raise ValueError(
        f"input_ids hold {placeholders} {kind} placeholder tokens "
        f"(id {token_id}) but the batch has no {pixels_key}"
      )
    return
  if config.vision is None:
    raise ValueError(f"the batch has {pixels_key} but this Gemma 4 has no vision tower")
  if batch.get(positions_key) is None:
    raise KeyError(
      f"the batch has {pixels_key} but no '{positions_key}' (int[N, P, 2], "
      "the processor's patch (x, y) positions)"
    )
  v = config.vision
  pix_shape = tuple(np.shape(pixels))
  pos = np.asarray(batch[positions_key])
  if len(pix_shape) != 3 or pix_shape[2] != v.patch_features:
    raise ValueError(
      f"{pixels_key} must be [N, P, 3 * patch_size**2 = {v.patch_features}] "
      f"patches, got shape {pix_shape}"
    )
  if pos.shape != pix_shape[:2] + (2,):
    raise ValueError(
      f"{positions_key} must have shape {pix_shape[:2] + (2,)} (that of "
      f"{pixels_key} [N, P] plus 2), got {pos.shape}"
    )
  if kind == "video" and batch.get("num_frames_per_video") is not None:
    frames = np.asarray(batch["num_frames_per_video"])
    if frames.ndim != 1 or (frames < 0).any() or int(frames.sum()) != pix_shape[0]:
      raise ValueError(
        f"num_frames_per_video must be [V] frame counts summing to the "
        f"{pix_shape[0]} frames of pixel_values_videos, got {frames.tolist()}"
      )
  if config.unified:  # every real patch is a soft token
    soft = int(np.sum(~np.all(pos == -1, axis=-1)))
  else:
    k2 = v.pooling_kernel_size**2
    if pix_shape[1] % k2:
      raise ValueError(
        f"patches per {kind} ({pix_shape[1]}) must be a multiple of pooling_kernel_size**2 = {k2}"
      )
    soft = int(np.sum(soft_token_counts(pos, v.pooling_kernel_size)))
  if soft != placeholders:
    raise ValueError(
      f"{kind} placeholders and soft tokens disagree: input_ids hold "
      f"{placeholders} {kind} tokens (id {token_id}) but the "
      f"{pix_shape[0]} {what} in {pixels_key} yield {soft} soft tokens"
    )


def _check_audio(batch: Mapping[str, Any], config) -> None:
  """Audio clips: their shape, and as many placeholders as soft tokens of real
  frames (the audio tower's: one per four feature frames; the unified
  model's: one per frame)."""
  ids = np.asarray(batch["input_ids"])
  placeholders = int(np.sum(ids == config.audio_token_id))
  frames = batch.get("input_features")
  if frames is None:
    if placeholders:
      raise ValueError(
        f"input_ids hold {placeholders} audio placeholder tokens (id "
        f"{config.audio_token_id}) but the batch has no input_features"
      )
    return
  tower = isinstance(config.audio, Gemma4AudioConfig)
  width = config.audio.mel_bins if tower else config.audio.audio_embed_dim
  what = "log-mel bins" if tower else "waveform samples"
  shape = tuple(np.shape(frames))
  if len(shape) != 3 or shape[2] != width:
    raise ValueError(
      f"input_features must be [A, T, {width}] frames of {width} {what}, got shape {shape}"
    )
  mask = batch.get("input_features_mask")
  if mask is None and tower:
    # transformers' audio tower needs it too (without it, transformers skips the audio).
    raise ValueError(
      "input_features_mask is required with input_features for the audio tower "
      "(bool [A, T], False on padding frames, as the feature extractor returns it)"
    )
  real = np.ones(shape[:2], bool) if mask is None else np.asarray(mask)
  if real.shape != shape[:2]:
    raise ValueError(
      f"input_features_mask must have shape {shape[:2]} (that of input_features [A, T]), "
      f"got {real.shape}"
    )
  # The tower's soft tokens: the real frames that survive two stride-2 steps.
  soft = real[:, ::2][:, ::2] if tower else real
  if int(soft.sum()) != placeholders:
    frames_said = (
      f"{int(real.sum())} real frames, {int(soft.sum())} soft tokens after the "
      f"audio tower's 4x subsampling"
      if tower
      else f"{int(real.sum())} real frames"
    )
    raise ValueError(
      f"audio placeholders and frames disagree: input_ids hold {placeholders} audio "
      f"tokens (id {config.audio_token_id}) but input_features_mask marks {frames_said}"
    )


def _check_vocabulary(batch: Mapping[str, Any], config) -> None:
  """Concrete ``input_ids`` must be ids of the model's vocabulary (or its placeholders)."""
  ids = batch.get("input_ids")
  if ids is None or isinstance(ids, jax.core.Tracer) or not hasattr(ids, "shape"):
    return
  ids = np.asarray(ids)
  if not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
    return
  known = np.isin(ids, np.asarray(config.placeholder_token_ids))
  bad = ids[~known & ((ids < 0) | (ids >= config.text.vocab_size))]
  if bad.size:
    raise ValueError(
      f"input_ids holds token ids outside the vocabulary [0, "
      f"{config.text.vocab_size}): {np.unique(bad)[:8].tolist()}"
    )


def synthetic_batch(
  rng: np.random.Generator,
  config: Gemma4Config,
  *,
  batch_size: int,
  seq_len: int,
  images_per_row: int = 1,
  max_docs: int = 4,
  image_grid: tuple[int, int] | None = None,
) -> dict:
  """Make a :func:`cpjax.data.synthetic_batch` for a :class:`Gemma4Config`.

  It uses the config's vocabulary, image token and patch size (a text-only
  model gets no images). Text ids avoid every special id of the config
  (:attr:`Gemma4Config.special_token_ids`): image tokens appear only in
  image spans.

  Args:
    rng: the numpy random generator.
    config: the :class:`Gemma4Config`.
    batch_size, seq_len, images_per_row, max_docs: as
      :func:`cpjax.data.synthetic_batch`.
    image_grid: ``(columns, rows)`` patches per image (default: twice the
      pooling kernel each way).

  Returns:
    The dict of numpy arrays.

  >>> import numpy as np
  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> b = synthetic_batch(np.random.default_rng(0), Gemma4Config.preset("tiny"), batch_size=1,
  ...                     seq_len=16)
  >>> b["pixel_values"].shape, int((b["input_ids"] == 258880).sum())
  ((1, 36, 48), 4)
  """
  from cpjax.data.synthetic import synthetic_batch as generic

  if not isinstance(rng, np.random.Generator):
    raise TypeError(
      f"rng must be a numpy Generator (np.random.default_rng(seed)), got {type(rng).__name__}"
    )
  if not isinstance(config, Gemma4Config):
    raise TypeError(f"config must be a Gemma4Config, got {type(config).__name__}")
  checks.integer("batch_size", batch_size, minimum=1)
  checks.integer("seq_len", seq_len, minimum=1)
  checks.integer("images_per_row", images_per_row, minimum=0)
  checks.integer("max_docs", max_docs, minimum=1)
  v = config.vision
  if v is None:
    images_per_row = 0
  k = v.pooling_kernel_size if v else 3
  patch = v.patch_size if v else 1
  if isinstance(v, Gemma4UnifiedVisionConfig):
    # One soft token a patch of model_patch_size pixels, as its processor cuts them.
    k, patch = 1, v.model_patch_size
  out = generic(
    rng,
    batch_size=batch_size,
    seq_len=seq_len,
    vocab_size=config.text.vocab_size,
    image_token_id=config.image_token_id,
    patch_size=patch,
    pooling_kernel_size=k,
    image_grid=image_grid or (2 * k, 2 * k),
    images_per_row=images_per_row,
    max_docs=max_docs,
    reserved_ids=config.special_token_ids,
  )
  if images_per_row == 0:
    for key in ("pixel_values", "image_position_ids", "mm_token_type_ids"):
      out.pop(key)
  return out
