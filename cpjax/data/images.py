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

A corpus stores the resized patches as uint8 (:meth:`ImageProcessor.patches`,
a quarter of float32's bytes); :func:`pixel_values` gives the processor's
float32 from them, bit for bit.

Shape letters: ``n`` real patches of an image, ``P`` = ``max_patches``,
``F`` = ``3 * patch_size**2``.
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
    """
    for name in ("processor_config.json", "preprocessor_config.json"):
      file = os.path.join(os.fspath(path), name)
      if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
          raw = json.load(f)
        raw = raw.get("image_processor", raw)
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})
    return None

  @property
  def max_patches(self) -> int:
    return self.max_soft_tokens * self.pooling_kernel_size**2

  @property
  def patch_features(self) -> int:
    return 3 * self.patch_size**2

  def target_size(self, height: int, width: int) -> tuple[int, int]:
    """Return the (height, width) after the aspect-preserving resize.

    Args:
      height: the image's height.
      width: the image's width.

    Returns:
      (height, width) after the resize.
    """
    p, k = self.patch_size, self.pooling_kernel_size
    target_px = self.max_patches * p * p
    factor = math.sqrt(target_px / (height * width))
    side = k * p
    h = math.floor(factor * height / side) * side
    w = math.floor(factor * width / side) * side
    if h == 0 and w == 0:
      raise ValueError(f"a {height}x{width} image resizes to 0x0 patches")
    longest = (self.max_patches // k**2) * side
    # A very thin image: one block of patches across, its length capped.
    if h == 0:
      h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
      h, w = min(math.floor(height / width) * side, longest), side
    if h * w > target_px:
      raise ValueError(
        f"a {height}x{width} image resizes to {h}x{w}, more than {self.max_patches} patches of {p}"
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
    if (h, w) != (image.height, image.width):
      image = image.resize((w, h), resample=Image.Resampling.BICUBIC, reducing_gap=None)
    p = self.patch_size
    pixels = np.asarray(image, np.uint8)  # [H, W, 3]
    rows, cols = h // p, w // p
    patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
    cx, cy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions = np.stack([cx, cy], axis=-1).reshape(rows * cols, 2).astype(np.int32)
    return patches.reshape(rows * cols, self.patch_features), positions

  def soft_tokens(self, patches: np.ndarray) -> int:
    """Count the soft tokens an image of these patches yields.

    Args:
      patches: the image's patches [n, F].

    Returns:
      The number of soft tokens.
    """
    return len(patches) // self.pooling_kernel_size**2

  def __call__(self, images) -> dict:
    """The processor's output for a list of PIL images: ``pixel_values``
    float32 [N, P, F], ``image_position_ids`` int32 [N, P, 2] (padding:
    zeros and -1) and ``num_soft_tokens_per_image``."""
    pixels = np.zeros((len(images), self.max_patches, self.patch_features), np.float32)
    positions = np.full((len(images), self.max_patches, 2), -1, np.int32)
    soft = []
    for i, image in enumerate(images):
      patches, pos = self.patches(image)
      pixels[i, : len(patches)] = pixel_values(patches)
      positions[i, : len(patches)] = pos
      soft.append(self.soft_tokens(patches))
    return {
      "pixel_values": pixels,
      "image_position_ids": positions,
      "num_soft_tokens_per_image": soft,
    }
