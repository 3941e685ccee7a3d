"""The README's and the guides' commands, run as written at a small size on
checkpoints transformers saved (a file of its own so that the suite's two
workers share the docs' runs; the pages' snippets: tests/test_docs.py)."""

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT, code_blocks, doc


# As written (the shipped tokenizer), and on a checkpoint transformers saved.
@pytest.mark.parametrize("checkpoint", [None, "dense"])
def test_your_own_data_commands_run_at_a_small_size(
  tmp_path, monkeypatch, capsys, checkpoint, hf_checkpoint
):
  """The two commands of "Your own data", as written but for 4 steps (and no
  parity check, tested elsewhere): the corpus, the validation loss, the
  metrics. Then again fine-tuning a checkpoint transformers saved (its own
  tokenizer and template; ``--checkpoint`` for ``--tokenizer``) and saving
  it: the last validation loss is the single-device loss of the saved
  weights on the same rows."""
  import json
  import shlex
  import struct

  from cpjax import cli
  from cpjax.training.run_config import OptimizerConfig

  commands = code_blocks(doc("guides/own-data.md"), "bash")[0].strip().splitlines()
  assert len(commands) == 2
  monkeypatch.chdir(tmp_path)
  (tmp_path / "cpjax").symlink_to(Path(ROOT) / "cpjax")  # the page's relative paths
  if checkpoint:
    base = hf_checkpoint(checkpoint)
    assert "--checkpoint cpjax/examples/chat" in commands[0]
    assert "--tokenizer cpjax/examples/chat" in commands[1]
    commands = [
      commands[0].replace("--checkpoint cpjax/examples/chat", f"--checkpoint {base}"),
      commands[1].replace("--tokenizer cpjax/examples/chat", f"--checkpoint {base}")
      + " --save saved",
    ]
  prepare, train = (shlex.split(c) for c in commands)
  assert prepare[0] == train[0] == ".venv/bin/cpjax"
  assert cli.main(prepare[1:]) == 0
  assert "400 documents" in capsys.readouterr().out
  small = " ".join(train[1:])
  for big, little in (
    ("--steps 60", "--steps 4"),
    ("--eval-every 20", "--eval-every 2"),
    ("--warmup-steps 5", "--warmup-steps 1"),
  ):
    assert big in small
    small = small.replace(big, little)
  assert cli.main(shlex.split(small) + ["--no-parity-check"]) == 0
  out = capsys.readouterr().out
  if checkpoint:
    _eval_loss_is_the_saved_models(
      tmp_path,
      base,
      json.loads((tmp_path / "chat-metrics.jsonl").read_text().splitlines()[-1])["eval_loss"],
    )
  assert "step 2: validation loss" in out and "step 4: validation loss" in out
  lines = [json.loads(x) for x in (tmp_path / "chat-metrics.jsonl").read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2, 3, 4]
  assert ["eval_loss" in x for x in lines] == [False, True, False, True]
  schedule = OptimizerConfig(lr=3e-3, steps=4, warmup_steps=1, schedule="cosine").lr_schedule()
  np.testing.assert_allclose(
    [x["learning_rate"] for x in lines], [float(schedule(i)) for i in range(4)], rtol=1e-6
  )
  assert all(x["tokens"] <= 2 * 256 and x["target_tokens"] < x["tokens"] for x in lines)
  # The TensorBoard events (TFRecord frames of Event protos) hold the same scalars.
  from tensorboardX.proto import event_pb2

  (events,) = (tmp_path / "chat-tb").iterdir()
  data, at, scalars = events.read_bytes(), 0, {}
  while at < len(data):
    (n,) = struct.unpack("<Q", data[at : at + 8])
    event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
    at += 16 + n
    for value in event.summary.value:
      scalars[(value.tag, event.step)] = value.simple_value
  for x in lines:
    for tag in ("loss", "grad_norm", "learning_rate", "eval_loss"):
      if tag in x:
        np.testing.assert_allclose(scalars[(tag, x["step"])], x[tag], rtol=1e-6)


def _eval_loss_is_the_saved_models(tmp_path, base, eval_loss):
  import jax
  from flax import nnx

  from cpjax import training
  from cpjax.models import gemma4
  from cpjax.training.run_config import RunConfig, with_values
  from cpjax.training.trainer import eval_rows

  saved = gemma4.Gemma4.from_pretrained(tmp_path / "saved")  # one device, as a user loads it
  for name in (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
  ):  # what the checkpoint had besides its weights
    assert (tmp_path / "saved" / name).read_bytes() == (Path(base) / name).read_bytes(), name
  run = with_values(
    RunConfig(),
    {"checkpoint": base, "dataset.seq_len": 256, "eval.data": "cpjax/examples/chat/eval.jsonl"},
  )
  rows = eval_rows(run, saved.cfg, 2, lambda *_: None)
  graphdef, params, rest = nnx.split(saved, nnx.Param, ...)
  single = jax.jit(training.make_loss_fn(graphdef, frozen=rest))
  sums = [single(params, gemma4.prepare_batch(b, saved.cfg)) for b in rows]
  reference = sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)
  np.testing.assert_allclose(eval_loss, reference, rtol=2e-6)


def test_readme_fine_tune_commands_run_at_a_small_size(tmp_path, monkeypatch, hf_checkpoint):
  """The README's three commands for your own data, as written but small: the
  download's options are `hf download`'s own; the corpus is prepared with a
  checkpoint transformers saved (26B-A4B-like), and the recipe trains it with
  its own LoRA settings at a small size (S = 256, cp = 4 with ep = 4, one
  step, no cluster) on a 4-bit base and saves an adapter in PEFT's format
  that adapts the experts too."""
  import json
  import shlex
  import subprocess
  import sys

  from cpjax import cli, recipes
  from cpjax.training.run_file import read_run_config

  download, prepare, train = (
    shlex.split(c)
    for c in code_blocks(doc("README.md", "Fine-tune your own data"), "bash")[0]
    .strip()
    .splitlines()
  )
  base = hf_checkpoint("moe")  # (skips without transformers, and its hf command)
  # 1: hf download REPO --local-dir DIR, DIR the checkpoint the others read.
  assert download[:2] == ["hf", "download"] and download[3] == "--local-dir"
  checkpoint = download[4]
  hf = os.path.join(os.path.dirname(sys.executable), "hf")
  usage = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, check=True)
  assert "--local-dir" in usage.stdout
  monkeypatch.chdir(tmp_path)
  chat = os.path.join(ROOT, "cpjax", "examples", "chat", "train.jsonl")

  def small(args: list[str], changes: dict[str, str]) -> list[str]:
    text = " ".join(args[1:]).replace(f"--checkpoint {checkpoint}", f"--checkpoint {base}")
    for big, little in changes.items():
      assert big in text, big
      text = text.replace(big, little)
    return shlex.split(text)

  assert prepare[0] == train[0] == "cpjax"
  seq_len = read_run_config(recipes.path(train[train.index("--recipe") + 1])).dataset.seq_len
  assert f"--seq-len {seq_len}" in " ".join(prepare)  # rows the recipe trains
  assert (
    cli.main(small(prepare, {"chat.jsonl": chat, f"--seq-len {seq_len}": "--seq-len 256"})) == 0
  )
  # 3: on every host of a slice (--auto-cluster); here one process, small.
  args = small(train, {" --auto-cluster": "", "--state-dir /shared/run": "--state-dir state"})
  args += ["--seq-len", "256", "--mesh", "cp=4,ep=4", "--steps", "1", "--warmup-steps", "0"]
  args += ["--lora.group_size", "8"]  # (the tiny model's widths: 48, 96, ...)
  assert cli.main(args) == 0
  config = json.loads((tmp_path / "my-adapter" / "adapter_config.json").read_text())
  # The recipe's targets: every projection and both expert tensors, per expert.
  assert config["r"] == 16 and config["target_parameters"], config
