"""Packed training rows from pre-tokenized documents, with grain.

On disk: ArrayRecord files (grain's native random-access format), one record
per document. Random access is what a seeded global shuffle and a
per-process shard need without reading the corpus into memory;
:func:`write_documents` writes the format. A record is either the token ids
as little-endian int32 bytes (a document that counts whole in the loss), or
an ``.npz`` archive of named arrays: ``input_ids`` int32[T] and
``loss_mask`` uint8[T] (1 where the token is a target of the loss: the
answers of a conversation, see :mod:`cpjax.data.tokenizer`), and for a document
with images ``image_patches`` uint8[n, F] (the resized images' patches,
:mod:`cpjax.data.images`), ``image_positions`` int32[n, 2] and ``image_sizes``
int32[k] (patches per image); for a document with audio ``audio_features``
float32[t, W] (every clip's feature frames, :mod:`cpjax.data.audio`),
``audio_mask`` uint8[t] (real frames) and ``audio_sizes`` int32[a] (frames
per clip); for a document with videos ``video_patches`` uint8[m, F] (every
sampled frame's patches, :mod:`cpjax.data.video`), ``video_positions``
int32[m, 2] and ``video_sizes`` int32[f] (patches per frame). A corpus with
images, audio or video is a directory whose ``summary.json`` (written by
:func:`prepare_data`) gives the image processor, the audio feature
extractor and the video processor.

The pipeline (:func:`packed_rows`):

1. shuffle all documents with ``seed`` (the same permutation on every
   process), then keep every ``process_count``-th one from ``process_index``;
2. cut documents longer than ``seq_len`` into ``seq_len``-token pieces, each
   its own document;
3. pack pieces into rows of ``seq_len`` tokens (grain's first-fit packing);
4. emit the cpjax batch keys: ``input_ids``, ``_packed_seq_ids`` (the
   document ids under NeMo's name: 1, 2, ... per document, 0 on padding),
   ``position_ids`` (restarting in every document), ``labels`` (the next
   token of the same document where the loss mask holds it, else -100) and
   ``attention_mask``; with images, each
   row has ``images_per_row`` image slots (``pixel_values`` float32[I, P,
   F], ``image_position_ids`` int32[I, P, 2], the unused ones all padding)
   and ``mm_token_type_ids`` (1 image, 3 audio, as Gemma 4's processors);
   with audio, ``audio_clips_per_row`` clip slots (``input_features``
   float32[C, L, W] and ``input_features_mask`` bool[C, L], L the corpus's
   longest clip); with video, ``videos_per_row`` video slots of the video
   processor's ``num_frames`` frames each (``pixel_values_videos``
   float32[V * N, P', F], ``video_position_ids``, ``num_frames_per_video``
   int32[V]; ``mm_token_type_ids`` 2). Packing keeps every document's images,
   clips and videos with it and never puts more of them in a row than it has
   slots.

It is deterministic, and resumable: the iterator's ``get_state()`` /
``set_state()`` continue exactly where a run stopped.

Texts and conversations in JSONL become such a corpus with
:func:`cpjax.data.records.prepare_data` (``cpjax prepare-data``), tokenized with
the checkpoint's own tokenizer and chat template.

Shape letters: ``B`` rows per batch, ``S`` tokens per row, ``I`` image
slots, ``C`` audio clip slots and ``V`` video slots per row, ``N`` frames a
video.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cpjax.batch import IGNORE_INDEX

if TYPE_CHECKING:
  import grain

__all__ = [
  "corpus_audio",
  "corpus_video",
  "corpus_images",
  "flatten_image_slots",
  "packed_batches",
  "packed_rows",
  "write_documents",
]


# A corpus: an ArrayRecord file, a directory of them, or a list of files.
_Corpus = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
_TOKEN = np.dtype("<i4")
_NPZ_MAGIC = b"PK\x03\x04"  # never the first id of a raw record: 67324752 > any vocabulary
# np.load parses each array's header with ast.literal_eval, whose AST
# construction is not thread-safe on CPython 3.11 (now and then a spurious
# "SystemError: AST constructor recursion depth mismatch", python/cpython
# gh-106905, seen in a 2-worker CI run): grain decodes records on several
# threads, so they read their arrays in turn.
_NPZ_LOCK = threading.Lock()


_IMAGE_KEYS = ("image_patches", "image_positions", "image_sizes")
_AUDIO_KEYS = ("audio_features", "audio_mask", "audio_sizes")
_VIDEO_KEYS = ("video_patches", "video_positions", "video_sizes")
_MEDIA_KEYS = (*_IMAGE_KEYS, *_AUDIO_KEYS, *_VIDEO_KEYS)


def _record(doc, number: int) -> bytes:
  """One document's record: raw int32 tokens, or an .npz with its loss mask
  (and images, audio and video)."""
  if isinstance(doc, Mapping):
    unknown = set(doc) - {"input_ids", "loss_mask", *_MEDIA_KEYS}
    if unknown or "input_ids" not in doc:
      raise ValueError(
        f"document {number} must have 'input_ids' and optionally 'loss_mask', "
        f"{list(_IMAGE_KEYS)}, {list(_AUDIO_KEYS)} and {list(_VIDEO_KEYS)}, got keys "
        f"{sorted(doc)}"
      )
    tokens, mask = np.asarray(doc["input_ids"]), doc.get("loss_mask")
  else:
    tokens, mask, doc = np.asarray(doc), None, {}
  if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(
      f"document {number} must be a non-empty 1-D sequence of token ids, got "
      f"{tokens.dtype}{list(tokens.shape)}"
    )
  if mask is None and not any(k in doc for k in _MEDIA_KEYS):
    return tokens.astype(_TOKEN).tobytes()
  mask = np.ones(tokens.shape, np.uint8) if mask is None else np.asarray(mask)
  if mask.shape != tokens.shape or not (mask.dtype == bool or np.isin(mask, (0, 1)).all()):
    raise ValueError(
      f"document {number}: loss_mask must be 0/1 of the shape of input_ids "
      f"{tokens.shape}, got {mask.dtype}{list(mask.shape)}"
    )
  arrays = {"input_ids": tokens.astype(_TOKEN), "loss_mask": mask.astype(np.uint8)}
  for keys, what in ((_IMAGE_KEYS, "k"), (_VIDEO_KEYS, "f")):
    if any(k in doc for k in keys):
      arrays.update(_patches(doc, keys, what, number))
  if any(k in doc for k in _AUDIO_KEYS):
    features, real, sizes = (np.asarray(doc.get(k)) for k in _AUDIO_KEYS)
    if (
      features.dtype != np.float32
      or features.ndim != 2
      or real.shape != (len(features),)
      or not np.isin(real, (0, 1)).all()
      or sizes.ndim != 1
      or sizes.sum() != len(features)
    ):
      raise ValueError(
        f"document {number}: audio_features must be float32 [t, W], audio_mask "
        f"0/1 [t] and audio_sizes [a] summing to t, got {features.dtype}"
        f"{list(features.shape)}, {list(real.shape)}, {sizes.tolist()}"
      )
    arrays.update(
      audio_features=features, audio_mask=real.astype(np.uint8), audio_sizes=sizes.astype(np.int32)
    )
  out = io.BytesIO()
  np.savez(out, **arrays)
  return out.getvalue()


def _patches(doc: Mapping, keys: Sequence[str], what: str, number: int) -> dict:
  """A document's image (or video frame) arrays, checked: uint8 patches
  [n, F], their positions [n, 2] and the patch counts summing to n."""
  patches, positions, sizes = (np.asarray(doc.get(k)) for k in keys)
  if (
    patches.dtype != np.uint8
    or patches.ndim != 2
    or positions.shape != (len(patches), 2)
    or sizes.ndim != 1
    or sizes.sum() != len(patches)
  ):
    raise ValueError(
      f"document {number}: {keys[0]} must be uint8 [n, F], {keys[1]} [n, 2] and "
      f"{keys[2]} [{what}] summing to n, got {patches.dtype}{list(patches.shape)}, "
      f"{list(positions.shape)}, {sizes.tolist()}"
    )
  return {
    keys[0]: patches,
    keys[1]: positions.astype(np.int32),
    keys[2]: sizes.astype(np.int32),
  }


def _summary(path: _Corpus) -> dict:
  """A corpus directory's ``summary.json`` (empty without one)."""
  if not isinstance(path, (str, os.PathLike)):
    return {}
  path = os.fspath(path)
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  file = os.path.join(directory, "summary.json")
  if not os.path.isfile(file):
    return {}
  import json

  with open(file, encoding="utf-8") as f:
    return json.load(f)


def corpus_images(path: _Corpus) -> dict | None:
  """Return the image processor of a corpus directory with images, or None.

  Args:
    path: the corpus directory.

  Returns:
    Its ``summary.json``'s ``image_processor`` (patch_size, max_soft_tokens,
    pooling_kernel_size, image_token_id, and max_images_per_document), or None.
  """
  info = _summary(path)
  if "image_processor" not in info:
    return None
  return {**info["image_processor"], "max_images_per_document": info["max_images_per_document"]}


def corpus_audio(path: _Corpus) -> dict | None:
  """Return the audio feature extractor of a corpus directory with audio, or None.

  Args:
    path: the corpus directory.

  Returns:
    Its ``summary.json``'s ``audio_processor`` (kind, samples_per_token,
    width, audio_token_id), max_audio_clips_per_document and
    max_audio_frames (the longest clip's), or None.
  """
  info = _summary(path)
  if "audio_processor" not in info:
    return None
  return {
    **info["audio_processor"],
    "max_audio_clips_per_document": info["max_audio_clips_per_document"],
    "max_audio_frames": info["max_audio_frames"],
  }


def corpus_video(path: _Corpus) -> dict | None:
  """Return the video processor of a corpus directory with videos, or None.

  Args:
    path: the corpus directory.

  Returns:
    Its ``summary.json``'s ``video_processor`` (patch_size, max_soft_tokens,
    pooling_kernel_size, num_frames, video_token_id) and
    max_videos_per_document, or None.
  """
  info = _summary(path)
  if "video_processor" not in info:
    return None
  return {**info["video_processor"], "max_videos_per_document": info["max_videos_per_document"]}


def write_documents(path: str | os.PathLike, documents: Iterable) -> int:
  """Write documents to an ArrayRecord file; returns how many.

  A document is a sequence of token ids (every token a target), or a dict
  with ``input_ids`` and ``loss_mask`` (0/1 per token: which tokens are
  targets of the loss).

  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "docs.array_record")
  >>> write_documents(path, [[5, 6, 7], {"input_ids": [8, 9], "loss_mask": [0, 1]}])
  2
  """
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(os.fspath(path), "group_size:1")
  count = 0
  try:
    for doc in documents:
      writer.write(_record(doc, count))
      count += 1
  finally:
    writer.close()
  return count


def _files(path: _Corpus) -> list[str]:
  """The ArrayRecord files of a file, a directory, or a list of files."""
  if isinstance(path, (str, os.PathLike)):
    path = os.fspath(path)
    if os.path.isdir(path):
      files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".array_record"))
      if not files:
        raise FileNotFoundError(f"data directory {path} holds no .array_record files")
      return files
    paths = [path]
  else:
    paths = [os.fspath(p) for p in path]
  for p in paths:
    if not os.path.isfile(p):
      raise FileNotFoundError(f"data file {p} does not exist")
  return paths


class _Decode:
  """Record bytes -> ``{"input_ids", "loss_mask"}`` int32[T] (and the image
  arrays, empty for a document without images, when ``features`` is the
  corpus's patch width; the audio arrays likewise with ``audio_width``, the
  video arrays with ``video_features``), naming the file set on a bad record."""

  def __init__(
    self,
    where: str,
    features: int | None,
    audio_width: int | None = None,
    video_features: int | None = None,
  ):
    self.where = where
    self.features = features
    self.audio_width = audio_width
    self.video_features = video_features

  def __call__(self, record: bytes) -> dict:
    doc: dict[str, np.ndarray]
    if record[:4] == _NPZ_MAGIC:
      with _NPZ_LOCK, np.load(io.BytesIO(record)) as arrays:
        doc = {
          "input_ids": arrays["input_ids"].astype(np.int32),
          "loss_mask": arrays["loss_mask"].astype(np.int32),
        }
        if "image_sizes" in arrays and self.features is None:
          raise ValueError(
            f"a record in {self.where} holds images, but no summary.json "
            f"describes them: read the directory prepare_data wrote"
          )
        if self.features is not None and "image_sizes" in arrays:
          doc.update({k: arrays[k] for k in _IMAGE_KEYS})
        if "audio_sizes" in arrays and self.audio_width is None:
          raise ValueError(
            f"a record in {self.where} holds audio, but no summary.json "
            f"describes it: read the directory prepare_data wrote"
          )
        if self.audio_width is not None and "audio_sizes" in arrays:
          doc.update({k: arrays[k] for k in _AUDIO_KEYS})
        if "video_sizes" in arrays and self.video_features is None:
          raise ValueError(
            f"a record in {self.where} holds videos, but no summary.json "
            f"describes them: read the directory prepare_data wrote"
          )
        if self.video_features is not None and "video_sizes" in arrays:
          doc.update({k: arrays[k] for k in _VIDEO_KEYS})
    else:
      if len(record) == 0 or len(record) % _TOKEN.itemsize:
        raise ValueError(
          f"a record in {self.where} is {len(record)} bytes: not a document of "
          f"int32 token ids (written by cpjax.data.corpus.write_documents)"
        )
      tokens = np.frombuffer(record, _TOKEN).astype(np.int32)
      doc = {"input_ids": tokens, "loss_mask": np.ones_like(tokens)}
    if self.features is not None and "image_sizes" not in doc:
      doc.update(
        image_patches=np.zeros((0, self.features), np.uint8),
        image_positions=np.zeros((0, 2), np.int32),
        image_sizes=np.zeros((0,), np.int32),
      )
    if self.audio_width is not None and "audio_sizes" not in doc:
      doc.update(
        audio_features=np.zeros((0, self.audio_width), np.float32),
        audio_mask=np.zeros((0,), np.uint8),
        audio_sizes=np.zeros((0,), np.int32),
      )
    if self.video_features is not None and "video_sizes" not in doc:
      doc.update(
        video_patches=np.zeros((0, self.video_features), np.uint8),
        video_positions=np.zeros((0, 2), np.int32),
        video_sizes=np.zeros((0,), np.int32),
      )
    return doc


def _pieces(seq_len: int, max_pieces: int):
  import grain

  class Pieces(grain.experimental.FlatMapTransform):
    """A document cut into seq_len-token pieces (each its own document)."""

    max_fan_out = max_pieces

    def flat_map(self, element):  # a document (grain's parameter name)
      n = len(element["input_ids"])
      if n <= seq_len:
        return [element]
      for key, what in (
        ("image_sizes", "images"),
        ("audio_sizes", "audio"),
        ("video_sizes", "videos"),
      ):
        if len(element.get(key, ())):
          raise ValueError(
            f"a document with {what} has {n} tokens, more than a row's "
            f"{seq_len}: it cannot be cut (prepare_data with seq_len drops it)"
          )
      return [
        {key: value[i : i + seq_len] for key, value in element.items()}
        for i in range(0, n, seq_len)
      ]

  return Pieces()


class _ToBatchKeys:
  """grain's packed features -> cpjax's batch keys (one row); with images,
  audio and video, the row's image, clip and video slots laid out as Gemma
  4's processors give them."""

  def __init__(
    self,
    images: dict | None,
    images_per_row: int,
    audio: dict | None = None,
    audio_clips_per_row: int = 0,
    video: dict | None = None,
    videos_per_row: int = 0,
  ):
    self.images = images
    self.images_per_row = images_per_row
    self.audio = audio
    self.audio_clips_per_row = audio_clips_per_row
    self.video = video
    self.videos_per_row = videos_per_row

  def __call__(self, row: dict) -> dict:
    ids = row["input_ids"].astype(np.int32)
    # (grain names a packed feature's document ids "<feature>_segment_ids".)
    docs = row["input_ids_segment_ids"].astype(np.int32)
    nxt, nxt_doc = np.roll(ids, -1), np.roll(docs, -1)
    # The next token is a target when it is of the same document and its loss
    # mask holds it (the original's loss_mask, applied to the shifted labels).
    same = (docs > 0) & (nxt_doc == docs) & (np.roll(row["loss_mask"], -1) > 0)
    same[-1] = False
    out = {
      "input_ids": ids,
      "_packed_seq_ids": docs,
      "position_ids": row["input_ids_positions"].astype(np.int32),
      "labels": np.where(same, nxt, IGNORE_INDEX).astype(np.int32),
      "attention_mask": (docs > 0).astype(np.int32),
    }
    if self.images is not None:
      out.update(self._image_slots(row, ids))
    if self.audio is not None:
      out.update(self._audio_slots(row))
      # Gemma 4's processors mark audio tokens 3 (images 1, video 2).
      types = out.get("mm_token_type_ids", np.zeros_like(ids))
      out["mm_token_type_ids"] = np.where(ids == self.audio["audio_token_id"], 3, types)
    if self.video is not None:
      out.update(self._video_slots(row))
      types = out.get("mm_token_type_ids", np.zeros_like(ids))
      out["mm_token_type_ids"] = np.where(ids == self.video["video_token_id"], 2, types)
    return out

  def _video_slots(self, row: dict) -> dict:
    from cpjax.data.images import pixel_values
    from cpjax.data.video import VideoProcessor

    assert self.video is not None  # __call__ asks only for a corpus with video
    frames = self.video["num_frames"]
    slots, max_patches = (
      self.videos_per_row * frames,
      _processor(VideoProcessor, self.video).max_patches,
    )
    pixels = np.zeros((slots, max_patches, row["video_patches"].shape[-1]), np.float32)
    positions = np.full((slots, max_patches, 2), -1, np.int32)
    sizes = row["video_sizes"][row["video_sizes_segment_ids"] > 0]
    start = 0
    for i, n in enumerate(sizes):  # frames in document order, as their placeholders
      pixels[i, :n] = pixel_values(row["video_patches"][start : start + n])
      positions[i, :n] = row["video_positions"][start : start + n]
      start += n
    return {
      "pixel_values_videos": pixels,
      "video_position_ids": positions,
      # Unused slots are videos too, of frames without patches (no soft token).
      "num_frames_per_video": np.full((self.videos_per_row,), frames, np.int32),
    }

  def _audio_slots(self, row: dict) -> dict:
    assert self.audio is not None  # __call__ asks only for a corpus with audio
    slots, frames = self.audio_clips_per_row, self.audio["max_audio_frames"]
    features = np.zeros((slots, frames, self.audio["width"]), np.float32)
    real = np.zeros((slots, frames), bool)
    sizes = row["audio_sizes"][row["audio_sizes_segment_ids"] > 0]
    start = 0
    for i, n in enumerate(sizes):  # packed in document order, as their placeholders
      features[i, :n] = row["audio_features"][start : start + n]
      real[i, :n] = row["audio_mask"][start : start + n] > 0
      start += n
    return {"input_features": features, "input_features_mask": real}

  def _image_slots(self, row: dict, ids) -> dict:
    from cpjax.data.images import ImageProcessor

    assert self.images is not None  # __call__ asks only for a corpus with images
    processor = _processor(ImageProcessor, self.images)
    slots, max_patches = self.images_per_row, processor.max_patches
    features = row["image_patches"].shape[-1]
    pixels = np.zeros((slots, max_patches, features), np.float32)
    positions = np.full((slots, max_patches, 2), -1, np.int32)
    sizes = row["image_sizes"][row["image_sizes_segment_ids"] > 0]
    start = 0
    for i, n in enumerate(sizes):  # packed in document order, as their placeholders
      pixels[i, :n] = processor.pixels(row["image_patches"][start : start + n])
      positions[i, :n] = row["image_positions"][start : start + n]
      start += n
    image = ids == self.images["image_token_id"]
    return {
      "pixel_values": pixels,
      "image_position_ids": positions,
      "mm_token_type_ids": image.astype(np.int32),
    }


def packed_rows(
  path: _Corpus,
  *,
  seq_len: int,
  seed: int = 0,
  shuffle: bool = True,
  process_index: int | None = None,
  process_count: int | None = None,
  num_epochs: int | None = None,
  num_packing_bins: int = 16,
  max_document_pieces: int = 4096,
  images_per_row: int | None = None,
  audio_clips_per_row: int | None = None,
  videos_per_row: int | None = None,
) -> grain.IterDataset:
  """Build a grain ``IterDataset`` of packed rows (dicts of int32 [S] arrays).

  Args:
    path: an ArrayRecord file, a directory of them, or a list of files.
    seq_len: tokens per row (S).
    seed: the shuffle and packing seed; the same on every process.
    shuffle: shuffle the documents (each epoch anew).
    process_index, process_count: this process's share of the documents
      (default: ``jax.process_index()`` / ``jax.process_count()``).
    num_epochs: passes over the corpus; None repeats forever.
    num_packing_bins: rows packed at once (more: fuller rows, more latency).
    max_document_pieces: longest document allowed, in ``seq_len`` pieces.
    images_per_row: image slots per row, for a corpus with images (default:
      its largest document's image count).
    audio_clips_per_row: audio clip slots per row, for a corpus with audio
      (default: its largest document's clip count).
    videos_per_row: video slots per row, for a corpus with videos (default:
      its largest document's video count).

  Returns:
    The grain ``IterDataset`` of packed rows.

  Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "docs.array_record")
    >>> _ = write_documents(path, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    >>> row = next(iter(packed_rows(path, seq_len=8, shuffle=False, num_epochs=1,
    ...                             process_index=0, process_count=1)))
    >>> row["input_ids"].tolist(), row["_packed_seq_ids"].tolist()  # document ids, NeMo's key
    ([5, 6, 7, 8, 9, 0, 0, 0], [1, 1, 1, 2, 2, 0, 0, 0])
    >>> row["labels"].tolist(), row["position_ids"].tolist()
    ([6, 7, -100, 9, -100, -100, -100, -100], [0, 1, 2, 0, 1, 0, 0, 0])
  """
  import grain

  from cpjax.data.images import ImageProcessor
  from cpjax.data.video import VideoProcessor

  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
    raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
  if process_index is None or process_count is None:
    import jax

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
  files = _files(path)
  try:
    source = grain.sources.ArrayRecordDataSource(files)
    size = len(source)
  except Exception as e:  # array_record raises various errors on corrupt files
    raise ValueError(f"cannot read ArrayRecord data {files}: {e}") from e
  if size < process_count:
    raise ValueError(f"{files} hold {size} documents, fewer than the {process_count} processes")
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.seed(seed).shuffle()
  images = corpus_images(path)
  lengths = {"input_ids": seq_len, "loss_mask": seq_len}
  features = None
  if images is not None:
    most = images["max_images_per_document"]
    images_per_row = _slots("images_per_row", images_per_row, most, "images", path)
    processor = _processor(ImageProcessor, images)
    patches = images_per_row * processor.max_patches
    # Packing fills a row only while every feature fits: the images of its
    # documents then fit the row's slots (and their patches the slots' patches).
    lengths.update(image_patches=patches, image_positions=patches, image_sizes=images_per_row)
    features = processor.patch_features
  audio = corpus_audio(path)
  width = None
  if audio is not None:
    most = audio["max_audio_clips_per_document"]
    audio_clips_per_row = _slots(
      "audio_clips_per_row", audio_clips_per_row, most, "audio clips", path
    )
    frames = audio_clips_per_row * audio["max_audio_frames"]
    # As images: a row's clips then fit its slots, each at most the longest clip.
    lengths.update(audio_features=frames, audio_mask=frames, audio_sizes=audio_clips_per_row)
    width = audio["width"]
  video = corpus_video(path)
  video_features = None
  if video is not None:
    videos_per_row = _slots(
      "videos_per_row", videos_per_row, video["max_videos_per_document"], "videos", path
    )
    frame = _processor(VideoProcessor, video)
    frames = videos_per_row * video["num_frames"]
    patches = frames * frame.max_patches
    lengths.update(video_patches=patches, video_positions=patches, video_sizes=frames)
    video_features = frame.patch_features
  ds = ds[process_index::process_count].map(
    _Decode(", ".join(files), features, width, video_features)
  )
  ds = ds.repeat(num_epochs).to_iter_dataset()
  ds = grain.experimental.FlatMapIterDataset(ds, _pieces(seq_len, max_document_pieces))
  ds = grain.experimental.FirstFitPackIterDataset(
    ds, length_struct=lengths, num_packing_bins=num_packing_bins, seed=seed, shuffle_bins=shuffle
  )
  return ds.map(
    _ToBatchKeys(
      images, images_per_row or 0, audio, audio_clips_per_row or 0, video, videos_per_row or 0
    )
  )


def _processor(cls, info: Mapping):
  """The image or video processor a corpus's ``summary.json`` describes."""
  import dataclasses

  return cls(**{f.name: info[f.name] for f in dataclasses.fields(cls) if f.name in info})


def _slots(name: str, value: int | None, most: int, what: str, path) -> int:
  """A row's slot count for one kind of media: ``value``, at least ``most``
  (the most ``what`` of a document), or ``most`` when None."""
  value = most if value is None else value
  if isinstance(value, bool) or not isinstance(value, int) or value < most:
    raise ValueError(
      f"{name} must be an int >= {most} (the most {what} of a document of {path}), got {value!r}"
    )
  return value


def packed_batches(
  path: _Corpus, *, batch_size: int, seq_len: int, **kwargs: Any
) -> grain.IterDataset:
  """Stack :func:`packed_rows` into batches.

  Args:
    path: as :func:`packed_rows`.
    batch_size: rows per batch (B).
    seq_len: tokens per row (S).
    **kwargs: the other keywords of :func:`packed_rows`.

  Returns:
    A dataset of dicts of int32 [B, S] arrays (the keys of :func:`packed_rows`:
    the document ids are ``_packed_seq_ids``, NeMo's name; and, with images,
    ``pixel_values`` [B * I, P, F] and ``image_position_ids`` [B * I, P, 2]:
    the rows' image slots in row order, as the model numbers soft tokens;
    with audio, ``input_features`` [B * C, L, W] and ``input_features_mask``
    [B * C, L] likewise; with video, ``pixel_values_videos`` [B * V * N, P', F],
    ``video_position_ids`` and ``num_frames_per_video`` [B * V]).

  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "docs.array_record")
  >>> _ = write_documents(path, [[5, 6, 7]] * 10)
  >>> batch = next(iter(packed_batches(path, batch_size=2, seq_len=6, process_index=0,
  ...                                  process_count=1)))
  >>> sorted(batch), batch["input_ids"].shape
  (['_packed_seq_ids', 'attention_mask', 'input_ids', 'labels', 'position_ids'], (2, 6))
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  batches = packed_rows(path, seq_len=seq_len, **kwargs).batch(batch_size, drop_remainder=True)
  return batches.map(flatten_image_slots)


def flatten_image_slots(batch: dict) -> dict:
  """Flatten stacked rows' image, audio and video slots [B, I, ...] into the
  model's images, clips and frames [B * I, ...].

  Args:
    batch: a batch of stacked rows.

  Returns:
    ``batch``, its ``pixel_values``, ``image_position_ids``,
    ``input_features``, ``input_features_mask``, ``pixel_values_videos``,
    ``video_position_ids`` and ``num_frames_per_video`` flattened.
  """
  for key in (
    "pixel_values",
    "image_position_ids",
    "input_features",
    "input_features_mask",
    "pixel_values_videos",
    "video_position_ids",
    "num_frames_per_video",
  ):
    if key in batch:
      batch[key] = batch[key].reshape(-1, *batch[key].shape[2:])
  return batch
