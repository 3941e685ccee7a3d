"""Resumable training: bit-identical resume, run mismatch errors, and a
process killed in the middle of a save."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from cpjax.training.checkpointing import TrainCheckpointer, check_run_matches
from cpjax.training.run_config import RunConfig, with_values
from cpjax.training.trainer import train

CORPUS = os.path.join(os.path.dirname(__file__), "data", "tiny_corpus.array_record")
QUIET = {"log": lambda *_: None}
MODEL = "tiny-bidirectional"  # the smallest real-architecture preset: quick to compile


# Synthetic rows in `make soak`: the corpus case makes the same assertions on
# the same resume, and test_resume_onto_another_mesh_gives_the_same_next_loss
# restores the synthetic generator's position.
@pytest.mark.parametrize(
  "data", [pytest.param(None, marks=pytest.mark.slow), CORPUS], ids=["synthetic", "corpus"]
)
def test_resume_continues_with_bit_identical_losses(tmp_path, data):
  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 64,
      "parallel.cp": 2,
      "optimizer.steps": 6,
      "dataset.batch_size": 2,
      "parity_check": False,
      "dataset.path": data,
      "model": MODEL,
    },
  )
  whole = train(
    with_values(
      run, {"checkpointing.state_dir": str(tmp_path / "a"), "checkpointing.save_every": 3}
    ),
    **QUIET,
  )
  first = train(
    with_values(run, {"optimizer.steps": 3, "checkpointing.state_dir": str(tmp_path / "b")}),
    **QUIET,
  )
  second = train(
    with_values(
      run, {"checkpointing.state_dir": str(tmp_path / "b"), "checkpointing.resume": True}
    ),
    **QUIET,
  )
  assert second["first_step"] == 3
  assert first["losses"] == whole["losses"][:3]
  assert second["losses"] == whole["losses"][3:]  # bit for bit: floats compared exactly


def test_resume_onto_another_mesh_gives_the_same_next_loss(tmp_path):
  """Saved on (fsdp 4, cp 2), restored on (fsdp 2, cp 4): orbax reshards the
  parameters and Adam's moments onto the new mesh, and step 2's loss is the
  uninterrupted run's (to float32 reduction order: the meshes sum differently)."""
  import shutil

  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 64,
      "optimizer.steps": 2,
      "dataset.batch_size": 4,
      "parity_check": False,
      "model": MODEL,
      "parallel.mesh": "fsdp=4,cp=2",
      "checkpointing.state_dir": str(tmp_path),
      "checkpointing.save_every": 1,
    },
  )
  whole = train(run, **QUIET)
  shutil.rmtree(tmp_path / "2")  # as if the run had died after step 1
  resumed = train(
    with_values(run, {"parallel.mesh": "fsdp=2,cp=4", "checkpointing.resume": True}), **QUIET
  )
  assert resumed["first_step"] == 1
  np.testing.assert_allclose(resumed["losses"], whole["losses"][1:], rtol=1e-6)


def test_resume_refuses_a_changed_run(tmp_path):
  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 64,
      "parallel.cp": 2,
      "optimizer.steps": 2,
      "dataset.batch_size": 2,
      "parity_check": False,
      "checkpointing.state_dir": str(tmp_path),
      "model": MODEL,
    },
  )
  train(run, **QUIET)
  with pytest.raises(ValueError, match=r"saved with seq_len=64, this run has seq_len=96"):
    train(
      with_values(run, {"dataset.seq_len": 96, "optimizer.steps": 4, "checkpointing.resume": True}),
      **QUIET,
    )
  with pytest.raises(ValueError, match=r"saved with batch_size=2, this run has batch_size=4"):
    train(
      with_values(
        run, {"dataset.batch_size": 4, "optimizer.steps": 4, "checkpointing.resume": True}
      ),
      **QUIET,
    )
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    train(run, **QUIET)
  # --force-resume takes the changed length and goes on from step 2.
  forced = train(
    with_values(
      run,
      {
        "dataset.seq_len": 96,
        "optimizer.steps": 3,
        "checkpointing.resume": True,
        "checkpointing.force_resume": True,
      },
    ),
    **QUIET,
  )
  assert forced["first_step"] == 2 and len(forced["losses"]) == 1
  with pytest.raises(ValueError, match="different model config"):
    check_run_matches({"model_config": {"a": 1}}, {"model_config": {"a": 2}}, force=True)


CHILD = textwrap.dedent("""
    import sys, time, numpy as np
    from cpjax.training.checkpointing import TrainCheckpointer
    ckpt = TrainCheckpointer(sys.argv[1])
    small = {"w": np.arange(4, dtype=np.float32)}
    ckpt.maybe_save(1, params=small, opt_state=(), data_state={"at": 1}, run={}, force=True)
    ckpt.wait()
    big = {"w": np.random.default_rng(0).standard_normal(128 << 20, dtype=np.float32)}
    ckpt.maybe_save(2, params=big, opt_state=(), data_state={"at": 2}, run={}, force=True)
    print("saving 2", flush=True)
    time.sleep(600)
""")


def _step_dirs(root, step):
  """(committed dir exists, [orbax temporary dirs of this step])."""
  return (root / str(step)).exists(), sorted(root.glob(f"{step}.orbax-checkpoint-tmp*"))


def _bytes(path):
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_process_killed_while_saving_leaves_the_last_checkpoint_intact(tmp_path):
  proc = subprocess.Popen(
    [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
  )
  try:
    assert proc.stdout.readline().strip() == "saving 2"
    # The save of step 2 is under way: its temporary directory exists (orbax may
    # create it a moment after save() returns) and it has not been committed.
    deadline = time.monotonic() + 30
    while not _step_dirs(tmp_path, 2)[1] and time.monotonic() < deadline:
      time.sleep(0.01)
    committed, tmp = _step_dirs(tmp_path, 2)
    assert tmp and not committed, sorted(p.name for p in tmp_path.iterdir())
    os.kill(proc.pid, signal.SIGKILL)  # 512 MB still being written
  finally:
    proc.wait(timeout=60)
  # Died mid-save: step 2's temporary directory is left behind, never renamed,
  # holding a fraction of the 512 MB and no commit marker (checked before
  # TrainCheckpointer opens the directory, which may clean temporary dirs up).
  committed, tmp = _step_dirs(tmp_path, 2)
  assert not committed and len(tmp) == 1, sorted(p.name for p in tmp_path.iterdir())
  assert _bytes(tmp[0]) < (512 << 20) // 2, _bytes(tmp[0])
  assert not list(tmp[0].rglob("commit_success.txt"))
  ckpt = TrainCheckpointer(tmp_path)
  assert ckpt.latest_step() == 1
  step, state = ckpt.restore(params_like={"w": np.zeros(4, np.float32)}, opt_state_like=())
  assert step == 1 and state["data_state"] == {"at": 1}
  np.testing.assert_array_equal(state["params"]["w"], np.arange(4, dtype=np.float32))


@pytest.mark.parametrize(
  "change,message,forced",
  [
    ({"dataset.seq_len": 128}, "saved with seq_len=64, this run has seq_len=128", False),
    ({"dataset.batch_size": 4}, "saved with batch_size=2, this run has batch_size=4", False),
    ({"dataset.microbatches": 2}, "saved with microbatches=1, this run has microbatches=2", False),
    ({"model": "tiny-moe"}, "saved by a different model config", True),
    ({"lora.rank": 8}, "trained LoRA rank=4, .* this run trains LoRA rank=8", True),
    ({"lora.alpha": 4.0}, "alpha=16.0, .* this run trains .*alpha=4.0", True),
    ({"lora.targets": "q_proj"}, "this run trains .*targets=q_proj", True),
    ({"lora.base_dtype": "bfloat16"}, "base_dtype=float32, this run .*base_dtype=bfloat16", True),
    ({"lora.rank": None}, "trained LoRA rank=4.* this run trains every weight", True),
  ],
)
def test_every_setting_resume_compares_refuses_a_change(change, message, forced):
  """Each setting of the run's identity, changed on resume, is refused with
  a message naming it; --force-resume lets the shape settings through (the
  data stream continues with them) but never another model or another
  trained set of parameters."""
  from cpjax.models import gemma4
  from cpjax.training.trainer import run_identity

  saved_run = with_values(
    RunConfig(model="tiny"),
    {"dataset.seq_len": 64, "dataset.batch_size": 2, "lora.rank": 4, "lora.alpha": 16.0},
  )
  now = with_values(saved_run, change)
  identity = lambda run: run_identity(run, gemma4.Gemma4Config.preset(run.model))
  check_run_matches(identity(saved_run), identity(saved_run))
  with pytest.raises(ValueError, match=message):
    check_run_matches(identity(saved_run), identity(now))
  if forced:
    with pytest.raises(ValueError, match=message):
      check_run_matches(identity(saved_run), identity(now), force=True)
  else:
    check_run_matches(identity(saved_run), identity(now), force=True)
