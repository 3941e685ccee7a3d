"""Conversations with video files -> documents -> packed rows: the frames,
timestamps, tokens and pixels of transformers' Gemma 4 processor (its
sampling, torchvision's resize, ``mm:ss`` before each frame); the frames ride
with their documents through packing; ``prepare-data`` counts them; bad
videos are reported by line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpjax.data import corpus
from cpjax.data.images import ImageProcessor, pixel_values
from cpjax.data.records import BadRecord, encode_record, prepare_data
from cpjax.data.resample import resize_frames
from cpjax.data.tokenizer import CheckpointTokenizer
from cpjax.data.video import VideoProcessor, read_video
from tests.helpers import ROOT, TORCHVISION, write_video

pytest.importorskip("av", reason='videos are decoded with PyAV: pip install -e ".[video]"')

VIDEO_ID_TEXT = "<|video|>"


def _frames(rng, count: int, height: int, width: int) -> np.ndarray:
  """Moving gradients with a little noise: what a codec keeps close."""
  t = np.arange(count)[:, None, None]
  y, x = np.mgrid[:height, :width]
  base = np.stack([(x * 3 + t * 5) % 256, (y * 4 + t * 3) % 256, (x + y + t * 7) % 256], -1)
  return np.clip(base + rng.integers(-8, 9, base.shape), 0, 255).astype(np.uint8)


def _checkpoint(directory: str, num_frames: int, unified: bool = False) -> str:
  """A Gemma-style tokenizer with Gemma 4's image and video markers, and a
  processor config with Gemma 4's image and video processors (the 12B
  unified model's with ``unified``)."""
  kind = "Gemma4Unified" if unified else "Gemma4"
  from tests.data.make_chat_example import MARKERS, SPECIAL_TOKENS, gemma_style_tokenizer

  gemma_style_tokenizer(
    directory,
    ["what happens here", "it moves", "and in these", "a long one"] * 5,
    vocab_size=400,
    config=MARKERS,
    special_tokens=(*SPECIAL_TOKENS, VIDEO_ID_TEXT),
  )
  with open(os.path.join(directory, "processor_config.json"), "w") as f:
    json.dump(
      {
        "image_processor": {
          "image_processor_type": f"{kind}ImageProcessor",
          "patch_size": 16,
          "max_soft_tokens": 70,
          "pooling_kernel_size": 3,
        },
        "video_processor": {
          "video_processor_type": f"{kind}VideoProcessor",
          "patch_size": 16,
          "max_soft_tokens": 70,
          "pooling_kernel_size": 3,
          "num_frames": num_frames,
          "do_sample_frames": True,
        },
      },
      f,
    )
  return directory


@pytest.fixture(scope="module", params=["gemma4", "unified"])
def checkpoint(request, tmp_path_factory):
  """The processors' defaults (32 frames a video; E2B's, or the 12B's, whose
  patches merge) and three videos: one to enlarge (40 frames at 10 fps),
  one to shrink (360 x 640, 70 frames at 25 fps), one past a minute (1,550
  frames at 24 fps), and a picture."""
  from PIL import Image

  unified = request.param == "unified"
  d = _checkpoint(str(tmp_path_factory.mktemp(request.param)), num_frames=32, unified=unified)
  rng = np.random.default_rng(0)
  write_video(os.path.join(d, "walk.mp4"), _frames(rng, 40, 96, 128), fps=10)
  write_video(os.path.join(d, "wide.mp4"), _frames(rng, 70, 360, 640), fps=25)
  write_video(os.path.join(d, "long.mp4"), _frames(rng, 1550, 32, 48), fps=24)
  Image.fromarray(_frames(rng, 1, 60, 80)[0]).save(os.path.join(d, "still.png"))
  return d


CONVERSATION = [
  {
    "role": "user",
    "content": [
      {"type": "video", "video": "walk.mp4"},
      {"type": "text", "text": "what happens here"},
    ],
  },
  {"role": "assistant", "content": "it moves"},
  {
    "role": "user",
    "content": [
      {"type": "image", "image": "still.png"},
      {"type": "text", "text": "and in these"},
      {"type": "video", "path": "wide.mp4"},
      {"type": "video", "video": "long.mp4"},
    ],
  },
  {"role": "assistant", "content": "a long one"},
]


def test_frames_resize_as_torch_does():
  """torchvision resizes uint8 frames on a CPU with torch's antialiased
  bicubic (``interpolate(..., mode="bicubic", antialias=True)`` on uint8):
  equal bit for bit, enlarging and shrinking, one axis or both."""
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  for h, w, th, tw in [
    (96, 128, 336, 432),
    (360, 640, 288, 528),
    (17, 400, 48, 240),
    (64, 64, 64, 48),
  ]:
    frames = _frames(rng, 2, h, w)
    frames[1] = rng.integers(0, 256, frames[1].shape)  # noise: every weight's rounding shows
    theirs = torch.nn.functional.interpolate(
      torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(),
      size=[th, tw],
      mode="bicubic",
      align_corners=False,
      antialias=True,
    )
    np.testing.assert_array_equal(resize_frames(frames, th, tw), theirs.permute(0, 2, 3, 1).numpy())
  # PIL's bicubic, the image processor's, rounds otherwise: not the video's.
  from PIL import Image

  pil = np.asarray(Image.fromarray(frames[1]).resize((48, 64), Image.Resampling.BICUBIC))
  assert (pil != resize_frames(frames[1:], 64, 48)[0]).any()


def _reference(checkpoint: str, tmp_path, text: str, unified: bool) -> dict:
  if not os.path.isdir(TORCHVISION):
    pytest.skip(
      f"needs torchvision for transformers' video processor: pip install --no-deps "
      f"--target {TORCHVISION} torchvision==0.28.0 (.ci/run does)"
    )
  pytest.importorskip("transformers")
  spec = tmp_path / "spec.json"
  spec.write_text(
    json.dumps(
      {
        "text": text,
        "images": [os.path.join(checkpoint, "still.png")],
        "videos": [os.path.join(checkpoint, f) for f in ("walk.mp4", "wide.mp4", "long.mp4")],
        "image_processor": {"max_soft_tokens": 70},
        "video_processor": {"num_frames": 32, "max_soft_tokens": 70},
        "unified": unified,
      }
    )
  )
  out = tmp_path / "theirs.npz"
  subprocess.run(
    [sys.executable, "-m", "tests.video_reference", TORCHVISION, checkpoint, str(spec), str(out)],
    cwd=ROOT,
    check=True,
  )
  with np.load(out) as arrays:
    return dict(arrays)


def test_conversation_with_videos_equals_gemma4_processor(checkpoint, tmp_path):
  """Three videos and a picture in two turns: each video's sampled frames,
  their timestamps (``mm:ss`` past a minute), the token ids (every frame
  ``mm:ss <boi>`` + its soft tokens + ``<eoi>``), ``mm_token_type_ids`` (1
  image, 2 video), each frame's pixels and patch positions are transformers'
  processor's, bit for bit; the loss counts the answers, never a video token."""
  tok = CheckpointTokenizer(checkpoint)
  video, images = (
    VideoProcessor.from_checkpoint(checkpoint),
    ImageProcessor.from_checkpoint(checkpoint),
  )
  unified = video.unified
  assert video == VideoProcessor(num_frames=32, unified=unified) and images.unified == unified
  doc = encode_record(
    {"messages": CONVERSATION}, tok, images=images, video=video, base_dir=checkpoint
  )
  theirs = _reference(checkpoint, tmp_path, tok.render(CONVERSATION), unified)
  ids = doc["input_ids"]
  np.testing.assert_array_equal(ids, theirs["input_ids"][0])
  image_id, video_id = tok.token_id("<|image|>"), tok.token_id(VIDEO_ID_TEXT)
  np.testing.assert_array_equal(
    np.select([ids == image_id, ids == video_id], [1, 2], 0), theirs["mm_token_type_ids"][0]
  )
  times = np.concatenate(
    [read_video(os.path.join(checkpoint, f), 32)[1] for f in ("walk.mp4", "wide.mp4", "long.mp4")]
  )
  np.testing.assert_array_equal(times, theirs["timestamps"])
  assert times.max() > 60 and "01:02 <|image>" in tok.backend.decode(
    ids.tolist(), skip_special_tokens=False
  )
  # The picture's pixels and positions (the 12B's: merged, rescaled in float32).
  n = doc["image_sizes"][0]
  np.testing.assert_array_equal(images.pixels(doc["image_patches"]), theirs["pixel_values"][0][:n])
  np.testing.assert_array_equal(doc["image_positions"], theirs["image_position_ids"][0][:n])
  # Every frame's pixels and positions, padded to the processor's 630 patches
  # (70 merged ones on the 12B: each 3 x 3 of them one, 48 pixels across).
  sizes, per_token = doc["video_sizes"], video.frame_processor.patches_per_token
  np.testing.assert_array_equal(theirs["num_frames_per_video"], [32, 32, 32])
  assert theirs["pixel_values_videos"].shape[1:] == ((70, 6912) if unified else (630, 768))
  assert len(sizes) == 96 and set(sizes[:32] * 9 // per_token) == {567}
  assert set(sizes[32:64] * 9 // per_token) == {594}
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for f, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
    np.testing.assert_array_equal(
      pixel_values(doc["video_patches"][lo:hi]), theirs["pixel_values_videos"][f][: hi - lo]
    )
    np.testing.assert_array_equal(
      doc["video_positions"][lo:hi], theirs["video_position_ids"][f][: hi - lo]
    )
    assert (theirs["video_position_ids"][f][hi - lo :] == -1).all()
  answer = doc["loss_mask"].astype(bool)
  assert not answer[ids == video_id].any() and answer.sum() > 0
  expected = tok.encode_chat(CONVERSATION[:2], videos=[(63, [0.0] * 32)])[1]
  assert answer[: len(expected)][expected].all()


def test_videos_ride_with_their_documents_through_packing(tmp_path):
  """prepare-data counts the videos and their tokens; packed rows hold each
  document's frames in its video slots, in order; the row's video tokens
  are its frames' soft tokens; unused slots are frames without patches."""
  d = _checkpoint(str(tmp_path / "ckpt"), num_frames=3)
  rng = np.random.default_rng(2)
  data = tmp_path / "data"
  data.mkdir()
  sizes = {}
  for i, (h, w) in enumerate([(32, 48), (48, 32), (40, 40), (24, 64)]):
    write_video(str(data / f"v{i}.mp4"), _frames(rng, 3 + i, h, w), fps=5)
    sizes[f"v{i}.mp4"] = VideoProcessor(num_frames=3).frame_processor.target_size(h, w)
  records = [{"text": "it moves and it moves"}]
  for i in range(4):
    parts = [{"type": "video", "video": f"v{i}.mp4"}, {"type": "text", "text": "what happens here"}]
    answer: str | list = "it moves"
    if i == 3:  # two videos in one document, one of them in the answer
      answer = [{"type": "text", "text": "it moves"}, {"type": "video", "video": "v0.mp4"}]
    records.append(
      {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
    )
  source = data / "videos.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in records))
  summary = prepare_data(source, tmp_path / "corpus", checkpoint=d, progress=False)
  per_frame = {name: (h // 16) * (w // 16) // 9 for name, (h, w) in sizes.items()}
  assert (summary.videos, summary.max_videos_per_document) == (5, 2)
  assert summary.video_tokens == 3 * (sum(per_frame.values()) + per_frame["v0.mp4"])
  assert "5 videos" in summary.lines()[0]
  info = corpus.corpus_video(tmp_path / "corpus")
  assert info["num_frames"] == 3 and info["video_token_id"] == CheckpointTokenizer(d).token_id(
    VIDEO_ID_TEXT
  )
  rows = list(
    corpus.packed_rows(
      tmp_path / "corpus",
      seq_len=2048,
      shuffle=False,
      num_epochs=1,
      process_index=0,
      process_count=1,
      videos_per_row=3,
    )
  )
  seen = 0
  for row in rows:
    video = row["input_ids"] == info["video_token_id"]
    np.testing.assert_array_equal(row["mm_token_type_ids"], video.astype(np.int32) * 2)
    positions = row["video_position_ids"]
    assert row["pixel_values_videos"].shape == (9, 630, 768) and positions.shape == (9, 630, 2)
    np.testing.assert_array_equal(row["num_frames_per_video"], [3, 3, 3])
    real = (positions[..., 0] >= 0).sum(-1)  # patches a frame
    assert video.sum() == (real // 9).sum()
    seen += int((real > 0).sum())
    # Video tokens are never targets, not even in an answer; the answers' text is.
    assert not (row["labels"] == info["video_token_id"]).any() and (row["labels"] >= 0).any()
    # A frame's pixels are zero exactly where its patches are padding.
    assert not row["pixel_values_videos"][positions[..., 0] < 0].any()
  assert seen == 15  # every sampled frame, once
  batch = next(
    iter(
      corpus.packed_batches(
        tmp_path / "corpus",
        batch_size=2,
        seq_len=2048,
        shuffle=False,
        process_index=0,
        process_count=1,
        videos_per_row=3,
      )
    )
  )
  assert batch["pixel_values_videos"].shape == (18, 630, 768)
  np.testing.assert_array_equal(batch["num_frames_per_video"], [3] * 6)
  with pytest.raises(ValueError, match=r"videos_per_row must be an int >= 2 \(the most videos"):
    corpus.packed_rows(
      tmp_path / "corpus", seq_len=2048, videos_per_row=1, process_index=0, process_count=1
    )


def test_bad_videos_are_dropped_and_named(tmp_path):
  d = _checkpoint(str(tmp_path / "ckpt"), num_frames=4)
  rng = np.random.default_rng(3)
  write_video(str(tmp_path / "short.mp4"), _frames(rng, 3, 32, 32), fps=5)
  write_video(str(tmp_path / "ok.mp4"), _frames(rng, 8, 32, 32), fps=5)
  (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 10)

  def chat(part):
    return {
      "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": "what happens here"}]},
        {"role": "assistant", "content": "it moves"},
      ]
    }

  lines = [
    chat({"type": "video", "video": "ok.mp4"}),
    {
      "messages": [  # two videos: past the row
        {"role": "user", "content": [{"type": "video", "video": "ok.mp4"}] * 2},
        {"role": "assistant", "content": "it moves"},
      ]
    },
    chat({"type": "video", "video": "short.mp4"}),
    chat({"type": "video", "video": "gone.mp4"}),
    chat({"type": "video", "video": "junk.mp4"}),
    chat({"type": "video", "video": "https://example.com/clip.mp4"}),
    chat({"type": "video"}),
  ]
  source = tmp_path / "bad.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in lines))
  summary = prepare_data(source, tmp_path / "out", checkpoint=d, seq_len=400, progress=False)
  reasons = dict(summary.dropped)
  assert summary.documents == 1 and 1 not in reasons and summary.videos == 1
  assert "607 tokens with videos, longer than the row of 400 (never truncated" in reasons[2]
  assert "has 3 frames, fewer than the 4 the video processor samples" in reasons[3]
  assert reasons[4].endswith(f"video {tmp_path / 'gone.mp4'} does not exist")
  assert reasons[5].startswith(f"video {tmp_path / 'junk.mp4'} cannot be read: InvalidDataError")
  assert "is remote; video is read from files" in reasons[6]
  assert "a video part names its file under one of ['video', 'path', 'url']" in reasons[7]
  # A checkpoint without a video processor: the record says so.
  os.remove(os.path.join(d, "processor_config.json"))
  with pytest.raises(BadRecord, match=r"1 video\(s\), but the checkpoint has no video processor"):
    encode_record(lines[0], CheckpointTokenizer(d), base_dir=str(tmp_path))


@pytest.mark.parametrize(
  "entry, match",
  [
    ({"fps": 2}, r"video processor's fps is 2; cpjax samples and resizes frames with fps = None"),
    ({"do_sample_frames": False}, "do_sample_frames is False"),
    ({"image_mean": [0.5, 0.5, 0.5]}, "image_mean is"),
    ({"video_processor_type": "Qwen2VLVideoProcessor"}, "is not one cpjax computes"),
    ({"max_soft_tokens": 100}, r"max_soft_tokens must be one of \(70, 140"),
  ],
)
def test_video_processor_settings_cpjax_does_not_compute_are_refused(tmp_path, entry, match):
  with open(tmp_path / "processor_config.json", "w") as f:
    json.dump({"video_processor": entry}, f)
  with pytest.raises(ValueError, match=match):
    VideoProcessor.from_checkpoint(tmp_path)


def test_image_processors_cpjax_does_not_compute_are_refused(tmp_path):
  with open(tmp_path / "processor_config.json", "w") as f:
    json.dump({"image_processor": {"image_processor_type": "SiglipImageProcessor"}}, f)
  with pytest.raises(ValueError, match="image_processor_type 'SiglipImageProcessor' is not one"):
    ImageProcessor.from_checkpoint(tmp_path)
