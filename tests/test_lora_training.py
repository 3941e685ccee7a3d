"""``cpjax train --lora-rank``: only the adapters train (the base stays
bit-identical), resume is bit-identical (and refuses other LoRA settings),
--merge-lora writes W + scale * (B A) from the very adapter --save writes,
and the flags' errors are usage errors."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy

from cpjax import cli
from cpjax.training import lora
from cpjax.training.run_config import RunConfig, RunError, with_values
from cpjax.training.trainer import train
from tests.helpers import CHECKPOINT_LAYERS

HERE = os.path.dirname(__file__)
BASE = os.path.join(HERE, "fixtures", "gemma4", "ple_kv_sharing")
QUIET = {"log": lambda *_: None}
RUN = with_values(
  RunConfig(),
  {
    "checkpoint": BASE,
    "dataset.seq_len": 64,
    "parallel.cp": 2,
    "optimizer.steps": 4,
    "dataset.batch_size": 2,
    "parity_check": False,
    "lora.rank": 4,
    "lora.alpha": 16.0,
    "optimizer.lr": 1e-2,
  },
)


def test_adapters_train_resume_bit_identically_and_merge_into_the_frozen_base(tmp_path):
  whole = train(
    with_values(
      RUN,
      {
        "checkpointing.save": str(tmp_path / "adapter"),
        "checkpointing.state_dir": str(tmp_path / "a"),
        "checkpointing.save_every": 2,
      },
    ),
    **QUIET,
  )
  first = train(
    with_values(RUN, {"optimizer.steps": 2, "checkpointing.state_dir": str(tmp_path / "b")}),
    **QUIET,
  )
  second = train(
    with_values(
      RUN,
      {
        "checkpointing.state_dir": str(tmp_path / "b"),
        "checkpointing.resume": True,
        "checkpointing.save": str(tmp_path / "merged"),
        "lora.merge": True,
      },
    ),
    **QUIET,
  )
  assert whole["losses"][-1] < whole["losses"][0]
  assert first["losses"] + second["losses"] == whole["losses"]  # bit for bit
  # Another rank's adapters are another run: refused before any array is read.
  with pytest.raises(
    ValueError,
    match=r"the checkpoint trained LoRA rank=4, .* this run trains "
    r"LoRA rank=8",
  ):
    train(
      with_values(
        RUN,
        {
          "lora.rank": 8,
          "checkpointing.state_dir": str(tmp_path / "a"),
          "checkpointing.resume": True,
        },
      ),
      **QUIET,
    )
  with open(tmp_path / "adapter" / "adapter_config.json") as f:
    config = json.load(f)
  assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16.0, BASE)
  factors = safetensors.numpy.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
  base = safetensors.numpy.load_file(os.path.join(BASE, "model.safetensors"))
  merged = safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")
  # (the fixture also holds the k/v weights K/V-sharing layers never use)
  assert set(merged) <= set(base)
  adapted = {
    k[len("base_model.model.") : -len(".lora_A.weight")] + ".weight"
    for k in factors
    if k.endswith("lora_A.weight")
  }
  assert len(adapted) == 38
  for key, m_w in merged.items():
    w = base[key]
    if key in adapted:  # the merge of the resumed run's adapter is the saved adapter's
      m = key[: -len(".weight")]
      a = factors[f"base_model.model.{m}.lora_A.weight"].astype(np.float64)
      b = factors[f"base_model.model.{m}.lora_B.weight"].astype(np.float64)
      np.testing.assert_allclose(m_w, w + 4.0 * (b @ a), rtol=0, atol=1e-6)
      assert np.abs(b).max() > 0  # trained away from zero
    else:  # untargeted weights and buffers are never trained
      np.testing.assert_array_equal(m_w, w, err_msg=key)


def test_bfloat16_base_keeps_float32_adapters(tmp_path):
  lines = []
  train(
    with_values(
      RUN,
      {
        "optimizer.steps": 2,
        "lora.base_dtype": "bfloat16",
        "dtype": "bfloat16",
        "parity_check": True,
        "checkpointing.save": str(tmp_path / "merged"),
        "lora.merge": True,
      },
    ),
    log=lines.append,
  )
  assert any("base frozen in bfloat16" in line for line in lines)
  assert any("parity with the single-device model" in line for line in lines)
  merged = safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")
  q = merged["model.language_model.layers.0.self_attn.q_proj.weight"]
  assert str(q.dtype) == "bfloat16"


def test_targets_that_match_nothing_or_no_projection_are_run_errors():
  with pytest.raises(RunError, match=r"LoRA: LoRA targets 'nothing' match no module"):
    train(with_values(RUN, {"lora.targets": "nothing"}), **QUIET)
  # The clipped vision linears' wrapper holds no weight (its .linear does).
  with pytest.raises(RunError, match=r"cannot carry adapters .*vision_tower"):
    train(with_values(RUN, {"lora.targets": r".*vision_tower.*\.q_proj"}), **QUIET)
  with pytest.raises(RunError, match=r"lora\.alpha, lora\.base_dtype needs lora\.rank"):
    train(with_values(RUN, {"lora.rank": None, "lora.base_dtype": "bfloat16"}), **QUIET)


@pytest.mark.parametrize(
  "args, message",
  [
    (["--lora-alpha", "4"], "--lora-alpha needs --lora-rank"),
    (["--base-dtype", "bfloat16", "--merge-lora"], "--base-dtype, --merge-lora needs --lora-rank"),
    (["--lora-rank", "4", "--merge-lora"], "--merge-lora says what --save writes"),
    (["--lora-rank", "0"], "argument --lora-rank: expected an integer >= 1, got '0'"),
    (
      ["--lora-rank", "4", "--lora-targets", "(q_proj"],
      "--lora-targets '(q_proj' is not a regular expression",
    ),
  ],
)
def test_lora_flag_errors_exit_two(args, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["train", "--seq-len", "64", *args])
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_save_pretrained_refuses_adapters(tmp_path):
  from cpjax.models import gemma4

  model = lora.apply_lora(gemma4.Gemma4.from_pretrained(BASE), lora.LoraConfig(rank=2))
  with pytest.raises(ValueError, match=r"has LoRA adapters .*cpjax\.training\.lora\.merge_lora"):
    model.save_pretrained(tmp_path)


def test_lora_on_an_moe_checkpoint_with_ep_accumulation_and_remat(tmp_path, hf_checkpoint):
  """``cpjax train --lora-rank`` on a 26B-A4B-like checkpoint transformers
  saved, experts split over cp (ep=2) beside fsdp, 2 accumulated
  microbatches, full remat: the step-1 parity check against the
  single-device LoRA step passes inside the run (per-expert adapters
  included: the default adapts the experts), and the saved adapter holds
  trained factors of every expert tensor, in PEFT's layout. (Resume: the
  dense test above, bit for bit, and test_qlora.py's MoE run with ep.)"""
  run = with_values(
    RunConfig(),
    {
      "checkpoint": hf_checkpoint("moe"),
      "dataset.seq_len": 64,
      "parallel.mesh": "fsdp=2,cp=2,ep=2",
      "optimizer.steps": 2,
      "dataset.batch_size": 4,
      "dataset.microbatches": 2,
      "remat": "full",
      "lora.rank": 4,
      "lora.alpha": 16.0,
      "optimizer.lr": 1e-2,
      "checkpointing.save": str(tmp_path / "adapter"),
    },
  )
  summary = train(run, **QUIET)
  assert summary["parity"]["rel_loss"] <= 1e-4 and summary["parity"]["rel_grad_norm"] <= 1e-4
  assert len(summary["losses"]) == 2
  factors = safetensors.numpy.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
  experts = {k: v for k, v in factors.items() if ".experts." in k}
  # Two tensors a layer (gate_up_proj wrapped inside down_proj's wrapper), two factors each.
  layers = len(CHECKPOINT_LAYERS["moe_k_eq_v_vision"]["layer_types"])
  assert len(experts) == layers * 4 and sum(".base_layer." in k for k in experts) == layers * 2
  assert all(np.abs(v).max() > 0 for k, v in experts.items() if "lora_B" in k)
  assert any(np.abs(v).max() > 0 for k, v in factors.items() if "lora_B" in k and k not in experts)
