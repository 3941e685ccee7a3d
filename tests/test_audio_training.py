"""The "Audio" command of guides/own-data.md (``cpjax train --checkpoint DIR
--data cpjax/examples/audio_chat/audio_chat.jsonl --cp 4 ...``) on tiny
checkpoints that transformers saved (an E2B-like model with its audio tower,
the 12B-like unified model): the shipped audio example is tokenized, its
clips made into the checkpoint's features, packed and trained on; the saved
checkpoint is one transformers loads, the saved adapter one PEFT loads, and
either gives cpjax's logits on a conversation with two clips."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from cpjax.models import gemma4
from tests.helpers import AUDIO_EXAMPLE, ROOT, code_blocks, doc, write_audio_checkpoint

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODEL_CLASS = {
  "e2b": "Gemma4ForConditionalGeneration",
  "unified": "Gemma4UnifiedForConditionalGeneration",
}


def _conversation_rows(checkpoint: str) -> dict:
  """One row: the example's first conversation with two clips, as the
  checkpoint's tokenizer and feature extractor make it."""
  from cpjax.data.audio import AudioProcessor
  from cpjax.data.records import encode_record
  from cpjax.data.tokenizer import CheckpointTokenizer

  with open(os.path.join(AUDIO_EXAMPLE, "audio_chat.jsonl")) as f:
    record = next(r for r in map(json.loads, f) if len(r.get("messages", ())) == 4)
  doc = encode_record(
    record,
    CheckpointTokenizer(checkpoint),
    audio=AudioProcessor.from_checkpoint(checkpoint),
    base_dir=AUDIO_EXAMPLE,
  )
  sizes = doc["audio_sizes"]
  features = np.zeros((len(sizes), sizes.max(), doc["audio_features"].shape[1]), np.float32)
  real = np.zeros(features.shape[:2], bool)
  for i, (lo, n) in enumerate(zip(np.cumsum(sizes) - sizes, sizes)):
    features[i, :n] = doc["audio_features"][lo : lo + n]
    real[i, :n] = doc["audio_mask"][lo : lo + n] > 0
  ids = doc["input_ids"][None]
  return {
    "input_ids": ids,
    "attention_mask": np.ones_like(ids),
    "input_features": features,
    "input_features_mask": real,
  }


@pytest.mark.parametrize(
  "kind, lora",
  [
    # Suite budget: the unified model's adapter in CI (20 s); the E2B-like
    # runs (73 s with the tower) and the full fine-tunes in make soak. CI
    # checks the E2B-like log-mel records against transformers' processor
    # (test_audio_records), its CP logits and tower gradients
    # (test_gemma4_audio), and transformers loading both models' saves.
    pytest.param("e2b", True, marks=pytest.mark.slow),
    ("unified", True),
    pytest.param("e2b", False, marks=pytest.mark.slow),
    pytest.param("unified", False, marks=pytest.mark.slow),
  ],
)
def test_the_cli_fine_tunes_on_the_audio_example_at_cp4(kind, lora, tmp_path, monkeypatch):
  """Two steps at cp = 4 (the step-1 parity check of CP against one device
  included); the saved model or adapter is what transformers / PEFT load,
  their logits on a conversation with two clips are cpjax's to float32
  rounding, and training moved them (the audio path's weights among them)."""
  import shlex
  from pathlib import Path

  from cpjax import cli
  from cpjax.training import lora as cpjax_lora

  base = write_audio_checkpoint(str(tmp_path / "base"), kind)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "cpjax").symlink_to(Path(ROOT) / "cpjax")  # the page's relative paths
  download, command = (
    code_blocks(doc("guides/own-data.md", "Audio"), "bash")[0].strip().splitlines()
  )
  assert download.endswith("--local-dir gemma-4-E2B-it")
  small = command
  for big, little in (
    ("--checkpoint gemma-4-E2B-it", f"--checkpoint {base}"),
    ("--seq-len 1024", "--seq-len 128"),
    ("--steps 30", "--steps 2 --lr 1e-2"),
    ("--lora-rank 16", "--lora-rank 4" if lora else ""),
    ("--save audio-adapter", "--save out"),
  ):
    assert big in small
    small = small.replace(big, little)
  words = shlex.split(small)
  assert words[:2] == [".venv/bin/cpjax", "train"] and "--cp" in words
  assert cli.main(words[1:]) == 0
  rows = _conversation_rows(base)
  model_class = getattr(transformers, MODEL_CLASS[kind])
  if lora:
    peft = pytest.importorskip("peft")
    theirs = peft.PeftModel.from_pretrained(model_class.from_pretrained(base), tmp_path / "out")
    ours = cpjax_lora.load_adapter(gemma4.Gemma4.from_pretrained(base), tmp_path / "out")
  else:
    theirs = model_class.from_pretrained(tmp_path / "out")
    ours = gemma4.Gemma4.from_pretrained(tmp_path / "out")
  with torch.no_grad():
    want = theirs.eval()(**{k: torch.tensor(v) for k, v in rows.items()}).logits.double().numpy()
  forward = nnx.jit(lambda model, batch: model(batch))  # (eagerly: op by op)
  got = np.asarray(forward(ours, gemma4.prepare_batch(rows, ours.cfg)), np.float64)
  assert np.abs(got - want).max() < 1e-3
  plain = gemma4.Gemma4.from_pretrained(base)
  plain = np.asarray(forward(plain, gemma4.prepare_batch(rows, ours.cfg)))
  assert np.abs(got - plain).max() > 1e-2  # trained
  if not lora:  # the clips' gradients reached the audio path's weights
    from safetensors.numpy import load_file

    def audio_path(directory):
      (file,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
      weights = load_file(os.path.join(directory, file))
      # (the clipped linears' bounds are buffers, not trained)
      return {k: v for k, v in weights.items() if "audio" in k and not k.endswith(("_min", "_max"))}

    before, after = audio_path(base), audio_path(tmp_path / "out")
    assert before.keys() == after.keys() and before
    still = [k for k in before if np.array_equal(before[k], after[k])]
    assert not still, still
