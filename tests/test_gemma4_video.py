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
from tests.helpers import assert_within_transformers_error, transformers_logits

torch = pytest.importorskip("torch", reason="transformers' Gemma 4 needs torch")
transformers = pytest.importorskip("transformers", reason="the reference is transformers'")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gemma4"))
import make_fixtures  # noqa: E402

VIDEO = 258884


def video_rows(kind: str, seed: int = 0) -> dict:
  """Two rows of 64 tokens as Gemma 4's processor lays them out. Row 0: text,
  an image, text, then a 3-frame video (each frame ``<boi>`` + its soft
  tokens + ``<eoi>``, timestamps as text between); row 1, left-padded: a
  2-frame video (a frame longer than the window of 8), then text."""
  rng = np.random.default_rng(seed)
  unified = kind == "unified"
  image_id, boi, eoi = make_fixtures.IMAGE, make_fixtures.BOI, make_fixtures.EOI

  def picture(width, height):
    if not unified:
      return make_fixtures._image(rng, width, height)
    # The unified model: 2-pixel patches, one soft token each (48 features of 4x4 pixels).
    n, cap = width * height, 12
    pos = np.full((cap, 2), -1, np.int64)
    pos[:n] = [(x, y) for y in range(height) for x in range(width)]
    return rng.random((cap, 48), dtype=np.float32) * (pos[:, :1] >= 0), pos, n

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
  assert_within_transformers_error(model(batch), logits, real)
  # fsdp = 2 x cp = 4: each data shard finds its rows' frames by offset.
  mesh = parallel.make_mesh(fsdp=2, cp=4, devices=jax.devices()[:8])
  got = gemma4.cp_logits(model, batch, mesh, layout="load_balanced", batch_axis="fsdp")
  chex.assert_shape(got, logits[torch.float64].shape)
  assert_within_transformers_error(got, logits, real)
  # Without the frames' soft tokens the logits are far from transformers'.
  dark = dict(rows, pixel_values_videos=np.zeros_like(rows["pixel_values_videos"]))
  off = np.asarray(model(gemma4.prepare_batch(dark, model.cfg)))
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
