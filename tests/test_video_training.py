"""The "Video" command of guides/own-data.md (``cpjax train --checkpoint DIR
--data videos.jsonl --cp 4 ... --lora-rank 16``) on tiny checkpoints that
transformers saved (E2B-like; the 12B-like unified model, whose video
processor merges patches): conversations about video files are
sampled, resized and cut as transformers' video processor does, packed
with their frames and trained on; the saved adapter is one PEFT loads onto
transformers' model, which then gives cpjax's logits on a conversation
with a video."""

import json
import os
import shlex

import numpy as np
import pytest
from flax import nnx

from cpjax.models import gemma4
from tests.helpers import code_blocks, doc, write_audio_checkpoint, write_video

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("av", reason='videos are decoded with PyAV: pip install -e ".[video]"')

ANSWERS = ("it rises", "it falls", "it flickers")


def _videos(directory) -> list[dict]:
  """Six conversations about three short videos (6 frames at 4 fps, each
  moving its own way), one video each."""
  rng = np.random.default_rng(0)
  t = np.arange(6)[:, None, None, None]
  y, x = (a[None, ..., None] for a in np.mgrid[:24, :32])
  looks = {
    "up.mp4": (y * 8 + t * 20) % 256,
    "down.mp4": (255 - y * 8 - t * 20) % 256,
    "flicker.mp4": (t % 2) * 200 + x,
  }
  for name, look in looks.items():
    frames = np.broadcast_to(look, (6, 24, 32, 3)) + rng.integers(0, 8, (6, 24, 32, 3))
    write_video(os.path.join(directory, name), np.clip(frames, 0, 255).astype(np.uint8), fps=4)
  return [
    {
      "messages": [
        {
          "role": "user",
          "content": [{"type": "video", "video": name}, {"type": "text", "text": "what happens"}],
        },
        {"role": "assistant", "content": answer},
      ]
    }
    for name, answer in zip(looks, ANSWERS)
  ] * 2


def _rows(checkpoint: str, record: dict, base_dir: str) -> dict:
  """One row: the conversation as the checkpoint's tokenizer and video
  processor make it (transformers' batch keys)."""
  from cpjax.data.images import pixel_values
  from cpjax.data.records import encode_record
  from cpjax.data.tokenizer import CheckpointTokenizer
  from cpjax.data.video import VideoProcessor

  video = VideoProcessor.from_checkpoint(checkpoint)
  made = encode_record(record, CheckpointTokenizer(checkpoint), video=video, base_dir=base_dir)
  frames = len(made["video_sizes"])
  pixels = np.zeros((frames, video.max_patches, video.patch_features), np.float32)
  positions = np.full((frames, video.max_patches, 2), -1, np.int64)
  for f, (lo, n) in enumerate(
    zip(np.cumsum(made["video_sizes"]) - made["video_sizes"], made["video_sizes"])
  ):
    pixels[f, :n] = pixel_values(made["video_patches"][lo : lo + n])
    positions[f, :n] = made["video_positions"][lo : lo + n]
  ids = made["input_ids"][None].astype(np.int64)
  video_id = CheckpointTokenizer(checkpoint).token_id("<|video|>")
  return {
    "input_ids": ids,
    "attention_mask": np.ones_like(ids),
    "mm_token_type_ids": (ids == video_id).astype(np.int64) * 2,
    "pixel_values_videos": pixels,
    "video_position_ids": positions,
    "num_frames_per_video": np.array([frames]),
  }


MODEL_CLASS = {
  "e2b": "Gemma4ForConditionalGeneration",
  "unified": "Gemma4UnifiedForConditionalGeneration",
}


# Suite budget: the E2B-like run in CI (46 s), the unified one in make soak.
@pytest.mark.parametrize("kind", ["e2b", pytest.param("unified", marks=pytest.mark.slow)])
def test_the_cli_fine_tunes_a_lora_adapter_on_videos_at_cp4(kind, tmp_path, monkeypatch):
  """Two steps at cp = 4 (the step-1 parity check of CP against one device
  included) on six conversations about videos, two frames each; PEFT's
  transformers model with the saved adapter gives cpjax's logits on one of
  them to float32 rounding, and training moved them."""
  from cpjax import cli
  from cpjax.training import lora as cpjax_lora

  base = write_audio_checkpoint(str(tmp_path / "base"), kind, video_frames=2)
  data = tmp_path / "data"
  data.mkdir()
  records = _videos(str(data))
  (data / "videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  monkeypatch.chdir(tmp_path)
  install, command = code_blocks(doc("guides/own-data.md", "Video"), "bash")[0].strip().splitlines()
  assert install == '.venv/bin/pip install -e ".[video]"'
  small = command
  for big, little in (
    ("--checkpoint gemma-4-E2B-it", f"--checkpoint {base}"),
    ("--data videos.jsonl", f"--data {data / 'videos.jsonl'}"),
    ("--seq-len 8192", "--seq-len 512"),
    ("--steps 30", "--steps 2 --lr 1e-2"),
    ("--lora-rank 16", "--lora-rank 4"),
    ("--save video-adapter", "--save out"),
  ):
    assert big in small
    small = small.replace(big, little)
  words = shlex.split(small)
  assert words[:2] == [".venv/bin/cpjax", "train"] and "--cp" in words
  assert cli.main(words[1:]) == 0
  rows = _rows(base, records[0], str(data))
  assert (rows["mm_token_type_ids"] == 2).sum() == 2 * 63  # two frames of 63 soft tokens
  model_class = getattr(transformers, MODEL_CLASS[kind])
  theirs = peft.PeftModel.from_pretrained(model_class.from_pretrained(base), tmp_path / "out")
  ours = cpjax_lora.load_adapter(gemma4.Gemma4.from_pretrained(base), tmp_path / "out")
  with torch.no_grad():
    want = theirs.eval()(**{k: torch.tensor(v) for k, v in rows.items()}).logits.double().numpy()
  forward = nnx.jit(lambda model, batch: model(batch))  # (eagerly: op by op)
  got = np.asarray(forward(ours, gemma4.prepare_batch(rows, ours.cfg)), np.float64)
  assert np.abs(got - want).max() < 1e-3
  plain = gemma4.Gemma4.from_pretrained(base)
  plain = np.asarray(forward(plain, gemma4.prepare_batch(rows, ours.cfg)))
  assert np.abs(got - plain).max() > 1e-2  # trained
  # Without the frames the logits are far from transformers': the video counts.
  dark = dict(rows, pixel_values_videos=np.zeros_like(rows["pixel_values_videos"]))
  assert np.abs(np.asarray(forward(ours, gemma4.prepare_batch(dark, ours.cfg))) - want).max() > 1e-2
