"""A quantized frozen base under LoRA (QLoRA, cpjax.training.lora.quantize):
the stored weights are a numpy re-derivation of the scheme (quantize in
float32 as qwix does), and the model's logits are transformers' float64
logits of a model holding those dequantized weights, as closely as
transformers' own float32 run of it; on the dense and the MoE checkpoint
transformers saved. Bad settings are refused before the model runs."""

import os
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
from flax import nnx

from cpjax import training
from cpjax.models import gemma4
from cpjax.training import lora
from cpjax.training.lora.quantize import QUANTIZED_MODULES
from tests.helpers import compiled
from tests.test_gemma4 import FIXTURES, training_batch
from tests.test_lora import randomize_adapters

NAME, MOE = "ple_kv_sharing", "moe_k_eq_v_vision"

# QLoRA's NormalFloat values (Dettmers et al. 2023, appendix E), as float32.
NF4 = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)


def numpy_scheme(w: np.ndarray, base_dtype: str, group: int | None, nudge: float = 0.0):
  """(q, scale [..., O, G], dequantized float64) of a float32 weight [..., O, I]:
  symmetric absmax per output channel or per group of ``group`` inputs; ``q``
  of ``w / scale`` nudged by ``nudge`` of itself (a value on a rounding
  boundary goes the way the chip's float32 division sends it, which float64
  cannot say: the test takes either side there)."""
  w = np.asarray(w, np.float32)
  g = group or w.shape[-1]
  tiles = w.reshape(*w.shape[:-1], w.shape[-1] // g, g)
  absmax = np.abs(tiles).max(-1, keepdims=True)
  bound = {"int8": 127.5, "int4": 7.5, "nf4": 1.0, "float8_e4m3fn": 448.0}[base_dtype]
  # absmax / bound as XLA computes a division by a constant: times its reciprocal.
  scale = (absmax * np.float32(1 / bound)).astype(np.float32)
  scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
  x = tiles.astype(np.float64) / scale * (1 + nudge)
  if base_dtype == "nf4":
    q = np.abs(x[..., None] - NF4).argmin(-1)
    values = NF4[q].astype(np.float64)
  elif base_dtype == "float8_e4m3fn":  # round to nearest even, saturated to ±448
    q = np.clip(x, -bound, bound).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    values = q.astype(np.float64)
  else:
    top = int(bound - 0.5)  # round half to even, saturated to the int type's range
    q = np.clip(np.round(x), -top - 1, top)
    values = q.astype(np.float64)
  dequantized = (values * scale.astype(np.float64)).reshape(w.shape)
  return q.reshape(w.shape), scale[..., 0], dequantized


def stored(model) -> dict[str, qwix.QArray]:
  """{Hugging Face key: the QArray cpjax stores} of every quantized weight."""
  out = {}
  for path, value in nnx.to_flat_state(nnx.state(model)):
    key = ".".join(map(str, path))
    if key.endswith(".array.qvalue"):  # qwix's projection: <module>.weight.array
      module = key[: -len(".weight.array.qvalue")]
      out[module + ".weight"] = _get(model, module).weight.array
    elif isinstance(getattr(value, "get_value", lambda: None)(), qwix.QArray):  # the experts'
      out[key] = value.get_value()
  return out


def _get(model, path):
  for part in path.split("."):
    model = model[int(part)] if part.isdigit() else getattr(model, part)
  return model


# Each scheme and each model in CI (the dense one at 4 bits, the MoE per
# channel and in NormalFloat groups); the other three in `make soak`.
SOAK = pytest.mark.slow


@pytest.mark.parametrize(
  "name,base_dtype,group,targets",
  [
    (NAME, "int4", 8, lora.DEFAULT_LORA_TARGETS),
    (MOE, "nf4", 8, lora.DEFAULT_LORA_TARGETS),
    # Adapters on q_proj alone: the projections without them are quantized too.
    (MOE, "int8", None, r".*language_model.*\.q_proj"),
    (MOE, "float8_e4m3fn", None, lora.DEFAULT_LORA_TARGETS),
    pytest.param(NAME, "int8", None, lora.DEFAULT_LORA_TARGETS, marks=SOAK),
    pytest.param(NAME, "nf4", 8, lora.DEFAULT_LORA_TARGETS, marks=SOAK),
    pytest.param(MOE, "int4", 8, lora.DEFAULT_LORA_TARGETS, marks=SOAK),
  ],
  ids=[
    "dense-int4-g8",
    "moe-nf4-g8",
    "moe-int8-channel-q-only",
    "moe-float8-channel",
    "dense-int8-channel",
    "dense-nf4-g8",
    "moe-int4-g8",
  ],
)
def test_a_quantized_base_is_the_numpy_scheme_and_its_logits_transformers(
  name, base_dtype, group, targets
):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import sys

  sys.path.insert(0, FIXTURES)
  import make_fixtures

  path = os.path.join(FIXTURES, name)
  base = gemma4.Gemma4.from_pretrained(path)
  settings = lora.LoraConfig(rank=2, base_dtype=base_dtype, group_size=group, targets=targets)
  model = lora.apply_lora(base, settings)
  hf = {
    dtype: transformers.Gemma4ForConditionalGeneration.from_pretrained(
      path, dtype=dtype, experts_implementation="eager"
    ).eval()
    for dtype in (torch.float64, torch.float32)
  }
  weights = {k: v.numpy() for k, v in hf[torch.float32].state_dict().items()}
  quantized = stored(model)
  cfg = model.cfg.text
  # Every decoder projection and expert tensor, and nothing else.
  want = {
    k
    for k in weights
    if re.fullmatch(QUANTIZED_MODULES + r"\.weight", k) or re.search(r"\.experts\.\w+$", k)
  }
  assert set(quantized) == want and len(want) >= 5 * cfg.num_hidden_layers
  dequantized = {}
  for key, q in quantized.items():
    _, want_scale, _ = numpy_scheme(weights[key], base_dtype, group)
    np.testing.assert_array_equal(np.asarray(q.scale), want_scale)
    floating = base_dtype.startswith("float")
    got_q = np.asarray(q.qvalue).astype(np.float64 if floating else np.int32)
    # Numpy's q, where a value within 1e-6 of a rounding boundary (8 float32
    # ulps: XLA divides by the scale through its reciprocal) may go either way.
    lo, hi = (
      numpy_scheme(weights[key], base_dtype, group, n)[0].astype(got_q.dtype) for n in (-1e-6, 1e-6)
    )
    assert np.all((got_q == lo) | (got_q == hi)), key
    scale = np.repeat(want_scale.astype(np.float64), (group or got_q.shape[-1]), axis=-1)
    values = NF4[got_q].astype(np.float64) if base_dtype == "nf4" else got_q.astype(np.float64)
    dequantized[key] = values * scale
  # transformers' model holding the dequantized weights, in float64 and float32.
  for dtype, hf_model in hf.items():
    state = hf_model.state_dict()
    with torch.no_grad():
      for key, value in dequantized.items():
        state[key].copy_(torch.from_numpy(value))
  inputs = make_fixtures.batch("images", 11)
  theirs = {d: make_fixtures.hf_logits(m, inputs, d) for d, m in hf.items()}
  got = np.asarray(compiled(model)(gemma4.prepare_batch(inputs, model.cfg)))
  real = inputs["attention_mask"].astype(bool)
  ours = np.abs(got - theirs[torch.float64])[real]
  own = np.abs(theirs[torch.float32] - theirs[torch.float64])[real]
  # qwix sums a group's products in float32 and scales each group's sum: the
  # same rounding as transformers' float32 product on the dequantized weight.
  assert ours.max() <= 5 * own.max(), (ours.max(), own.max())
  # The quantization moved the logits far beyond float32 noise.
  plain = make_fixtures.hf_logits(
    transformers.Gemma4ForConditionalGeneration.from_pretrained(
      path, dtype=torch.float64, experts_implementation="eager"
    ).eval(),
    inputs,
    torch.float64,
  )
  assert np.abs(plain - theirs[torch.float64])[real].max() > 100 * own.max()


@pytest.mark.parametrize(
  "name,base_dtype,group,mesh_sizes",
  [
    (MOE, "nf4", 8, {"fsdp": 2, "cp": 2, "ep": 4}),
    # In `make soak`: in CI the dense CLI run reads its base so at cp = 4.
    pytest.param(NAME, "int4", 8, {"fsdp": 2, "tp": 2}, marks=SOAK),
  ],
  ids=["moe-nf4-g8-fsdp2-cp2-ep4", "dense-int4-g8-fsdp2-tp2"],
)
def test_a_checkpoint_is_quantized_tensor_by_tensor_as_it_is_read(
  name, base_dtype, group, mesh_sizes, monkeypatch
):
  """The adapted model built abstractly (``apply_lora_lazily``) and filled
  from the checkpoint (``load_weights``), each weight placed on the training
  mesh as the step keeps it: every tensor read for quantizing is gone before
  the next is read; the quantized weights are the numpy scheme's and what
  ``apply_lora`` makes of the whole loaded model, the other weights the
  checkpoint's, the adapters ``apply_lora``'s bit for bit."""
  import weakref

  from cpjax import parallel
  from cpjax.models.gemma4 import checkpoint
  from cpjax.models.gemma4.partitioning import partition_rule
  from cpjax.training.trainer.builder import checkpoint_sharding

  path = os.path.join(FIXTURES, name)
  cfg = gemma4.Gemma4Config.from_hf(path)
  settings = lora.LoraConfig(rank=2, base_dtype=base_dtype, group_size=group)
  sizes = dict(mesh_sizes)
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  rule = partition_rule(cfg, tp=sizes.get("tp", 1), expert_axes=parallel.expert_axes(mesh, ep))
  read, quantize, load = [], checkpoint._quantize_as, checkpoint._load_tensor

  def quantized_once(weight, like, shardings):
    read.append(weakref.ref(weight))
    return quantize(weight, like, shardings)

  def one_at_a_time(*args):
    assert all(tensor() is None for tensor in read), "a tensor read before is still held"
    return load(*args)

  monkeypatch.setattr(checkpoint, "_quantize_as", quantized_once)
  monkeypatch.setattr(checkpoint, "_load_tensor", one_at_a_time)
  model = lora.apply_lora_lazily(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0)), settings)
  sharding = checkpoint_sharding(cfg, mesh, rule, ("fsdp", "cp"), model=model)
  checkpoint.load_weights(model, path, mesh=mesh, sharding=sharding)
  eager = lora.apply_lora(gemma4.Gemma4.from_pretrained(path), settings)
  assert len(read) == len(stored(eager)) >= 5 * cfg.text.num_hidden_layers
  # Placed as the step keeps the state (the adapters: wherever build puts them).
  state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  specs = parallel.param_specs(state, mesh, rule=rule, state_axes=("fsdp", "cp"))
  placed = jax.tree.map(lambda x: x.sharding.spec, state)
  assert jax.tree.leaves(placed) == jax.tree.leaves(specs)
  assert any(len(spec) for spec in jax.tree.leaves(specs))  # something is split
  # Quantized as the numpy scheme says, and as apply_lora quantizes.
  from safetensors.numpy import load_file

  weights = load_file(os.path.join(path, "model.safetensors"))
  ours, theirs = stored(model), stored(eager)
  assert set(ours) == set(theirs)
  for key, q in ours.items():
    _, want_scale, _ = numpy_scheme(weights[key], base_dtype, group)
    np.testing.assert_array_equal(np.asarray(q.scale), want_scale)
    np.testing.assert_array_equal(np.asarray(q.qvalue), np.asarray(theirs[key].qvalue))
  # The rest: the checkpoint's weights and apply_lora's adapters.
  for (path_, ours_), (_, theirs_) in zip(
    nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(eager)), strict=True
  ):
    got, want = ours_.get_value(), theirs_.get_value()
    if not isinstance(got, qwix.QArray) and "array" not in path_:
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path_))


def quantized(name, base_dtype, group, **config):
  """The fixture ``name`` with random adapters on a quantized float32 base, and a batch."""
  _, batch = training_batch(name)
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, name))
  settings = lora.LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype, group_size=group, **config)
  model = lora.apply_lora(base, settings)
  randomize_adapters(model, seed=2, scale=0.05)
  return model, gemma4.prepare_batch(batch, model.cfg)


# Both in `make soak`: in CI the CLI run below checks its quantized MoE step
# (cp = 4, ep = 4) against the single-device step's loss and gradient norm,
# the plan test compiles one with ep beside fsdp, and the tp rule for scales
# has its own test (test_a_quantized_weights_scales_split_with_...).
@pytest.mark.parametrize(
  "name,mesh_sizes,base_dtype,group",
  [
    pytest.param(NAME, {"fsdp": 2, "cp": 2, "tp": 2}, "int8", None, marks=SOAK),
    pytest.param(MOE, {"fsdp": 2, "cp": 2, "ep": 4}, "int4", 8, marks=SOAK),
  ],
  ids=["dense-fsdp2-cp2-tp2-int8", "moe-fsdp2-cp2-ep4-int4"],
)
def test_the_quantized_cp_step_equals_the_single_device_step(name, mesh_sizes, base_dtype, group):
  from cpjax import parallel
  from cpjax.models.gemma4.partitioning import partition_rule
  from tests.test_gemma4 import assert_grads_close

  model, batch = quantized(name, base_dtype, group)
  graphdef, adapters, frozen = lora.split_lora(model)
  mean = lambda loss: lambda p, *a: (lambda s, n: s / n)(*loss(p, *a))
  single = training.make_loss_fn(graphdef, frozen=frozen)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean(lambda p: single(p, batch))))(adapters)
  sizes = dict(mesh_sizes)
  ep = sizes.pop("ep", 1)
  mesh = parallel.make_mesh(**sizes)
  experts = parallel.expert_axes(mesh, ep)
  sharder = model.prepare_model_inputs_for_cp(layout="load_balanced")["cp_sharder"]
  sharded, layout = sharder.shard_batch(batch, mesh, batch_axis=parallel.batch_axis_of(mesh))
  rule = partition_rule(model.cfg, tp=sizes.get("tp", 1), expert_axes=experts)
  adapters = parallel.shard_params(adapters, mesh, parallel.param_specs(adapters, mesh, rule=rule))
  frozen = parallel.shard_params(frozen, mesh, parallel.param_specs(frozen, mesh, rule=rule))
  loss = training.make_loss_fn(
    graphdef, mesh=mesh, layout=layout, batch_axis=parallel.batch_axis_of(mesh), expert_axes=experts
  )
  with jax.set_mesh(mesh):
    got_loss, got_grads = jax.jit(
      jax.value_and_grad(lambda p, f: mean(lambda q: loss(q, sharded, f))(p))
    )(adapters, frozen)
  assert abs(float(got_loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_grads_close(jax.device_get(got_grads), ref_grads)


def test_merging_into_a_quantized_base_gives_a_plain_checkpoint_transformers_loads(tmp_path):
  """merge_lora dequantizes the base (q * scale) and folds the adapters in:
  the merged model's logits are the adapted quantized model's, and
  transformers loads its checkpoint and gives them too."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model, batch = quantized(MOE, "nf4", 8)
  merged = lora.merge_lora(model)
  assert type(merged) is gemma4.Gemma4 and not lora.adapted_modules(merged)
  assert not stored(merged)  # no quantized weight left
  want = compiled(model)(batch)
  chex.assert_trees_all_close(
    compiled(merged)(batch), want, rtol=0, atol=2e-5 * float(jnp.abs(want).max())
  )
  merged.save_pretrained(tmp_path)
  import sys

  sys.path.insert(0, FIXTURES)
  import make_fixtures

  inputs = make_fixtures.batch("images", 3)
  hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
    tmp_path, dtype=torch.float32, experts_implementation="eager"
  ).eval()
  theirs = make_fixtures.hf_logits(hf, inputs, torch.float32)
  ours = np.asarray(merged(gemma4.prepare_batch(inputs, merged.cfg)))
  real = inputs["attention_mask"].astype(bool)
  assert np.abs(ours - theirs)[real].max() < 1e-3  # float32 rounding (measured 3e-5)


@pytest.mark.parametrize(
  "config,message",
  [
    ({"base_dtype": "int4", "group_size": 7}, "LoRA group_size 7 does not divide"),
    ({"base_dtype": "bfloat16", "group_size": 8}, "LoRA group_size sets a quantized base's scales"),
    (
      {"base_dtype": "int2"},
      "LoRA base_dtype must be one of float32, bfloat16, int8, int4, nf4, float8_e4m3fn",
    ),
    ({"base_dtype": "nf4", "group_size": 0}, "LoRA group_size must be an integer >= 1, got 0"),
  ],
)
def test_a_quantization_the_model_cannot_take_is_refused_before_it_runs(config, message):
  base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, MOE))
  with pytest.raises(ValueError, match=re.escape(message)):
    lora.apply_lora(base, lora.LoraConfig(rank=4, **config))


# Suite budget: the dense run is in `make soak`; the MoE run in CI quantizes
# the same attention and MLP projections (and the experts), checks its step-1
# parity, resumes and is loaded by PEFT.
@pytest.mark.parametrize(
  "kind,mesh",
  [("moe", "cp=4,ep=4"), pytest.param("dense", "cp=4", marks=pytest.mark.slow)],
  ids=["moe-cp4-ep4", "dense-cp4"],
)
def test_cli_trains_a_4bit_checkpoint_with_cp_resumes_and_peft_loads_it(
  tmp_path, hf_checkpoint, capsys, kind, mesh, monkeypatch
):
  """``cpjax train --checkpoint DIR --lora.rank 4 --lora.base_dtype int4`` on
  checkpoints transformers saved (tokenizer and template included): the
  26B-A4B-like one at cp = 4 with the experts over it (ep = 4), the
  E2B-like one at cp = 4. The base is quantized as it is read; the step-1
  parity check against the single-device step on the same quantized base
  passes inside the run; it resumes from its state directory and saves an
  adapter (attention, MLP, and the MoE's per-expert factors) that PEFT loads
  onto the base, trained. The whole model is never loaded in bfloat16."""
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  from cpjax import cli

  def whole(*args, **kwargs):
    raise AssertionError("the whole base was loaded before it was quantized")

  monkeypatch.setattr(gemma4.Gemma4, "from_pretrained", whole)
  checkpoint = hf_checkpoint(kind)
  chat = os.path.join(os.path.dirname(__file__), "..", "cpjax", "examples", "chat", "train.jsonl")
  common = [
    "train",
    "--checkpoint",
    checkpoint,
    "--data",
    chat,
    "--seq-len",
    "128",
    "--mesh",
    mesh,
    "--lora.rank",
    "4",
    "--lora.base_dtype",
    "int4",
    "--lora.group_size",
    "8",
    "--lr",
    "1e-2",
    "--state-dir",
    str(tmp_path / "state"),
    "--metrics",
    str(tmp_path / "metrics.jsonl"),
  ]
  assert cli.main([*common, "--steps", "1"]) == 0
  first = capsys.readouterr().out
  parity = re.search(
    r"parity with the single-device model at step 1: \|dloss\|/loss = (\S+),", first
  )
  assert parity and float(parity.group(1)) <= 1e-4, first  # (a failed check exits 1)
  resume = ["train", "--resume", str(tmp_path / "state"), "--steps", "2"]
  assert cli.main([*resume, "--save", str(tmp_path / "adapter")]) == 0
  import json

  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
  base = transformers.Gemma4ForConditionalGeneration.from_pretrained(checkpoint)
  model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
  layer = model.base_model.model.model.language_model.layers[0]
  assert layer.self_attn.q_proj.lora_B["default"].weight.abs().max() > 0  # trained
  if kind == "moe":
    assert layer.experts.lora_B["default"].weight.abs().max() > 0  # down_proj's, trained


def test_adapters_on_a_4bit_base_train_along_the_bfloat16_base_run():
  """Eight AdamW steps on one batch (lr 1e-2), the same adapters' start: the
  4-bit base (int4, groups of 8) starts where its quantization puts it
  (measured 0.015 off the bfloat16 base's loss of 22.56) and then tracks the
  bfloat16-base run within 3% of the starting loss at every step (measured at
  most 1.4%, both falling below 3): the base's quantization error moves the
  logits and gradients a little, never the adapters' course."""
  import optax

  _, batch = training_batch(NAME)
  losses = {}
  for base_dtype, group in (("bfloat16", None), ("int4", 8)):
    base = gemma4.Gemma4.from_pretrained(os.path.join(FIXTURES, NAME), dtype=jnp.bfloat16)
    prepared = gemma4.prepare_batch(batch, base.cfg)
    settings = lora.LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype, group_size=group)
    graphdef, adapters, frozen = lora.split_lora(lora.apply_lora(base, settings))
    loss = training.make_loss_fn(graphdef, frozen=frozen)
    step = jax.jit(jax.value_and_grad(lambda p: (lambda s, n: s / n)(*loss(p, prepared))))
    optimizer = optax.adamw(1e-2)
    state = optimizer.init(adapters)
    losses[base_dtype] = []
    for _ in range(8):
      value, grads = step(adapters)
      updates, state = optimizer.update(grads, state, adapters)
      adapters = optax.apply_updates(adapters, updates)
      losses[base_dtype].append(float(value))
  full, quantized = np.array(losses["bfloat16"]), np.array(losses["int4"])
  assert abs(quantized[0] - full[0]) > 1e-3  # the base is quantized
  assert np.abs(quantized - full).max() <= 0.03 * full[0], (full, quantized)
  assert quantized[-1] < 0.2 * quantized[0] and full[-1] < 0.2 * full[0]


def test_a_quantized_base_compiles_to_the_closed_form_state():
  """The plan's bytes of a 4-bit base with per-expert adapters (tiny MoE,
  ep = 2 beside fsdp x cp): a 4-bit value is the half byte the compiler
  holds, in the compiled plan's state (its leaves, sharded) as in the closed
  form, below an int8 base's at the same group size.
  Its step differentiates through ep's own dispatch beside fsdp, where the
  frozen quantized experts must take no gradient."""
  from cpjax.training import plan

  cfg = gemma4.Gemma4Config.preset("tiny-moe")
  shape = {"model": "tiny-moe", "seq_len": 256, "mesh": {"fsdp": 2, "cp": 2, "ep": 2}}
  lora4 = {"lora_rank": 4, "base_dtype": "int4", "group_size": 8}
  compiled = plan.compiled_plan(cfg, **shape, **lora4)
  as_int8 = plan.estimate(cfg, **shape, dtype="float32", **{**lora4, "base_dtype": "int8"})
  closed = plan.estimate(cfg, **shape, dtype="float32", **lora4)
  bf16 = plan.estimate(cfg, **shape, dtype="float32", lora_rank=4, base_dtype="bfloat16")
  assert compiled.params == closed.params and compiled.optimizer == closed.optimizer
  assert closed.params < as_int8.params < bf16.params
  assert closed.training == "LoRA r=4 (int4 base)"


def test_a_quantized_weights_scales_split_with_its_rows_or_divisible_groups():
  """tp: a row-split weight's scales [out, groups] split by rows; a
  column-split weight's by groups where tp divides them, else whole."""
  from jax.sharding import PartitionSpec as P

  from cpjax.models.gemma4.partitioning import partition_rule

  rule = partition_rule(gemma4.Gemma4Config.preset("tiny"), tp=2)
  at = lambda name, shape: rule(
    ("model", "language_model", "layers", "0", "mlp", name, "weight", "array", "scale"), shape
  )
  assert at("up_proj", (64, 1)) == P("tp", None)
  assert at("down_proj", (64, 1)) == P()
  assert at("down_proj", (64, 4)) == P(None, "tp")
