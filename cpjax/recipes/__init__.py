"""Shipped run recipes: YAML run configs for ``cpjax train --recipe NAME``.

Each ``NAME.yaml`` here is a :class:`~cpjax.training.run_config.RunConfig`
(its first comments say what it is for and how to run it); :data:`RECIPES`
names the devices each was planned to fit with ``cpjax plan --write-config``
(the closed form; the tests check that it still fits).

>>> RECIPES["12b-lora-128k-v5e"]
Recipe(device_memory='16GiB', devices=16, target='v5e-16', audio_seconds=0.0)
>>> path("tiny").endswith("tiny.yaml")
True
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["RECIPES", "Recipe", "path"]


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The devices a recipe was planned for: ``devices`` of ``device_memory``
  each (None: the tiny ones, which train here on emulated CPU devices), and
  the chips by name (``cpjax plan --recipe NAME --target TARGET`` compiles it
  for them); a long-audio recipe's rows were planned with a clip of
  ``audio_seconds`` each (``cpjax plan --recipe NAME`` plans them so)."""

  device_memory: str | None = None
  devices: int | None = None
  target: str | None = None
  audio_seconds: float = 0.0


# What each recipe is for is in its file's first comments.
RECIPES = {
  "tiny": Recipe(),  # what `make run` trains
  "tiny-moe-ep": Recipe(),  # the README's expert-parallel run
  "e2b-lora-128k": Recipe("16GiB", 8, "v5e-8"),
  "e2b-lora-256k-v5e": Recipe("16GiB", 8, "v5e-8"),
  "e2b-lora-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "e2b-full-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "a4b-lora-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "a4b-lora-128k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "a4b-qlora-128k-v5e": Recipe("16GiB", 16, "v5e-16"),
  "a4b-qlora-256k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "a4b-qlora-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "e2b-lora-256k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "e2b-full-256k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "a4b-full-128k-v5p": Recipe("95GiB", 8, "v5p-16"),
  "e2b-lora-128k-v6e": Recipe("32GiB", 4, "v6e-4"),
  "e2b-full-128k-v6e": Recipe("32GiB", 4, "v6e-4"),
  "a4b-lora-128k-v6e": Recipe("32GiB", 16, "v6e-16"),
  "a4b-lora-256k-v5p": Recipe("95GiB", 8, "v5p-16"),
  "a4b-lora-256k-v6e": Recipe("32GiB", 16, "v6e-16"),
  "a4b-full-128k-v6e": Recipe("32GiB", 32, "v6e-32"),
  "a4b-lora-256k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "a4b-full-256k-v5p": Recipe("95GiB", 8, "v5p-16"),
  "a4b-full-256k-v6e": Recipe("32GiB", 32, "v6e-32"),
  "a4b-full-128k-v5e": Recipe("16GiB", 64, "v5e-64"),
  "a4b-full-256k-v5e": Recipe("16GiB", 64, "v5e-64"),
  "e2b-lora-256k-v6e": Recipe("32GiB", 4, "v6e-4"),
  "e2b-full-256k-v6e": Recipe("32GiB", 8, "v6e-8"),
  "e2b-full-128k": Recipe("141GiB", 8, "h200-8"),
  "e2b-full-128k-v5e": Recipe("16GiB", 16, "v5e-16"),
  "e2b-full-256k-v5e": Recipe("16GiB", 16, "v5e-16"),
  "a4b-ep-128k": Recipe("141GiB", 16, "h200-2x8"),
  "31b-lora-128k": Recipe("141GiB", 8, "h200-8"),
  "12b-lora-128k-v5e": Recipe("16GiB", 16, "v5e-16"),
  "12b-lora-256k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "12b-full-128k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "12b-full-256k-v5e": Recipe("16GiB", 32, "v5e-32"),
  "12b-full-128k-v6e": Recipe("32GiB", 32, "v6e-32"),
  "12b-lora-128k-v6e": Recipe("32GiB", 16, "v6e-16"),
  "12b-lora-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "12b-full-128k-v5p": Recipe("95GiB", 4, "v5p-8"),
  "12b-lora-128k-h200": Recipe("141GiB", 4, "h200-4"),
  "12b-lora-256k-h200": Recipe("141GiB", 8, "h200-8"),
  "12b-full-128k-h200": Recipe("141GiB", 8, "h200-8"),
  "12b-full-256k-h200": Recipe("141GiB", 16, "h200-2x8"),
  "12b-lora-256k-v6e": Recipe("32GiB", 16, "v6e-16"),
  # An hour of speech a row (90,000 of its 131,072 tokens are audio).
  "e4b-lora-128k-audio-v5e": Recipe("16GiB", 16, "v5e-16", audio_seconds=3600),
  # One GPU: QLoRA at the longest power-of-two row its compiler fits.
  "e2b-qlora-64k-h100": Recipe("79.1GiB", 1, "h100-1"),
  "e2b-qlora-128k-h200": Recipe("141GiB", 1, "h200-1"),
  "e4b-qlora-32k-h100": Recipe("79.1GiB", 1, "h100-1"),
  "e4b-qlora-64k-h200": Recipe("141GiB", 1, "h200-1"),
  "a4b-qlora-32k-h200": Recipe("141GiB", 1, "h200-1"),
}


def path(name: str) -> str:
  """Return the file of recipe ``name``; ``KeyError`` naming the recipes there are.

  Args:
    name: the recipe's name.

  Returns:
    The recipe file's path.
  """
  if name not in RECIPES:
    raise KeyError(f"no recipe {name!r}; the recipes are {sorted(RECIPES)}")
  return os.path.join(os.path.dirname(__file__), f"{name}.yaml")
