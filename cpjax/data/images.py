"""Gemma 4's image preprocessing with numpy and PIL (no torch, no transformers).

The steps of transformers' Gemma 4 image processor (its PIL backend, the one
transformers uses without torchvision), to the same bits:

1. load: open the file, apply its EXIF orientation, convert to RGB (a PIL
   image given directly: its transparency composited onto white);
2. resize, keeping the aspect ratio, to the largest size whose sides are
   multiples of ``pooling_kernel_size * patch_size`` and whose patches fit
   ``max_patches = max_soft_tokens * pooling_kernel_size**2`` (bicubic);
3. cut into ``patch_size`` squares, row by row, each flattened as (y, x,
   channel); pixels rescaled to [0, 1] (the model maps them to [-1, 1]);
4. ``image_position_ids``: each patch's (column, row); the processor pads
   both to ``max_patches`` (zeros, and -1 positions);
5. the image yields ``patches // pooling_kernel_size**2`` soft tokens, and
   its placeholder in the text becomes ``boi + image_token * n + eoi``.

The 12B unified model's processor (``Gemma4UnifiedImageProcessor``,
``ImageProcessor(unified=True)``) differs in three steps: it resizes with
torchvision's kernel (:mod:`cpjax.data.resample`), merges each
``pooling_kernel_size`` x ``pooling_kernel_size`` block of patches into one
patch, one soft token (its pixels row by row, padded to ``max_soft_tokens``),
and rescales in float32 (``x * float32(1/255)``).

A corpus stores the resized patches as uint8 (:meth:`ImageProcessor.patches`,
a quarter of float32's bytes); :meth:`ImageProcessor.pixels` gives the
processor's float32 from them, bit for bit.

Shape letters: ``n`` real patches of an image, ``P`` = ``max_patches``,
``F`` = ``3 * side**2`` (``side``: a patch's pixels across).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from PIL import Image

__all__ = ["ImageProcessor", "SUPPORTED_SOFT_TOKENS", "load_image", "pixel_values"]

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
# transformers' image processors cpjax computes -> whether it is the unified model's.
_PROCESSORS = {
  "Gemma4ImageProcessor": False,
  "Gemma4ImageProcessorPil": False,
  "Gemma4UnifiedImageProcessor": True,
}


def load_image(path: str | os.PathLike) -> Image.Image:
  """Load a PIL RGB image from a file, upright (its EXIF orientation applied).

  Args:
    path: the image file.

  Returns:
    The PIL RGB image.
  """
  from PIL import Image, ImageOps

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"image {path} does not exist")
  with Image.open(path) as image:
    return ImageOps.exif_transpose(image).convert("RGB")


def _rgb(image):
  """RGB as the processor converts: transparency composited onto white."""
  from PIL import Image

  if "A" in image.getbands() or image.info.get("transparency") is not None:
    image = image.convert("RGBA")
    return Image.alpha_composite(
      Image.new("RGBA", image.size, (255, 255, 255, 255)), image
    ).convert("RGB")
  return image.convert("RGB")


def pixel_values(patches: np.ndarray) -> np.ndarray:
  """Convert uint8 patches to the processor's float32 pixels in [0, 1].

  Rescaled in float64, then cast, as transformers does.

  Args:
    patches: uint8 [..., F] patches.

  Returns:
    float32 [..., F] pixels in [0, 1].
  """
  return (np.asarray(patches).astype(np.float64) * (1 / 255)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
  """Gemma 4's image processor settings (the defaults are transformers').

  ``unified``: the 12B unified model's processor (patches of
  ``pooling_kernel_size * patch_size`` pixels, one soft token each).

  >>> from PIL import Image
  >>> proc = ImageProcessor(max_soft_tokens=70)
  >>> patches, positions = proc.patches(Image.new("RGB", (300, 100), (255, 0, 0)))
  >>> proc.target_size(100, 300), patches.shape, proc.soft_tokens(patches)
  ((192, 672), (504, 768), 56)
  >>> positions[:3].tolist(), positions[-1].tolist()      # (column, row)
  ([[0, 0], [1, 0], [2, 0]], [41, 11])
  """

  patch_size: int = 16
  max_soft_tokens: int = 280
  pooling_kernel_size: int = 3
  unified: bool = False

  def __post_init__(self):
    for name in ("patch_size", "pooling_kernel_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
      raise ValueError(
        f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens!r}"
      )

  @classmethod
  def from_checkpoint(cls, path: str | os.PathLike) -> "ImageProcessor | None":
    """Read the settings in a checkpoint's processor config.

    Args:
      path: the checkpoint directory.

    Returns:
      The settings in its ``processor_config.json`` (its ``image_processor``
      entry) or ``preprocessor_config.json``; None when it has neither.

    Raises:
      ValueError: an ``image_processor_type`` other than Gemma 4's.
    """
    for name in ("processor_config.json", "preprocessor_config.json"):
      file = os.path.join(os.fspath(path), name)
      if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
          raw = json.load(f)
        raw = raw.get("image_processor", raw)
        # (transformers reads a legacy "...Fast" name as the processor it names)
        kind = raw.get("image_processor_type", "Gemma4ImageProcessor").removesuffix("Fast")
        if kind not in _PROCESSORS:
          raise ValueError(
            f"{name} in {path}: image_processor_type {kind!r} is not one cpjax "
            f"computes (expected one of {sorted(_PROCESSORS)})"
          )
        settings = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        return cls(**{**settings, "unified": _PROCESSORS[kind]})
    return None

  @property
  def side(self) -> int:
    """A patch's pixels across (merged under ``unified``)."""
    return self.patch_size * (self.pooling_kernel_size if self.unified else 1)

  @property
  def patches_per_token(self) -> int:
    """Patches that make one soft token."""
    return 1 if self.unified else self.pooling_kernel_size**2

  @property
  def max_patches(self) -> int:
    """An image's patch slots (P): its most patches."""
    return self.max_soft_tokens * self.patches_per_token

  @property
  def patch_features(self) -> int:
    return 3 * self.side**2

  def target_size(self, height: int, width: int) -> tuple[int, int]:
    """Return the (height, width) after the aspect-preserving resize.

    Args:
      height: the image's height.
      width: the image's width.

    Returns:
      (height, width) after the resize.
    """
    p, k = self.patch_size, self.pooling_kernel_size
    target_px = self.max_soft_tokens * k * k * p * p
    factor = math.sqrt(target_px / (height * width))
    side = k * p
    h = math.floor(factor * height / side) * side
    w = math.floor(factor * width / side) * side
    if h == 0 and w == 0:
      raise ValueError(f"a {height}x{width} image resizes to 0x0 patches")
    longest = self.max_soft_tokens * side
    # A very thin image: one block of patches across, its length capped.
    if h == 0:
      h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
      h, w = min(math.floor(height / width) * side, longest), side
    if h * w > target_px:
      raise ValueError(
        f"a {height}x{width} image resizes to {h}x{w}, more than "
        f"{self.max_soft_tokens * k * k} patches of {p}"
      )
    return h, w

  def patches(self, image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """Cut a PIL image (converted to RGB) into patches after the resize.

    Args:
      image: a PIL image.

    Returns:
      ``(uint8 [n, F] patches, int32 [n, 2] (column, row) positions)``.
    """
    from PIL import Image

    if not isinstance(image, Image.Image):
      raise TypeError(f"image must be a PIL image (see load_image), got {type(image).__name__}")
    image = _rgb(image)
    h, w = self.target_size(image.height, image.width)
    if self.unified:  # torchvision's resize
      from cpjax.data.resample import resize_frames

      pixels = np.asarray(image, np.uint8)[None]
      if (h, w) != pixels.shape[1:3]:
        pixels = resize_frames(pixels, h, w)
    else:
      if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC, reducing_gap=None)
      pixels = np.asarray(image, np.uint8)[None]
    patches, positions = self.cut(pixels)
    return patches[0], positions

  def cut(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut resized uint8 images [T, h, w, 3] (sides multiples of ``side``)
    into patches, row by row, each flattened as (y, x, channel).

    Args:
      pixels: uint8 [T, h, w, 3].

    Returns:
      ``(uint8 [T, n, F] patches, int32 [n, 2] (column, row) positions)``.
    """
    t, h, w, _ = pixels.shape
    p = self.side
    rows, cols = h // p, w // p
    patches = pixels.reshape(t, rows, p, cols, p, 3).transpose(0, 1, 3, 2, 4, 5)
    cx, cy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions = np.stack([cx, cy], axis=-1).reshape(rows * cols, 2).astype(np.int32)
    return patches.reshape(t, rows * cols, self.patch_features), positions

  def soft_tokens(self, patches: np.ndarray) -> int:
    """Count the soft tokens an image of these patches yields.

    Args:
      patches: the image's patches [n, F] (or their positions [n, 2]).

    Returns:
      The number of soft tokens.
    """
    return len(patches) // self.patches_per_token

  def pixels(self, patches: np.ndarray) -> np.ndarray:
    """Convert uint8 patches [..., F] to the processor's float32 pixels.

    As :func:`pixel_values`; under ``unified`` torch's ``x * (1/255)`` in
    float32 (126 of the 256 values differ from it by one ulp).

    Args:
      patches: uint8 [..., F] patches.

    Returns:
      float32 [..., F].
    """
    if self.unified:
      return np.asarray(patches).astype(np.float32) * np.float32(1 / 255)
    return pixel_values(patches)

  def __call__(self, images) -> dict:
    """The processor's output for a list of PIL images: ``pixel_values``
    float32 [N, P, F], ``image_position_ids`` int32 [N, P, 2] (padding:
    zeros and -1) and ``num_soft_tokens_per_image``."""
    pixels = np.zeros((len(images), self.max_patches, self.patch_features), np.float32)
    positions = np.full((len(images), self.max_patches, 2), -1, np.int32)
    soft = []
    for i, image in enumerate(images):
      patches, pos = self.patches(image)
      pixels[i, : len(patches)] = self.pixels(patches)
      positions[i, : len(patches)] = pos
      soft.append(self.soft_tokens(patches))
    return {
      "pixel_values": pixels,
      "image_position_ids": positions,
      "num_soft_tokens_per_image": soft,
    }
