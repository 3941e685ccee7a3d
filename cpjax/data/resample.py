"""Images and frames resized as torchvision resizes uint8 images on a CPU, in numpy.

torchvision's ``resize(..., BICUBIC, antialias=True)`` of a uint8 image on a
CPU is torch's ``interpolate(..., mode="bicubic", antialias=True)`` on
uint8, a port of Pillow-SIMD's fixed point: Keys' cubic (a = -0.5),
stretched by the scale when shrinking, its weights normalised per output in
float64 and rounded to int16 with as many fraction bits as keep the largest
below 2**15; the horizontal pass first, each pass rounded to uint8. PIL's own
bicubic has the same kernel in another fixed point: the two differ by a
level on a few pixels. transformers' torchvision processors (Gemma 4's video
processors, the 12B's image processor) resize so.

Shape letters: ``T`` images, ``H``, ``W`` their height and width.
"""

from __future__ import annotations

import numpy as np

__all__ = ["resize_frames"]

# torch scales the resampling weights to int16 with as many fraction bits as
# keep the largest below 2**15, at most 22 (Pillow-SIMD's fixed point).
_MAX_PRECISION = 22


def _keys_cubic(x: np.ndarray) -> np.ndarray:
  """Keys' cubic convolution kernel with a = -0.5 (torch's antialiased bicubic)."""
  a, x = -0.5, np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _weights(size: int, out: int) -> tuple[np.ndarray, int]:
  """(int64 [size, out] fixed-point resampling matrix, its fraction bits):
  torch's antialiased bicubic weights for one axis, in float64, normalised
  per output, then rounded half away from zero to int16 at the precision
  the largest weight allows."""
  scale = size / out
  support = 2.0 * scale if scale >= 1.0 else 2.0
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  taps = int(np.ceil(np.float32(support))) * 2 + 1
  dense = np.zeros((size, out))
  for i in range(out):
    center = scale * (i + 0.5)
    # C's truncating casts, as torch computes each output's first input and count.
    lo = max(int(center - support + 0.5), 0)
    count = min(max(min(int(center + support + 0.5), size) - lo, 0), taps)
    w = _keys_cubic((np.arange(count) + lo - center + 0.5) * invscale)
    if w.sum() != 0.0:
      w = w / w.sum()
    dense[lo : lo + count, i] = w
  precision = 0
  while precision < _MAX_PRECISION and int(0.5 + dense.max() * (1 << (precision + 1))) < 1 << 15:
    precision += 1
  scaled = dense * (1 << precision)
  fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5))
  return fixed.astype(np.int64), precision


def _resample_last(x: np.ndarray, out: int) -> np.ndarray:
  """uint8 [..., size] -> uint8 [..., out] along the last axis, in torch's
  fixed point: a rounding half, the int16-weighted sum, an arithmetic shift
  and a clip to [0, 255]."""
  weights, precision = _weights(x.shape[-1], out)
  # Integer sums far below 2**53: float64's matmul is exact in any order.
  acc = np.rint(x.astype(np.float64) @ weights.astype(np.float64)).astype(np.int64)
  return np.clip((acc + (1 << (precision - 1))) >> precision, 0, 255).astype(np.uint8)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
  """Resize uint8 frames as torchvision resizes them on a CPU (bicubic, antialiased).

  torch's uint8 kernel: Keys' cubic (a = -0.5) stretched by the scale when
  shrinking, in 16-bit fixed point, the horizontal pass first, each pass
  rounded to uint8. PIL's bicubic has the same kernel in another fixed
  point: the two differ by one level on a few pixels.

  Args:
    frames: uint8 [T, H, W, 3] frames.
    height: the height to resize to.
    width: the width to resize to.

  Returns:
    uint8 [T, height, width, 3].

  >>> frames = np.zeros((1, 4, 6, 3), np.uint8)
  >>> frames[..., 3:, :] = 200
  >>> resize_frames(frames, 2, 3)[0, :, :, 0].tolist()  # the cubic overshoots past an edge
  [[0, 100, 210], [0, 100, 210]]
  """
  frames = np.asarray(frames)
  if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
  out = []
  for frame in frames:  # one frame at a time: a 1080p frame is 50 MB in float64
    x = frame.transpose(0, 2, 1)  # [H, 3, W]
    if width != x.shape[-1]:
      x = _resample_last(x, width)
    x = x.transpose(2, 1, 0)  # [W', 3, H]
    if height != x.shape[-1]:
      x = _resample_last(x, height)
    out.append(x.transpose(2, 0, 1))  # [H', W', 3]
  return np.stack(out)
