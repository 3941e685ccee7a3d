"""Gemma 4's video preprocessing with PyAV and numpy (no torch, no transformers).

The steps of transformers' ``Gemma4VideoProcessor`` (E2B, E4B, 26B-A4B and
31B) and ``Gemma4UnifiedVideoProcessor`` (12B, ``unified=True``: each
``pooling_kernel_size`` x ``pooling_kernel_size`` block of patches merged
into one patch, one soft token, as its image processor merges them), to the
same bits:

1. decode (:func:`read_video`): PyAV, the default backend of transformers'
   ``load_video``; the stream's frame count and average frame rate;
2. sample ``num_frames`` frames (32 by default): frame ``i * total //
   num_frames``; a video with fewer frames is refused, as transformers
   refuses it; each frame's timestamp is its index over the frame rate;
3. resize each frame as the image processor sizes an image, to at most
   ``max_soft_tokens`` soft tokens (70 by default, not the images' 280), with
   the resampling torchvision runs for uint8 frames on a CPU
   (:func:`cpjax.data.resample.resize_frames`: torch's antialiased bicubic,
   not PIL's);
4. cut into patches as :mod:`cpjax.data.images` cuts an image; pixels are
   ``x / 255`` in float32 (torchvision's normalize with the rescale fused in,
   which equals the image processor's float64 ``x * (1/255)`` cast, for
   every uint8 value: :func:`cpjax.data.images.pixel_values`);
5. in the text each video placeholder becomes, frame by frame, ``"mm:ss " +
   boi + video_token * n + eoi``, the frames joined by spaces
   (:func:`placeholder_text`).

A corpus stores the patches as uint8, as it stores images'.

Shape letters: ``T`` frames, ``H``, ``W`` a frame's height and width, ``n``
real patches of a frame, ``P`` = ``max_patches``, ``F`` = ``3 * side**2``
(:attr:`cpjax.data.images.ImageProcessor.side`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from cpjax.data.images import ImageProcessor, pixel_values
from cpjax.data.resample import resize_frames

__all__ = [
  "VideoProcessor",
  "placeholder_text",
  "read_video",
]


def read_video(path: str | os.PathLike, num_frames: int) -> tuple[np.ndarray, np.ndarray]:
  """Decode ``num_frames`` frames of a video file, sampled evenly, and their times.

  As transformers' ``load_video`` with PyAV and the processor's sampling:
  frame ``i * total // num_frames`` of the stream's ``total`` frames, at
  ``index / fps`` seconds (``fps``: the stream's average rate).

  Args:
    path: the video file (any container and codec FFmpeg decodes).
    num_frames: how many frames to sample.

  Returns:
    ``(uint8 [T, H, W, 3] RGB frames, float64 [T] timestamps in seconds)``.

  Raises:
    ValueError: a video with fewer than ``num_frames`` frames, a stream
      that states no frame count or rate, or one that decodes to fewer
      frames than it states.
  """
  try:
    import av
  except ImportError:
    raise ImportError('reading videos needs PyAV: pip install -e ".[video]"') from None

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"video {path} does not exist")
  try:
    frames, total, rate, indices = _decode(av, path, num_frames)
  except av.FFmpegError as e:
    raise ValueError(f"video {path} cannot be read: {type(e).__name__}: {e}") from None
  if len(frames) != num_frames:
    raise ValueError(
      f"video {path} states {total} frames but decodes to fewer: {len(frames)} of "
      f"the {num_frames} sampled frames were found"
    )
  return np.stack(frames), indices / float(rate)


def _decode(av, path: str | os.PathLike, num_frames: int):
  """(the sampled RGB frames, the stream's frame count and rate, the indices)."""
  with av.open(path) as container:
    if not container.streams.video:
      raise ValueError(f"video {path} holds no video stream")
    stream = container.streams.video[0]
    total, rate = int(stream.frames), stream.average_rate
    if total <= 0 or not rate:
      raise ValueError(
        f"video {path} states no frame count or frame rate (its container gives "
        f"frames={total}, average_rate={rate}); remux it to MP4 first"
      )
    if num_frames > total:
      raise ValueError(
        f"video {path} has {total} frames, fewer than the {num_frames} the video "
        f"processor samples (num_frames)"
      )
    indices = np.arange(num_frames, dtype=np.int64) * total // num_frames
    wanted, frames = set(indices.tolist()), []
    for i, frame in enumerate(container.decode(video=0)):
      if i > indices[-1]:
        break
      if i in wanted:
        frames.append(frame.to_ndarray(format="rgb24"))
  return frames, total, rate, indices


def placeholder_text(
  timestamps: Sequence[float], soft_tokens: int, *, boi: str, video_token: str, eoi: str
) -> str:
  """Write the text one video placeholder becomes, as Gemma 4's processors write it.

  Args:
    timestamps: each sampled frame's time, in seconds.
    soft_tokens: each frame's soft-token count.
    boi: the image begin marker (frames are framed as images).
    video_token: the video soft token.
    eoi: the image end marker.

  Returns:
    The frames' ``"mm:ss " + boi + video_token * soft_tokens + eoi``, joined by spaces.

  >>> placeholder_text([0.0, 61.5], 2, boi="<", video_token="v", eoi=">")
  '00:00 <vv> 01:01 <vv>'
  """
  return " ".join(
    f"{int(t // 60):02d}:{int(t % 60):02d} {boi}{video_token * soft_tokens}{eoi}"
    for t in timestamps
  )


# The video processor's settings cpjax computes, as transformers' defaults.
_FIXED_SETTINGS = {
  "do_resize": True,
  "do_rescale": True,
  "rescale_factor": 1 / 255,
  "do_convert_rgb": True,
  "image_mean": [0.0, 0.0, 0.0],
  "image_std": [1.0, 1.0, 1.0],
  "do_sample_frames": True,
  "fps": None,
  "resample": 3,  # bicubic
}
# transformers' video processors cpjax computes -> whether it is the unified model's.
_PROCESSORS = {"Gemma4VideoProcessor": False, "Gemma4UnifiedVideoProcessor": True}


@dataclasses.dataclass(frozen=True)
class VideoProcessor:
  """Gemma 4's video processor settings (the defaults are transformers').

  >>> proc = VideoProcessor(num_frames=2)
  >>> frames = np.zeros((2, 90, 160, 3), np.uint8)
  >>> patches, positions = proc.patches(frames)
  >>> patches.shape, positions.shape, proc.soft_tokens(positions)
  ((2, 594, 768), (594, 2), 66)
  """

  patch_size: int = 16
  max_soft_tokens: int = 70
  pooling_kernel_size: int = 3
  num_frames: int = 32
  unified: bool = False

  def __post_init__(self):
    self.frame_processor  # checks patch_size, max_soft_tokens and pooling_kernel_size
    n = self.num_frames
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"num_frames must be a positive int, got {n!r}")

  @classmethod
  def from_checkpoint(cls, path: str | os.PathLike) -> "VideoProcessor | None":
    """Read a checkpoint's video processor.

    From its ``processor_config.json``'s ``video_processor`` entry, or its
    ``video_preprocessor_config.json``.

    Args:
      path: the checkpoint directory.

    Returns:
      The :class:`VideoProcessor`, or None when the checkpoint has neither.

    Raises:
      ValueError: a processor other than Gemma 4's two, or a setting other
        than those cpjax computes (each named).
    """
    path = os.fspath(path)
    for name, key in (
      ("processor_config.json", "video_processor"),
      ("video_preprocessor_config.json", None),
    ):
      file = os.path.join(path, name)
      if not os.path.isfile(file):
        continue
      with open(file, encoding="utf-8") as f:
        raw = json.load(f)
      entry = raw.get(key) if key else raw
      if not isinstance(entry, dict):
        continue
      kind = entry.get("video_processor_type", "Gemma4VideoProcessor")
      if kind not in _PROCESSORS:
        raise ValueError(
          f"{name} in {path}: video_processor_type {kind!r} is not one cpjax "
          f"computes (expected one of {sorted(_PROCESSORS)})"
        )
      for setting, want in _FIXED_SETTINGS.items():
        if setting in entry and entry[setting] != want:
          raise ValueError(
            f"{name} in {path}: the video processor's {setting} is "
            f"{entry[setting]!r}; cpjax samples and resizes frames with {setting} = {want!r}"
          )
      settings = {f.name: entry[f.name] for f in dataclasses.fields(cls) if f.name in entry}
      return cls(**{**settings, "unified": _PROCESSORS[kind]})
    return None

  @property
  def frame_processor(self) -> ImageProcessor:
    """The image processor that sizes and cuts each frame."""
    return ImageProcessor(
      self.patch_size, self.max_soft_tokens, self.pooling_kernel_size, unified=self.unified
    )

  @property
  def max_patches(self) -> int:
    return self.frame_processor.max_patches

  @property
  def patch_features(self) -> int:
    return self.frame_processor.patch_features

  def patches(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Resize a video's frames and cut them into patches.

    Args:
      frames: uint8 [T, H, W, 3] frames.

    Returns:
      ``(uint8 [T, n, F] patches, int32 [n, 2] (column, row) positions)``:
      every frame has the same size, hence the same positions.
    """
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
      raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    h, w = self.frame_processor.target_size(*frames.shape[1:3])
    if (h, w) != frames.shape[1:3]:
      frames = resize_frames(frames, h, w)
    return self.frame_processor.cut(frames)

  def soft_tokens(self, positions: np.ndarray) -> int:
    """Count the soft tokens a frame of these patch positions yields.

    Args:
      positions: a frame's patch positions [n, 2].

    Returns:
      The number of soft tokens per frame.
    """
    return self.frame_processor.soft_tokens(positions)

  def __call__(self, videos: Sequence[np.ndarray]) -> dict:
    """The processor's output for already-sampled videos (uint8 [T, H, W, 3]
    each): ``pixel_values_videos`` float32 [sum T, P, F],
    ``video_position_ids`` int32 [sum T, P, 2] (padding: zeros and -1),
    ``num_frames_per_video`` and ``num_soft_tokens_per_video``."""
    pixels, positions, frames, soft = [], [], [], []
    for video in videos:
      patches, pos = self.patches(video)
      t, n = patches.shape[:2]
      pixel = np.zeros((t, self.max_patches, self.patch_features), np.float32)
      pixel[:, :n] = pixel_values(patches)
      where = np.full((t, self.max_patches, 2), -1, np.int32)
      where[:, :n] = pos
      pixels.append(pixel)
      positions.append(where)
      frames.append(t)
      soft.append(self.soft_tokens(pos))
    return {
      "pixel_values_videos": np.concatenate(pixels),
      "video_position_ids": np.concatenate(positions),
      "num_frames_per_video": frames,
      "num_soft_tokens_per_video": soft,
    }
