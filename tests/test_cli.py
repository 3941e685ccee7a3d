"""The command line: flags, errors, and the main job end to end."""

import subprocess
import sys

import numpy as np
import pytest

from cpjax import cli
from cpjax.train_job import TrainJob, run_train_job


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "cpjax", *args], capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["train", "--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
    (["train", "--layout", "zigzag"], "argument --layout: invalid choice: 'zigzag'"),
    (["train", "--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["train", "--steps", "two"], "argument --steps: expected an integer >= 1, got 'two'"),
    (["train", "--seq-len", "16"], "--seq-len must be >= 32, got 16"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_one_line_exit_two(args, message, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main(args)
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert message in err
  assert len(err.strip().splitlines()) == 1, err


def test_help_documents_every_flag():
  text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
  for flag in ("--seq-len", "--cp", "--layout", "--steps", "--seed", "--dtype"):
    assert flag in text


def test_train_job_in_process():
  """Two steps on 4 devices: the parity check passes and the loss is finite."""
  summary = run_train_job(TrainJob(seq_len=96, cp=4, steps=3, layout="contiguous"),
                          log=lambda *_: None)
  assert summary["parity"]["rel_loss"] <= 1e-4
  assert np.isfinite(summary["loss_last"]) and summary["tokens_per_s"] > 0


def test_console_entry_point_runs_the_job():
  proc = _run("train", "--seq-len", "64", "--steps", "2", "--cp", "2", "--dtype", "bfloat16")
  assert proc.returncode == 0, proc.stderr
  assert "parity with the single-device model at step 1" in proc.stdout + proc.stderr
  assert "loss " in proc.stdout and "->" in proc.stdout
