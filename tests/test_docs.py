"""The README's own-model example runs as written, and trains with CP."""

import re
from pathlib import Path

import numpy as np
import pytest

import cpjax

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title: str) -> str:
  text = README.read_text()
  section = text.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
  return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


def test_own_model_example_runs_and_is_short():
  code = section_code("Your own model")
  assert len(code.strip().splitlines()) < 30
  rng = np.random.default_rng(0)
  docs = np.repeat([[1] * 40 + [2] * 20 + [0] * 4], 2, axis=0).astype(np.int32)
  ids = np.where(docs > 0, rng.integers(1, 1000, docs.shape), 0).astype(np.int32)
  batch = {
    "input_ids": ids,
    "_packed_seq_ids": docs,
    "padding_mask": docs == 0,
    "labels": np.asarray(cpjax.next_token_labels(ids, docs)),
  }
  scope = {"batch": batch}
  exec(compile(code, str(README), "exec"), scope)  # noqa: S102
  metrics = scope["metrics"]
  assert np.isfinite(float(metrics["loss"])) and float(metrics["tokens"]) == 2 * (
    39 + 19
  )  # next-token labels per document


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

  section = README.read_text().split("### Your own data\n", 1)[1].split("\n## ", 1)[0]
  commands = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].strip().splitlines()
  assert len(commands) == 2
  monkeypatch.chdir(tmp_path)
  (tmp_path / "cpjax").symlink_to(README.parent / "cpjax")  # the README's relative paths
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


def test_planning_a_run_from_python_is_the_plan_of_the_run(capsys):
  """The Planning section's snippet prints the closed form's row of the run
  it builds: the same as the shape derived from that run, with its remat."""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan
  from cpjax.training.run_config import RunConfig, with_values

  exec(compile(section_code("Planning a run"), str(README), "exec"), {})  # noqa: S102
  printed = capsys.readouterr().out.strip()
  run = with_values(RunConfig(), {"dataset.seq_len": 4096, "parallel.cp": 2, "remat": "full"})
  want = plan.estimate(Gemma4Config.preset("tiny"), plan.StepShape.of(run), model="tiny")
  assert printed == want.row()
  assert want.remat == "full" and want.mesh == {"cp": 2}
