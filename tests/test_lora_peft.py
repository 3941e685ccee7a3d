"""Live: PEFT loads the adapters cpjax saves, cpjax loads the adapters PEFT
saves, and a merged cpjax checkpoint is what transformers loads; the logits
agree with transformers + PEFT as closely as transformers' own float32 run
agrees with its float64 run. Runs when torch, transformers and peft are
importable (CI installs them)."""

import os
import sys

import numpy as np
import pytest
import safetensors.numpy

from cpjax.models import gemma4
from cpjax.training import lora
from tests.helpers import code_blocks, compiled, doc
from tests.test_gemma4 import FIXTURES
from tests.test_lora import randomize_adapters

torch = pytest.importorskip("torch", reason="the live PEFT test needs torch")
transformers = pytest.importorskip("transformers", reason="the live PEFT test needs transformers")
peft = pytest.importorskip("peft", reason="the live PEFT test needs peft")

NAME = "ple_kv_sharing"
BASE = os.path.join(FIXTURES, NAME)


def fixtures_module():
  sys.path.insert(0, os.path.join(FIXTURES))
  import make_fixtures

  return make_fixtures


def hf_model(dtype, adapter=None):
  model = transformers.Gemma4ForConditionalGeneration.from_pretrained(BASE, dtype=dtype).eval()
  return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def assert_as_close_as_transformers(got, hf_float32, hf_float64, inputs):
  """cpjax's error against transformers' float64 logits is a small multiple
  of transformers' own float32 error (real tokens only).

  Measured over four adapter seeds: mean ratio 0.98-1.08, max ratio
  0.57-1.68 (the largest of 21760 rounding errors swings from seed to
  seed); a wrong adapter, scale or target moves the logits by over 0.1,
  a thousand times these errors."""
  real = inputs["attention_mask"].astype(bool)
  ours, theirs = np.abs(got - hf_float64)[real], np.abs(hf_float32 - hf_float64)[real]
  assert ours.max() <= 2.0 * theirs.max() and ours.mean() <= 1.3 * theirs.mean(), (
    ours.max(),
    theirs.max(),
    ours.mean(),
    theirs.mean(),
  )


def hf_logits(adapter, inputs):
  mf = fixtures_module()
  return {
    dtype: mf.hf_logits(hf_model(dtype, adapter), inputs, dtype)
    for dtype in (torch.float64, torch.float32)
  }


def test_peft_loads_what_cpjax_saves_and_merging_equals_it(tmp_path):
  inputs = fixtures_module().batch("images", 7)
  base = gemma4.Gemma4.from_pretrained(BASE)
  model = lora.apply_lora(base, lora.LoraConfig(rank=4, alpha=16.0))
  randomize_adapters(model, seed=3, scale=0.1)
  files = lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=BASE)
  assert [os.path.basename(f) for f in files] == [
    "adapter_config.json",
    "adapter_model.safetensors",
  ]
  batch = gemma4.prepare_batch(inputs, model.cfg)
  got = np.asarray(compiled(model)(batch))
  theirs = hf_logits(str(tmp_path / "adapter"), inputs)
  # The adapters change the logits well beyond float32 noise.
  assert np.abs(theirs[torch.float64] - hf_logits(None, inputs)[torch.float64]).max() > 0.1
  assert_as_close_as_transformers(got, theirs[torch.float32], theirs[torch.float64], inputs)

  # --merge-lora: a plain checkpoint transformers loads, whose weights are
  # PEFT's own float64 merge_and_unload to float32 rounding: a rank-r dot
  # product and a sum in float32 are within (r + 2) / 2 ulp of the largest
  # term of W + scale * sum_k B[o, k] A[k, i] (the sum may cancel; measured
  # at most 2.53 ulp here, r = 4).
  merged = lora.merge_lora(model)
  assert type(merged) is gemma4.Gemma4 and not lora.adapted_modules(merged)
  merged.save_pretrained(tmp_path / "merged")
  ours = transformers.Gemma4ForConditionalGeneration.from_pretrained(
    tmp_path / "merged", dtype=torch.float64
  ).state_dict()
  reference = hf_model(torch.float64, str(tmp_path / "adapter")).merge_and_unload().state_dict()
  assert set(ours) == set(reference)
  factors = safetensors.numpy.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
  changed = 0
  for key, want in reference.items():
    want, got_w, base_w = want.numpy(), ours[key].numpy(), hf_model_weights()[key]
    size = np.abs(base_w)
    factor = "base_model.model." + key.removesuffix(".weight") + ".lora_{}.weight"
    if factor.format("A") in factors:
      terms = np.abs(factors[factor.format("B")]) @ np.abs(factors[factor.format("A")]) * 4.0
      size = np.maximum(size, terms)
    size = size.astype(np.float32)
    assert np.all(np.abs(got_w - want) <= 3 * np.spacing(size)), key
    changed += not np.array_equal(want, base_w)
  assert changed == len(lora.adapted_modules(model))


def hf_model_weights(cache={}):
  if not cache:
    cache.update({k: v.numpy() for k, v in hf_model(torch.float64).state_dict().items()})
  return cache


@pytest.mark.parametrize(
  "targets,rslora",
  [
    (r".*language_model.*\.(q_proj|v_proj|down_proj)", False),
    # PEFT's list form matches name suffixes (a bare "q_proj" would also hit
    # the vision tower's clipped linears, which PEFT refuses).
    (["language_model.layers.1.self_attn.o_proj", "language_model.layers.3.mlp.up_proj"], True),
  ],
)
def test_cpjax_loads_what_peft_saves(tmp_path, targets, rslora):
  """An adapter made and saved by PEFT itself (random B: init_lora_weights=False)."""
  inputs = fixtures_module().batch("images", 7)
  torch.manual_seed(0)
  config = peft.LoraConfig(
    r=8,
    lora_alpha=32,
    target_modules=targets,
    use_rslora=rslora,
    init_lora_weights=False,
    task_type="CAUSAL_LM",
  )
  made = peft.get_peft_model(hf_model(torch.float32), config)
  made.save_pretrained(tmp_path)
  theirs = hf_logits(str(tmp_path), inputs)
  model = lora.load_adapter(gemma4.Gemma4.from_pretrained(BASE), tmp_path)
  peft_modules = {
    name[len("base_model.model.") :]
    for name, m in made.named_modules()
    if isinstance(m, peft.tuners.lora.LoraLayer)
  }
  assert set(lora.adapted_modules(model)) == peft_modules
  got = np.asarray(compiled(model)(gemma4.prepare_batch(inputs, model.cfg)))
  assert_as_close_as_transformers(got, theirs[torch.float32], theirs[torch.float64], inputs)


# 26B-A4B-like, saved by transformers: 4 experts (top 2) beside the dense MLP.
MOE = os.path.join(FIXTURES, "moe_k_eq_v_vision")
EXPERT_TENSORS = ["experts.gate_up_proj", "experts.down_proj"]


def moe_logits(adapter, inputs):
  """transformers + PEFT's float64 and float32 logits of the MoE fixture (its
  eager experts: the grouped kernel has no float64)."""
  mf = fixtures_module()
  out = {}
  for dtype in (torch.float64, torch.float32):
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      MOE, dtype=dtype, experts_implementation="eager"
    ).eval()
    if adapter is not None:
      model = peft.PeftModel.from_pretrained(model, adapter).eval()
    out[dtype] = mf.hf_logits(model, inputs, dtype)
  return out


def test_peft_loads_cpjax_expert_adapters_and_merging_equals_its_merge(tmp_path):
  """Per-expert adapters (the default on an MoE) saved by cpjax are PEFT's
  ParamWrapper factors: PEFT's logits with them are cpjax's, and
  merge_lora's expert tensors are PEFT's merge_and_unload."""
  inputs = fixtures_module().batch("images", 5)
  model = lora.apply_lora(gemma4.Gemma4.from_pretrained(MOE), lora.LoraConfig(rank=4, alpha=16.0))
  randomize_adapters(model, seed=5, scale=0.1)
  lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=MOE)
  theirs = moe_logits(str(tmp_path / "adapter"), inputs)
  base = moe_logits(None, inputs)[torch.float64]
  real = inputs["attention_mask"].astype(bool)
  assert np.abs(theirs[torch.float64] - base)[real].max() > 0.1  # the adapters matter
  got = np.asarray(compiled(model)(gemma4.prepare_batch(inputs, model.cfg)))
  assert_as_close_as_transformers(got, theirs[torch.float32], theirs[torch.float64], inputs)

  # Merged: each expert tensor is PEFT's float64 W + scale * B_e A_e to
  # float32 rounding of its largest term (as the dense test bounds it).
  terms = {
    f"model.language_model.layers.{i}.experts.{name}": np.einsum(
      "eir,ero->eoi", np.abs(np.asarray(a[...])), np.abs(np.asarray(b[...]))
    )
    * model.lora_config.scale
    for i, layer in enumerate(model.model.language_model.layers)
    for name, (a, b) in lora.adapters.adapter_pairs(layer.experts).items()
  }
  merged = lora.merge_lora(model)
  assert type(merged) is gemma4.Gemma4 and not lora.adapted_modules(merged)
  merged.save_pretrained(tmp_path / "merged")
  ours = safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")
  reference = (
    peft.PeftModel.from_pretrained(
      transformers.Gemma4ForConditionalGeneration.from_pretrained(
        MOE, dtype=torch.float64, experts_implementation="eager"
      ),
      str(tmp_path / "adapter"),
    )
    .merge_and_unload()
    .state_dict()
  )
  checked = 0
  for key, want in reference.items():
    if ".experts." not in key:
      continue
    want, got_w = want.numpy(), ours[key]
    assert not np.allclose(want, hf_moe_weight(key)), key  # the merge moved it
    size = np.maximum(np.abs(hf_moe_weight(key)), terms[key])
    assert np.all(np.abs(got_w - want) <= 3 * np.spacing(size.astype(np.float32))), key
    checked += 1
  assert checked == 2 * model.cfg.text.num_hidden_layers


def hf_moe_weight(key, cache={}):
  if not cache:
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(MOE, dtype=torch.float64)
    cache.update({k: v.numpy() for k, v in hf.state_dict().items()})
  return cache[key]


@pytest.fixture(scope="module")
def peft_moe_adapter(tmp_path_factory):
  """An adapter PEFT made and saved on the MoE fixture: attention and dense MLP
  projections and both expert tensors (random B: init_lora_weights=False),
  with transformers + PEFT's logits of a batch."""
  path = tmp_path_factory.mktemp("peft_moe")
  torch.manual_seed(1)
  config = peft.LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=r".*language_model.*\.(q_proj|o_proj|down_proj)",
    target_parameters=EXPERT_TENSORS,
    init_lora_weights=False,
    task_type="CAUSAL_LM",
  )
  made = peft.get_peft_model(
    transformers.Gemma4ForConditionalGeneration.from_pretrained(
      MOE, dtype=torch.float32, experts_implementation="eager"
    ),
    config,
  )
  made.save_pretrained(path)
  inputs = fixtures_module().batch("images", 9)
  return path, inputs, moe_logits(str(path), inputs)


# One device, cp, expert parallelism over cp (ep = 2 and 4), and fsdp x cp
# with the experts over cp (ep = 2; the rows whole over parallel.make_mesh's
# Auto fsdp axis). cp_logits does not fold ep onto fsdp: the training step's
# fsdp x cp, ep = 4 case is test_lora.py's test_lora_cp_gradients_equal_single_device.
@pytest.mark.parametrize(
  "mesh_sizes",
  [
    {},
    {"cp": 4},
    {"cp": 2, "ep": 2},
    {"cp": 4, "ep": 4},
    {"fsdp": 2, "cp": 2, "ep": 2},
  ],
  ids=["one-device", "cp4", "cp2-ep2", "cp4-ep4", "fsdp2-cp2-ep2"],
)
def test_cpjax_loads_peft_expert_adapters_on_every_mesh(peft_moe_adapter, mesh_sizes):
  from cpjax import parallel

  path, inputs, theirs = peft_moe_adapter
  model = lora.load_adapter(gemma4.Gemma4.from_pretrained(MOE), path)
  experts = model.model.language_model.layers[0].experts
  assert lora.lora_param_count(experts) == 4 * 4 * (
    (64 + 2 * 24) + (24 + 64)
  )  # E r (D + 2I + I + D)
  assert model.lora_config.target_parameters == tuple(EXPERT_TENSORS)
  batch = gemma4.prepare_batch(inputs, model.cfg)
  if not mesh_sizes:
    got = np.asarray(compiled(model)(batch))
  else:
    sizes = dict(mesh_sizes)
    ep = sizes.pop("ep", 1)
    mesh = parallel.make_mesh(**sizes)
    got = np.asarray(
      gemma4.cp_logits(
        model,
        batch,
        mesh,
        batch_axis=parallel.batch_axis_of(mesh),
        expert_axes=parallel.expert_axes(mesh, ep),
      )
    )
  assert_as_close_as_transformers(got, theirs[torch.float32], theirs[torch.float64], inputs)


# The LoRA guide's command runs in CI on the MoE checkpoint (expert adapters and
# PEFT); the dense one in `make soak` (its LoRA runs in CI in
# test_lora_training.py). The step-1 parity check of an MoE LoRA run from the
# command line: test_qlora.py's CLI run at cp = 4, ep = 4 (suite budget).
@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.slow), "moe"])
def test_readme_lora_commands_run_and_peft_loads_the_adapter(
  tmp_path, monkeypatch, hf_checkpoint, kind
):
  """The LoRA guide (guides/lora.md) as written, at a small size, on checkpoints
  transformers saved with their tokenizer and template (E2B-like and
  26B-A4B-like), trained on the shipped chat JSONL; then its Python lines:
  PEFT's model gives the logits of cpjax's model with the same adapter."""
  import shlex

  from cpjax import cli

  base = hf_checkpoint(kind)
  section = doc("guides/lora.md", "LoRA: adapters on a frozen base")
  (command,) = code_blocks(section, "bash")
  (code,) = code_blocks(section, "python")
  monkeypatch.chdir(tmp_path)
  small = command.strip().replace("gemma-4-E2B-it", base)
  chat = os.path.join(os.path.dirname(__file__), "..", "cpjax", "examples", "chat", "train.jsonl")
  for big, little in (
    ("--data chat.jsonl", f"--data {chat}"),
    ("--seq-len 8192", "--seq-len 128"),
    ("--cp 8", "--cp 2"),
    ("--steps 100", "--steps 2"),
  ):
    assert big in small
    small = small.replace(big, little)
  args = shlex.split(small)
  assert args[0] == ".venv/bin/cpjax"
  # The step's parity with one device under LoRA, a bfloat16 base and CP:
  # test_lora_training.py's test_bfloat16_base_keeps_float32_adapters (and with
  # remat, its MoE test), and from the command line test_qlora.py's CLI run.
  args.append("--no-parity-check")
  assert cli.main(args[1:]) == 0
  scope = {}
  exec(compile(code.replace('"gemma-4-E2B-it"', repr(base)), "lora.md", "exec"), scope)  # noqa: S102
  inputs = fixtures_module().batch("text", 7)
  # The fixtures' words are ids 5..255; the tokenizer's image markers are
  # among them here, and text rows hold none.
  inputs["input_ids"] = np.where(np.isin(inputs["input_ids"], (7, 8, 9)), 10, inputs["input_ids"])
  theirs = fixtures_module().hf_logits(scope["model"].eval(), inputs, torch.float32)
  ours = lora.load_adapter(gemma4.Gemma4.from_pretrained(base), tmp_path / "my-adapter")
  got = np.asarray(compiled(ours)(gemma4.prepare_batch(inputs, ours.cfg)))
  real = inputs["attention_mask"].astype(bool)
  # Both put the trained adapter on the float32 base: equal to float32
  # rounding (measured max 5e-5 on fixture batches), far below any wrong factor.
  assert np.abs(got - theirs)[real].max() < 1e-3
  assert np.abs(ours.model.language_model.layers[0].mlp.up_proj.weight_lora_b[...]).max() > 0
  if kind == "moe":  # the experts' own adapters trained too (the default), and PEFT applied them
    experts = ours.model.language_model.layers[0].experts
    assert np.abs(experts.gate_up_proj_lora_b[...]).max() > 0
    assert np.abs(experts.down_proj_lora_b[...]).max() > 0
