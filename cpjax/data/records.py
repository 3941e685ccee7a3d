"""JSONL records -> token documents, with the checkpoint's tokenizer.

A record is one JSON object per line, either a text document or a
conversation::

    {"text": "Any plain text ..."}
    {"messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}]}

``content`` is a string or a list of parts: ``{"type": "text", "text":
...}``, ``{"type": "image", "image": "photo.jpg"}`` (a file, relative to
the JSONL file; ``path`` or ``url`` name it too), preprocessed with the
checkpoint's image processor (:mod:`cpjax.data.images`), and ``{"type":
"audio", "audio": "clip.flac"}`` (a 16 kHz file, WAV, FLAC or OGG), made into
the features of the checkpoint's feature extractor (:mod:`cpjax.data.audio`:
log-mel frames for E2B and E4B, waveform frames for 12B), and ``{"type":
"video", "video": "clip.mp4"}`` (a file FFmpeg decodes), its frames sampled
and cut as the checkpoint's video processor does (:mod:`cpjax.data.video`;
E2B, E4B, 26B-A4B and 31B). ``id`` and ``metadata``
keys are allowed and ignored; any other key is a bad record (nothing a user
wrote is silently dropped). A text document
is tokenized as ``tokenizer(text)`` and counts whole in the loss; a
conversation is rendered with the checkpoint's chat template and only its
assistant turns count (:meth:`cpjax.data.tokenizer.CheckpointTokenizer.encode_chat`).

A document longer than ``seq_len`` tokens is a bad record unless
``truncate`` (then its first ``seq_len`` tokens are kept and counted as
truncated; never a document with images, audio or video). Bad records are reported with
their line number and the reason;
:class:`Summary` counts everything.

Shape letters: ``T`` tokens of one document, ``n`` image patches of one
document, ``k`` its images, ``F`` = ``3 * patch_size**2``, ``t`` audio
frames of one document, ``a`` its clips, ``W`` features a frame, ``m``
video patches of one document, ``f`` its video frames.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator

import numpy as np

from cpjax.data.audio import AudioProcessor
from cpjax.data.images import ImageProcessor
from cpjax.data.tokenizer import ANSWER_ROLE, CheckpointTokenizer, check_messages
from cpjax.data.video import VideoProcessor

__all__ = ["BadRecord", "Summary", "encode_record", "prepare_data", "read_jsonl"]

_IGNORED_KEYS = ("id", "metadata")


class BadRecord(ValueError):
  """A record that cannot become a training document (the reason is the message)."""


@dataclasses.dataclass
class Summary:
  """What a pass over a JSONL file gave: documents and tokens written, the
  target (loss) tokens among them, images, audio clips and videos (their
  soft tokens, the most in a document, the longest clip's feature frames), documents
  truncated, and each dropped record as ``(line, reason)``."""

  source: str
  documents: int = 0
  tokens: int = 0
  target_tokens: int = 0
  images: int = 0
  max_images_per_document: int = 0
  audio_clips: int = 0
  audio_tokens: int = 0
  max_audio_clips_per_document: int = 0
  max_audio_frames: int = 0
  videos: int = 0
  video_tokens: int = 0
  max_videos_per_document: int = 0
  truncated: int = 0
  dropped: list[tuple[int, str]] = dataclasses.field(default_factory=list)

  def as_dict(self) -> dict:
    """Return the summary as a JSON-ready dict, each dropped record as ``{"line", "reason"}``.

    Returns:
      The fields as a dict.
    """
    out = dataclasses.asdict(self)
    out["dropped"] = [{"line": line, "reason": reason} for line, reason in self.dropped]
    return out

  def lines(self, *, show: int = 10) -> list[str]:
    """Return the summary as printed lines (the first ``show`` dropped records).

    Args:
      show: how many dropped records to list.

    Returns:
      The lines.
    """
    images = f", {self.images} images" if self.images else ""
    if self.audio_clips:
      images += f", {self.audio_clips} audio clips ({self.audio_tokens} tokens)"
    if self.videos:
      images += f", {self.videos} videos ({self.video_tokens} tokens)"
    out = [
      f"{self.source}: {self.documents} documents, {self.tokens} tokens "
      f"({self.target_tokens} in the loss){images}, {self.truncated} truncated, "
      f"{len(self.dropped)} dropped"
    ]
    out += [f"  line {line}: {reason}" for line, reason in self.dropped[:show]]
    if len(self.dropped) > show:
      out.append(f"  ... and {len(self.dropped) - show} more (all in summary.json)")
    return out


_MEDIA_SIZES = {"image_sizes": "images", "audio_sizes": "audio clips", "video_sizes": "videos"}
_SOURCE_KEYS = (
  "path",
  "url",
)  # besides the part's type, where a part names its file, as transformers reads
_MEDIA = ("image", "audio", "video")


def _media_paths(message: dict, i: int, base_dir: str) -> dict[str, list[str]]:
  """The image, audio and video files of a message's parts, each kind in order
  (relative paths are relative to the JSONL file); checks every part."""
  content = message["content"]
  found: dict[str, list[str]] = {kind: [] for kind in _MEDIA}
  if isinstance(content, str):
    return found
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
      continue
    if kind in _MEDIA:
      keys = (kind, *_SOURCE_KEYS)
      source = next((part[k] for k in keys if isinstance(part.get(k), str)), None)
      if source is None:
        raise BadRecord(
          f"message {i} part {j}: {'a' if kind == 'video' else 'an'} {kind} part names "
          f"its file under one of "
          f"{list(keys)}, got {part!r}"[:200]
        )
      if source.startswith(("http://", "https://")):
        raise BadRecord(f"message {i} part {j}: {source} is remote; {kind} is read from files")
      path = os.path.join(base_dir, source)
      if not os.path.isfile(path):
        raise BadRecord(f"message {i} part {j}: {kind} {path} does not exist")
      found[kind].append(path)
      continue
    raise BadRecord(
      f"message {i} part {j}: expected {{'type': 'text', 'text': str}}, "
      f"{{'type': 'image', 'image': path}}, {{'type': 'audio', 'audio': path}} or "
      f"{{'type': 'video', 'video': path}}, "
      f"got {part!r}"[:200]
    )
  return found


def _load_images(paths: list[str], images: ImageProcessor) -> dict:
  """The documents' image arrays: uint8 patches and (column, row) positions
  of all images, concatenated, and each image's patch count."""
  from cpjax.data.images import load_image

  patches, positions, sizes = [], [], []
  for path in paths:
    try:
      image = load_image(path)
    except Exception as e:  # PIL's errors for unreadable files vary
      raise BadRecord(f"image {path} cannot be read: {type(e).__name__}: {e}") from None
    p, pos = images.patches(image)
    patches.append(p)
    positions.append(pos)
    sizes.append(len(p))
  return {
    "image_patches": np.concatenate(patches),
    "image_positions": np.concatenate(positions),
    "image_sizes": np.asarray(sizes, np.int32),
  }


def _load_audio(paths: list[str], audio: AudioProcessor) -> tuple[dict, list[int]]:
  """The document's audio arrays (every clip's frames concatenated, their
  real-frame mask, each clip's frame count) and each clip's soft tokens."""
  from cpjax.data.audio import read_audio

  features, real, sizes, soft = [], [], [], []
  for path in paths:
    try:
      samples, rate = read_audio(path)
    except Exception as e:  # libsndfile's errors for unreadable files vary
      raise BadRecord(f"audio {path} cannot be read: {type(e).__name__}: {e}") from None
    try:
      f, r = audio.features(samples, rate)
    except ValueError as e:  # another sampling rate, or too short to frame
      raise BadRecord(f"audio {path}: {e}") from None
    features.append(f)
    real.append(r)
    sizes.append(len(f))
    soft.append(audio.soft_tokens(r))
  arrays = {
    "audio_features": np.concatenate(features),
    "audio_mask": np.concatenate(real).astype(np.uint8),
    "audio_sizes": np.asarray(sizes, np.int32),
  }
  return arrays, soft


def _load_videos(paths: list[str], video: VideoProcessor) -> tuple[dict, list]:
  """The document's video arrays (every sampled frame's patches and their
  positions, concatenated; each frame's patch count) and each video's
  (soft tokens per frame, frame timestamps)."""
  from cpjax.data.video import read_video

  patches, positions, sizes, placeholders = [], [], [], []
  for path in paths:
    try:
      frames, times = read_video(path, video.num_frames)
    except ValueError as e:  # unreadable, too few frames, no frame count or rate
      raise BadRecord(str(e)) from None
    p, pos = video.patches(frames)
    patches.append(p.reshape(-1, p.shape[-1]))
    positions.append(np.tile(pos, (len(p), 1)))
    sizes += [len(pos)] * len(p)
    placeholders.append((video.soft_tokens(pos), times.tolist()))
  arrays = {
    "video_patches": np.concatenate(patches),
    "video_positions": np.concatenate(positions),
    "video_sizes": np.asarray(sizes, np.int32),
  }
  return arrays, placeholders


def encode_record(
  record: object,
  tokenizer: CheckpointTokenizer,
  *,
  images: ImageProcessor | None = None,
  audio: AudioProcessor | None = None,
  video: VideoProcessor | None = None,
  base_dir: str = ".",
) -> dict:
  """Encode one parsed record as ``{"input_ids": int32[T], "loss_mask": uint8[T]}``.

  Plus, for a conversation with images (read with ``images``, the
  checkpoint's image processor; relative paths from ``base_dir``),
  ``image_patches`` uint8 [n, F], ``image_positions`` int32 [n, 2] and
  ``image_sizes`` int32 [k] (patches per image); for one with audio (read
  with ``audio``, the checkpoint's feature extractor), ``audio_features``
  float32 [t, W] (every clip's frames, in order), ``audio_mask`` uint8 [t]
  (real frames) and ``audio_sizes`` int32 [a] (frames per clip); for one
  with videos (read with ``video``, the checkpoint's video processor; each
  video ``video.num_frames`` frames) ``video_patches`` uint8 [m, F],
  ``video_positions`` int32 [m, 2] and ``video_sizes`` int32 [f] (patches
  per frame).

  Args:
    record: one parsed record.
    tokenizer: the checkpoint's tokenizer and chat template.
    images: the checkpoint's image processor, for a conversation with images.
    audio: the checkpoint's audio feature extractor, for a conversation with audio.
    video: the checkpoint's video processor, for a conversation with videos.
    base_dir: the directory relative image, audio and video paths start from.

  Returns:
    ``{"input_ids": int32[T], "loss_mask": uint8[T]}``, plus the image,
    audio and video keys above for a conversation with them.

  Raises:
    BadRecord: saying why the record cannot be encoded.

  >>> import tempfile, json, os
  >>> from tokenizers import Tokenizer, models, pre_tokenizers
  >>> d = tempfile.mkdtemp()
  >>> tok = Tokenizer(models.WordLevel({"hi": 0, "there": 1, "<unk>": 2}, "<unk>"))
  >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
  >>> tok.save(os.path.join(d, "tokenizer.json"))
  >>> encode_record({"text": "hi there"}, CheckpointTokenizer(d))["loss_mask"].tolist()
  [1, 1]
  """
  if not isinstance(record, dict):
    raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
  unknown = sorted(set(record) - {"text", "messages", *_IGNORED_KEYS})
  if unknown:
    raise BadRecord(
      f"unknown key(s) {unknown}: a record is {{'text': ...}} or "
      f"{{'messages': [...]}} ({' and '.join(_IGNORED_KEYS)} are ignored)"
    )
  if ("text" in record) == ("messages" in record):
    raise BadRecord(
      "a record needs exactly one of 'text' (a document) or 'messages' (a conversation)"
    )
  if "text" in record:
    text = record["text"]
    if not isinstance(text, str) or not text:
      raise BadRecord(f"'text' must be a non-empty string, got {text!r}"[:200])
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if ids.size == 0:
      raise BadRecord("the text tokenizes to no tokens")
    return {"input_ids": ids, "loss_mask": np.ones(ids.shape, np.uint8)}
  messages = record["messages"]
  try:
    check_messages(messages)
  except (TypeError, ValueError) as e:
    raise BadRecord(str(e)) from None
  media = [_media_paths(message, i, base_dir) for i, message in enumerate(messages)]
  paths = [p for found in media for p in found["image"]]
  clips = [p for found in media for p in found["audio"]]
  movies = [p for found in media for p in found["video"]]
  if not any(m["role"] == ANSWER_ROLE for m in messages):
    raise BadRecord(f"no {ANSWER_ROLE!r} message: nothing of it would count in the loss")
  pixels, soft_tokens, sounds, audio_tokens = {}, [], {}, []
  if paths:
    if images is None:
      raise BadRecord(
        f"{len(paths)} image(s), but the checkpoint has no image processor config "
        f"(processor_config.json or preprocessor_config.json)"
      )
    pixels = _load_images(paths, images)
    soft_tokens = [n // images.patches_per_token for n in pixels.get("image_sizes", [])]
  if clips:
    if audio is None:
      raise BadRecord(
        f"{len(clips)} audio clip(s), but the checkpoint takes no audio (no audio "
        f"feature extractor in its processor config, no audio_config in config.json)"
      )
    sounds, audio_tokens = _load_audio(clips, audio)
  frames, videos = {}, []
  if movies:
    if video is None:
      raise BadRecord(
        f"{len(movies)} video(s), but the checkpoint has no video processor config "
        f"(processor_config.json's video_processor or video_preprocessor_config.json)"
      )
    frames, videos = _load_videos(movies, video)
  try:
    ids, answer = tokenizer.encode_chat(
      messages, soft_tokens=soft_tokens, audio_tokens=audio_tokens, videos=videos
    )
  except ValueError as e:
    raise BadRecord(str(e)) from None
  except Exception as e:  # the template's own raise_exception / undefined values
    raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}") from None
  if not answer.any():
    what = (
      "the chat template's {% generation %} blocks cover none of its tokens"
      if tokenizer.marks_generation
      else "the chat template renders no assistant token"
    )
    raise BadRecord(f"{what}: nothing of it would count in the loss")
  return {
    "input_ids": ids,
    "loss_mask": answer.astype(np.uint8),
    **pixels,
    **sounds,
    **frames,
  }


def read_jsonl(
  path: str | os.PathLike[str],
  tokenizer: CheckpointTokenizer,
  *,
  images: ImageProcessor | None = None,
  audio: AudioProcessor | None = None,
  video: VideoProcessor | None = None,
  seq_len: int | None = None,
  truncate: bool = False,
  strict: bool = False,
  summary: Summary | None = None,
) -> Iterator[dict]:
  """Read the documents of a JSONL file, in order (a generator).

  Args:
    path: the JSONL file.
    tokenizer: the checkpoint's tokenizer and chat template.
    images: the checkpoint's image processor (for conversations with images;
      their paths are relative to the JSONL file's directory).
    audio: the checkpoint's audio feature extractor (for conversations with
      audio clips, found as images are).
    video: the checkpoint's video processor (for conversations with videos,
      found as images are).
    seq_len: the training row length; a longer document is dropped, or cut
      with ``truncate``. None: no limit.
    truncate: keep the first ``seq_len`` tokens of longer documents (not of
      documents with images, audio or video: a cut could split their tokens).
    strict: raise :class:`BadRecord` (naming the line) at the first bad
      record instead of dropping and reporting it.
    summary: a :class:`Summary` to count into (its ``dropped`` lists every
      dropped line with the reason).

  Yields:
    Each kept document, as :func:`encode_record` encodes it (cut to
    ``seq_len`` with ``truncate``).
  """
  path = os.fspath(path)
  base_dir = os.path.dirname(os.path.abspath(path))
  summary = summary if summary is not None else Summary(path)
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise BadRecord(f"not JSON: {e}") from None
        doc = encode_record(
          record, tokenizer, images=images, audio=audio, video=video, base_dir=base_dir
        )
        n = doc["input_ids"].size
        cut = seq_len is not None and n > seq_len
        media = [what for key, what in _MEDIA_SIZES.items() if key in doc]
        if cut and media:
          raise BadRecord(
            f"{n} tokens with {' and '.join(media)}, longer than the row of {seq_len} "
            f"(never truncated: a cut could split their soft tokens)"
          )
        if cut and not truncate:
          raise BadRecord(
            f"{n} tokens, longer than the row of {seq_len} (truncation keeps its first {seq_len})"
          )
        if cut:
          doc = {key: value[:seq_len] for key, value in doc.items()}
          if not doc["loss_mask"][1:].any():
            raise BadRecord(f"{n} tokens; its first {seq_len} hold no target of the loss")
      except BadRecord as e:
        if strict:
          raise BadRecord(f"{path} line {line_number}: {e}") from None
        summary.dropped.append((line_number, str(e)))
        continue
      summary.documents += 1
      summary.truncated += int(cut)
      k = len(doc.get("image_sizes", ()))
      summary.images += k
      summary.max_images_per_document = max(summary.max_images_per_document, k)
      if "audio_sizes" in doc:
        assert audio is not None  # encode_record refuses clips without it
        sizes = doc["audio_sizes"]
        summary.audio_clips += len(sizes)
        summary.audio_tokens += sum(
          audio.soft_tokens(real) for real in np.split(doc["audio_mask"], np.cumsum(sizes)[:-1])
        )
        summary.max_audio_clips_per_document = max(summary.max_audio_clips_per_document, len(sizes))
        summary.max_audio_frames = max(summary.max_audio_frames, int(sizes.max()))
      if "video_sizes" in doc:
        assert video is not None  # encode_record refuses videos without it
        frames = doc["video_sizes"]
        summary.videos += len(frames) // video.num_frames
        summary.video_tokens += int(frames.sum()) // video.frame_processor.patches_per_token
        summary.max_videos_per_document = max(
          summary.max_videos_per_document, len(frames) // video.num_frames
        )
      summary.tokens += int(doc["input_ids"].size)
      # The first token is never a target (nothing precedes it).
      summary.target_tokens += int(doc["loss_mask"][1:].sum())
      yield doc


def prepare_data(
  source: str | os.PathLike,
  out: str | os.PathLike,
  *,
  checkpoint: str | os.PathLike,
  seq_len: int | None = None,
  truncate: bool = False,
  strict: bool = False,
  progress: bool = True,
) -> Summary:
  """Tokenize a JSONL file once into a corpus directory ``out`` that
  :func:`cpjax.data.corpus.packed_rows` (and ``cpjax train --data``) reads:
  ``documents.array_record`` (token ids and loss masks) and
  ``summary.json`` (the :class:`Summary`, the checkpoint and ``seq_len``).

  The arguments are :func:`read_jsonl`'s; ``checkpoint`` is the directory of
  the tokenizer and chat template. A source that yields no document is a
  ``ValueError`` (every line was bad: the summary says why).
  """
  from tqdm.auto import tqdm

  from cpjax.data.corpus import write_documents

  source, out = os.fspath(source), os.fspath(out)
  if not os.path.isfile(source):
    raise FileNotFoundError(f"data file {source} does not exist")
  if seq_len is not None and (
    isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2
  ):
    raise ValueError(f"seq_len must be an int >= 2 or None, got {seq_len!r}")
  tokenizer = CheckpointTokenizer(checkpoint)
  images = ImageProcessor.from_checkpoint(checkpoint)
  audio = AudioProcessor.from_checkpoint(checkpoint)
  video = VideoProcessor.from_checkpoint(checkpoint)
  os.makedirs(out, exist_ok=True)
  target = os.path.join(out, "documents.array_record")
  summary = Summary(source)
  with open(source, "rb") as f:
    total = sum(1 for _ in f)
  docs = tqdm(
    read_jsonl(
      source,
      tokenizer,
      images=images,
      audio=audio,
      video=video,
      seq_len=seq_len,
      truncate=truncate,
      strict=strict,
      summary=summary,
    ),
    total=total,
    desc="prepare",
    unit="doc",
    disable=not progress,
    leave=False,
  )
  write_documents(target, docs)
  info = {
    **summary.as_dict(),
    "checkpoint": os.fspath(checkpoint),
    "seq_len": seq_len,
    "truncate": truncate,
  }
  if summary.images:
    assert images is not None  # read_jsonl refuses images without a processor
    # What packing needs to lay the images out (cpjax.data.corpus.corpus_images).
    info["image_processor"] = {
      **dataclasses.asdict(images),
      "image_token_id": tokenizer.token_id(tokenizer.special_tokens["image_token"]),
    }
  if summary.audio_clips:
    assert audio is not None  # read_jsonl refuses clips without an extractor
    # What packing needs to lay the clips out (cpjax.data.corpus.corpus_audio).
    info["audio_processor"] = {
      **dataclasses.asdict(audio),
      "width": audio.width,
      "audio_token_id": tokenizer.token_id(tokenizer.special_tokens["audio_token"]),
    }
  if summary.videos:
    assert video is not None  # read_jsonl refuses videos without a processor
    # What packing needs to lay the frames out (cpjax.data.corpus.corpus_video).
    info["video_processor"] = {
      **dataclasses.asdict(video),
      "video_token_id": tokenizer.token_id(tokenizer.video_token),
    }
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  if summary.documents == 0:
    os.remove(target)
    raise ValueError("\n".join([f"{source} gave no document:", *summary.lines()[1:]]))
  return summary
