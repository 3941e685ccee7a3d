"""Video in Gemma 4's batches: ``pixel_values_videos`` / ``video_position_ids``
(every frame a vision-tower input, its soft tokens in the video
placeholders, ``mm_token_type_ids`` 2) beside images, as transformers'
``get_video_features`` reads them. On tiny random checkpoints transformers
saved (E2B-like, 26B-A4B-like with bidirectional vision groups, the 12B-like
unified model), cpjax's logits on one device and under CP equal
transformers' float64 logits within 5x transformers' own float32 error;
frames that disagree with their placeholders are refused."""

import os
import sys

import chex
import jax
import numpy as np
import pytest

from cpjax import parallel
from cpjax.models import gemma4
from tests.helpers import (
  assert_cp_gradient_equals_one_device,
  assert_within_transformers_error,
  transformers_logits,
)

torch = pytest.importorskip("torch", reason="transformers' Gemma 4 needs torch")
transformers = pytest.importorskip("transformers", reason="the reference is transformers'")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gemma4"))
import make_fixtures  # noqa: E402

VIDEO = 258884


def _picture(rng, unified: bool, width: int, height: int):
  """(pixels, positions, soft tokens) of one image or frame of width x
  height patches, as the model's processor pads them."""
  if not unified:
    return make_fixtures._image(rng, width, height)
  # The unified model: 2-pixel patches, one soft token each (48 features of 4x4 pixels).
  n, cap = width * height, 12
  pos = np.full((cap, 2), -1, np.int64)
  pos[:n] = [(x, y) for y in range(height) for x in range(width)]
  return rng.random((cap, 48), dtype=np.float32) * (pos[:, :1] >= 0), pos, n


def video_rows(kind: str, seed: int = 0) -> dict:
  """Two rows of 64 tokens as Gemma 4's processor lays them out. Row 0: text,
  an image, text, then a 3-frame video (each frame ``<boi>`` + its soft
  tokens + ``<eoi>``, timestamps as text between); row 1, left-padded: a
  2-frame video (a frame longer than the window of 8), then text."""
  rng = np.random.default_rng(seed)
  unified = kind == "unified"
  image_id, boi, eoi = make_fixtures.IMAGE, make_fixtures.BOI, make_fixtures.EOI

  def picture(width, height):
    return _picture(rng, unified, width, height)

  s = 64
  ids = rng.integers(5, 256, (2, s))
  types = np.zeros((2, s), np.int64)
  mask = np.ones((2, s), np.int64)
  sizes = {"image": [(6, 6)], "video": [(6, 6), (9, 6), (6, 6), (9, 9), (6, 6)]}
  if unified:
    sizes = {"image": [(2, 2)], "video": [(2, 1), (3, 2), (2, 2), (3, 3), (1, 1)]}
  image = [picture(*wh) for wh in sizes["image"]]
  frames = [picture(*wh) for wh in sizes["video"]]
  at = {0: 4}

  def put(row, soft, token, kind_id, gap):
    start = at[row]
    ids[row, start] = boi
    ids[row, start + 1 : start + 1 + soft] = token
    types[row, start + 1 : start + 1 + soft] = kind_id
    ids[row, start + 1 + soft] = eoi
    at[row] = start + 2 + soft + gap

  put(0, image[0][2], image_id, 1, 5)
  for f in frames[:3]:
    put(0, f[2], VIDEO, 2, 2)  # "mm:ss " between frames
  pad = 6
  ids[1, :pad], mask[1, :pad] = 0, 0
  at[1] = pad + 3
  for f in frames[3:]:
    put(1, f[2], VIDEO, 2, 1)
  return {
    "input_ids": ids,
    "attention_mask": mask,
    "mm_token_type_ids": types,
    "pixel_values": np.stack([i[0] for i in image]),
    "image_position_ids": np.stack([i[1] for i in image]),
    "pixel_values_videos": np.stack([f[0] for f in frames]),
    "video_position_ids": np.stack([f[1] for f in frames]),
    "num_frames_per_video": np.array([3, 2]),
  }


BUILD = {
  "dense": lambda: make_fixtures.build("ple_kv_sharing"),
  "moe": lambda: make_fixtures.build("moe_k_eq_v_vision"),
  "unified": make_fixtures.build_unified,
}


# Suite budget: the 26B-A4B-like and unified checkpoints in make soak.
@pytest.fixture(
  scope="module",
  params=["dense", *(pytest.param(k, marks=pytest.mark.slow) for k in ("moe", "unified"))],
)
def checkpoint(request, tmp_path_factory):
  """(kind, directory, transformers' float64 and float32 logits of the rows)."""
  path = str(tmp_path_factory.mktemp(f"video-{request.param}"))
  built = BUILD[request.param]()
  built.save_pretrained(path)
  # Loaded back with the experts' eager loop (torch's grouped matmul has no float64).
  model = type(built).from_pretrained(path, experts_implementation="eager").eval()
  return request.param, path, transformers_logits(model, video_rows(request.param))


def test_logits_with_video_equal_transformers(checkpoint):
  """One device, and fsdp = 2 x cp = 4 load-balanced (each rank's tokens
  take their frames' soft tokens; each frame computed on one rank)."""
  kind, path, logits = checkpoint
  rows = video_rows(kind)
  model = gemma4.Gemma4.from_pretrained(path)
  batch = gemma4.prepare_batch(rows, model.cfg)
  real = rows["attention_mask"].astype(bool)
  forward = jax.jit(lambda b: model(b))  # (eagerly, ~300 op-by-op compiles)
  assert_within_transformers_error(forward(batch), logits, real)
  # fsdp = 2 x cp = 4: each data shard finds its rows' frames by offset.
  mesh = parallel.make_mesh(fsdp=2, cp=4, devices=jax.devices()[:8])
  got = gemma4.cp_logits(model, batch, mesh, layout="load_balanced", batch_axis="fsdp")
  chex.assert_shape(got, logits[torch.float64].shape)
  assert_within_transformers_error(got, logits, real)
  # Without the frames' soft tokens the logits are far from transformers'.
  dark = dict(rows, pixel_values_videos=np.zeros_like(rows["pixel_values_videos"]))
  off = np.asarray(forward(gemma4.prepare_batch(dark, model.cfg)))
  assert np.abs(off - logits[torch.float64])[real].max() > 1e-2


def test_video_that_disagrees_with_its_placeholders_is_refused():
  rows = video_rows("dense")
  cfg = gemma4.Gemma4Config.from_hf(BUILD["dense"]().config.to_dict())
  gemma4.prepare_batch(rows, cfg)  # as the processor lays them out: accepted
  short = dict(rows, video_position_ids=rows["video_position_ids"].copy())
  short["video_position_ids"][0, 18:] = -1  # the first frame's top 3 rows: 2 soft tokens, not 4
  with pytest.raises(
    ValueError,
    match=r"video placeholders and soft tokens disagree: input_ids hold 27 video tokens "
    r"\(id 258884\) but the 5 video frames in pixel_values_videos yield 25",
  ):
    gemma4.prepare_batch(short, cfg)
  with pytest.raises(
    KeyError, match="the batch has pixel_values_videos but no 'video_position_ids'"
  ):
    gemma4.prepare_batch({k: v for k, v in rows.items() if k != "video_position_ids"}, cfg)
  with pytest.raises(
    ValueError, match=r"num_frames_per_video must be \[V\] frame counts summing to the 5"
  ):
    gemma4.prepare_batch(dict(rows, num_frames_per_video=np.array([3, 3])), cfg)
  without = {k: v for k, v in rows.items() if "video" not in k}
  with pytest.raises(
    ValueError, match="hold 27 video placeholder tokens .* no pixel_values_videos"
  ):
    gemma4.prepare_batch(without, cfg)


def long_video_rows(kind: str, frames: int = 40, seed: int = 1) -> dict:
  """One row of 512 tokens holding one long video, as the processor lays it
  out: ``frames`` frames of 4, 6 and 9 soft tokens in turn (the last longer
  than the window of 8), each after its ``mm:ss`` text, then text."""
  rng = np.random.default_rng(seed)
  unified = kind == "unified"
  sizes = [(2, 2), (3, 2), (3, 3)] if unified else [(6, 6), (9, 6), (9, 9)]
  shots = [_picture(rng, unified, *sizes[f % 3]) for f in range(frames)]
  s = 512
  ids = rng.integers(5, 256, (1, s))
  types = np.zeros((1, s), np.int64)
  at = 6
  for _, _, soft in shots:
    at += 2  # "mm:ss "
    ids[0, at] = make_fixtures.BOI
    ids[0, at + 1 : at + 1 + soft] = VIDEO
    types[0, at + 1 : at + 1 + soft] = 2
    ids[0, at + 1 + soft] = make_fixtures.EOI
    at += soft + 2
  assert at < s - 8, at
  return {
    "input_ids": ids,
    "attention_mask": np.ones((1, s), np.int64),
    "mm_token_type_ids": types,
    "pixel_values_videos": np.stack([p[0] for p in shots]),
    "video_position_ids": np.stack([p[1] for p in shots]),
    "num_frames_per_video": np.array([frames]),
  }


@pytest.fixture(scope="module")
def long_video(checkpoint):
  """(kind, directory, transformers' float64 and float32 logits of the long row)."""
  kind, path, _ = checkpoint
  model = type(BUILD[kind]()).from_pretrained(path, experts_implementation="eager").eval()
  return kind, path, transformers_logits(model, long_video_rows(kind))


# Every layout with the ring, and every strategy on the load-balanced layout
# (the hybrid on the sliding layers: a full layer's one K/V head has no
# Ulysses factor). Suite budget: the per-layer mix in CI, the rest in `make soak`.
MIXED = {"sliding_attention": "hybrid", "full_attention": "all_gather"}
LONG_CASES = {
  "contiguous-ring": ("contiguous", "ring"),
  "load_balanced-ring": ("load_balanced", "ring"),
  "document_balanced-ring": ("document_balanced", "ring"),
  "load_balanced-all_gather": ("load_balanced", "all_gather"),
  "load_balanced-ulysses": ("load_balanced", "ulysses"),
  "contiguous-hybrid_and_all_gather": ("contiguous", MIXED),
}


@pytest.mark.parametrize(
  "layout, strategy",
  [
    pytest.param(*case, id=name, marks=() if case[1] is MIXED else pytest.mark.slow)
    for name, case in LONG_CASES.items()
  ],
)
def test_a_long_video_row_equals_transformers_under_every_layout(long_video, layout, strategy):
  """40 frames (257 soft tokens) in one row of 512 over cp = 4: the frames
  are spread over every rank, each computed once and its soft tokens placed
  by the ranks that hold them; the logits are transformers' within 5x its
  own float32 error, in every layout and CP strategy."""
  kind, path, logits = long_video
  rows = long_video_rows(kind)
  assert (rows["mm_token_type_ids"] == 2).sum() > 128  # more than one rank's share
  model = gemma4.Gemma4.from_pretrained(path)
  batch = gemma4.prepare_batch(rows, model.cfg)
  mesh = parallel.make_mesh(cp=4, devices=jax.devices()[:4])
  got = gemma4.cp_logits(model, batch, mesh, layout=layout, strategy=strategy)
  chex.assert_shape(got, logits[torch.float64].shape)
  assert_within_transformers_error(got, logits, rows["attention_mask"].astype(bool))


# Suite budget: `make soak`; CI trains on video at cp = 4 through the CLI
# (test_video_training.py, whose first step checks CP against one device).
@pytest.mark.slow
def test_the_loss_gradient_of_a_long_video_row_under_cp(long_video):
  """The text loss's gradient on the long row under cp = 4 (load-balanced)
  equals the one-device gradient on every parameter, and every trainable
  tensor of the vision path gets a finite, nonzero one."""
  kind, path, _ = long_video
  model = gemma4.Gemma4.from_pretrained(path)
  rows = long_video_rows(kind)
  ids = rows["input_ids"]
  # Next-token labels on text tokens (soft tokens are out of the vocabulary).
  labels = np.where(np.roll(ids, -1, axis=1) < 256, np.roll(ids, -1, axis=1), -100)
  labels[:, -1] = -100
  batch = gemma4.prepare_batch({**rows, "labels": labels.astype(np.int32)}, model.cfg)
  # (the tower's, or the 12B's embedder)
  prefixes = ("model.vision_tower.", "model.vision_embedder.", "model.embed_vision.")
  assert_cp_gradient_equals_one_device(model, batch, prefixes, least=6)
