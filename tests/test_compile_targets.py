"""The ring's kernels and the training step compiled by the real TPU and GPU compilers.

Lowering is not compiling: Mosaic (libtpu) and ptxas (jax's CUDA plugin) only
run at ``.compile()``, and they reject what XLA:CPU and Pallas' interpreter
accept. Here they compile for compile-only devices of a v5e slice and of 8
H200s (:mod:`cpjax.training.targets`), on this CPU machine: every mask rule,
Gemma 4's head dims (256 and 512), GQA groups 1 to 8, bfloat16 and float32,
the three layouts and the window-shortened ring, forward and backward; and
Gemma 4's training step on meshes whose fsdp and tp axes XLA partitions
(the kernels must sit in a ``shard_map`` manual over them,
:func:`cpjax.attention.ring.kernels._common.manual_over_mesh`). Skipped without
``pip install 'cpjax[tpu]'`` / ``'cpjax[cuda-compiler]'``.
"""

import collections
import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cpjax
from cpjax import parallel, recipes
from cpjax.training import plan, targets
from tests.test_context_parallel import PrefixLM  # a user's rule

needs = {
  "v5e-8": pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu: pip install 'cpjax[tpu]'"
  ),
  "h200-8": pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="needs jax's CUDA plugin: pip install 'cpjax[cuda-compiler]'",
  ),
}
KERNEL = {
  "v5e-8": ("tpu_custom_call", "pallas_tpu"),
  "h200-8": ("__gpu$xla.gpu.triton", "pallas_gpu"),
}


@functools.lru_cache(maxsize=None)
def devices(name):
  return targets.parse_target(name).devices()


# (mask, layout, head dim, query heads, KV heads, dtype): each rule, head dim,
# group size, dtype and layout at least once, in as few compiles as that takes.
RING_CASES = {
  "causal-d256-g8-bf16-load_balanced": ("causal", "load_balanced", 256, 8, 1, jnp.bfloat16),
  "window-d512-g1-f32-contiguous": ("window", "contiguous", 512, 2, 2, jnp.float32),
  "documents-padding-d256-g2-bf16-document_balanced": (
    "documents",
    "document_balanced",
    256,
    4,
    2,
    jnp.bfloat16,
  ),
  "vision-d256-g4-f32-load_balanced": ("vision", "load_balanced", 256, 4, 1, jnp.float32),
  "user-rule-d512-g8-bf16-load_balanced": ("user", "load_balanced", 512, 8, 1, jnp.bfloat16),
}
S, CP = 2048, 8


def _mask(kind):
  """(AttentionMask of abstract [1, S] arrays or None, mask keywords)."""
  ids = jax.ShapeDtypeStruct((1, S), jnp.int32)
  if kind == "causal":
    return None, {}
  if kind == "window":  # 512 keys reach one rank back: a shortened ring
    return None, {"sliding_window": 512}
  if kind == "documents":
    return None, {"document_ids": ids, "padding_mask": jax.ShapeDtypeStruct((1, S), jnp.bool_)}
  if kind == "vision":
    return None, {"vision_group_ids": ids, "sliding_window": 128}
  return cpjax.AttentionMask(cpjax.LocalWindow(None, 0) | PrefixLM(300)), {}


def compiled_ring(target, kind, layout_kind, d, hq, hkv, dtype, seq_len=S, strategy="ring"):
  mesh = parallel.make_mesh(cp=CP, devices=devices(target))
  layout = cpjax.ShardLayout(seq_len, seq_len, CP, layout_kind)
  mask, keywords = _mask(kind)
  rows = NamedSharding(mesh, P(None, "cp"))
  q = jax.ShapeDtypeStruct((1, seq_len, hq, d), dtype, sharding=rows)
  kv = jax.ShapeDtypeStruct((1, seq_len, hkv, d), dtype, sharding=rows)
  static = {k: v for k, v in keywords.items() if isinstance(v, int)}
  arrays = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
    for k, v in keywords.items()
    if k not in static
  }

  def loss(q, k, v, arrays):
    out = cpjax.context_parallel_attention(
      q, k, v, mesh=mesh, layout=layout, mask=mask, strategy=strategy, **static, **arrays
    )
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, arrays).lower().compile()


@pytest.mark.parametrize("target", [pytest.param(t, marks=m) for t, m in needs.items()])
@pytest.mark.parametrize("case", list(RING_CASES))
def test_the_ring_kernels_compile_for_the_chip(target, case):
  """Forward and backward of the ring with the chip's kernels (the default on
  its mesh): every kernel of both passes is in the compiled program, which a
  fallback to the XLA tile loop, or a kernel its compiler rejects, fails."""
  compiled = compiled_ring(target, *RING_CASES[case])
  text = compiled.as_text()
  call, _ = KERNEL[target]
  assert text.count(call) >= 3, collections.Counter(
    re.findall(r"custom_call_target=\"[^\"]+", text)
  )
  names = set(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text))
  assert names == {"forward", "dq", "dkdv"}, names


@pytest.mark.parametrize("target", [pytest.param(t, marks=m) for t, m in needs.items()])
@pytest.mark.parametrize(
  "case", ["documents-padding-d256-g2-bf16-document_balanced", "window-d512-g1-f32-contiguous"]
)
def test_the_all_gather_kernels_compile_for_the_chip(target, case):
  """strategy="all_gather": the kernels fold the gathered row (cp times a
  hop's keys) in one call per pass, and no hop travels; a window's rank
  folds its chunk and the halo its neighbours send, and gathers nothing."""
  compiled = compiled_ring(target, *RING_CASES[case], strategy="all_gather")
  text = compiled.as_text()
  call, _ = KERNEL[target]
  assert set(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text)) == {"forward", "dq", "dkdv"}
  assert call in text
  halo = case.startswith("window")
  assert ("collective-permute" in text) == halo
  assert ("all-gather" in text) == ("reduce-scatter" in text) == (not halo)


@pytest.mark.parametrize("target", [pytest.param(t, marks=m) for t, m in needs.items()])
@pytest.mark.parametrize(
  "case", ["causal-d256-g8-bf16-load_balanced", "user-rule-d512-g8-bf16-load_balanced"]
)
def test_the_ulysses_kernels_compile_for_the_chip(target, case):
  """strategy="ulysses": all-to-alls move heads, and the kernels fold the
  whole row of queries and keys (8 query heads, one a rank) in one call."""
  compiled = compiled_ring(target, *RING_CASES[case], strategy="ulysses")
  text = compiled.as_text()
  assert set(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text)) == {"forward", "dq", "dkdv"}
  assert KERNEL[target][0] in text and "all-to-all" in text
  assert "collective-permute" not in text


@pytest.mark.parametrize("target", [pytest.param(t, marks=m) for t, m in needs.items()])
def test_the_hybrid_kernels_compile_for_the_chip(target):
  """strategy="hybrid": 2 K/V heads make groups of 2 ranks; the all-to-alls
  stay inside them and the kernels fold each group's chunk on a ring of 4."""
  case = "documents-padding-d256-g2-bf16-document_balanced"
  text = compiled_ring(target, *RING_CASES[case], strategy="hybrid").as_text()
  assert set(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text)) == {"forward", "dq", "dkdv"}
  assert KERNEL[target][0] in text and "collective-permute" in text
  groups = set(re.findall(r"all-to-all(?:-start)?\(.*?replica_groups=(\{[\d,{}]*\})", text))
  assert groups == {"{{0,1},{2,3},{4,5},{6,7}}"}, groups


@needs["v5e-8"]
def test_the_tpu_kernels_compile_at_a_million_tokens_on_8_ranks():
  """131072 tokens a rank at head dim 512, 8 query heads on one KV head: each
  hop's tile table (4 MiB of int32 in one call) is more than a v5e core's
  1 MiB of SMEM, so the kernels run as pieces of it
  (:data:`cpjax.attention.ring.kernels._tpu.TABLE_WORDS`) and Mosaic compiles every one."""
  from cpjax.attention.ring.kernels import _tpu as tpu

  compiled = compiled_ring(
    "v5e-8", "causal", "load_balanced", 512, 8, 1, jnp.bfloat16, seq_len=1 << 20
  )
  calls = collections.Counter(
    re.findall(
      r"custom_call_target=\"tpu_custom_call\"[^\n]*?cpjax_ring_(forward|dq|dkdv)",
      compiled.as_text(),
    )
  )
  # A hop walks 8 x 131072 / 256 = 4096 row blocks of 131072 / 512 = 256 key
  # blocks (the tiles at head dim 512); each kernel is called at two sites
  # (the first hop, and the ring's loop), each as that many pieces.
  pieces = 4096 * 256 // tpu.TABLE_WORDS
  assert pieces > 1 and calls == {"forward": 2 * pieces, "dq": 2 * pieces, "dkdv": 2 * pieces}, (
    pieces,
    calls,
  )
  assert compiled.memory_analysis().temp_size_in_bytes > 0


@needs["h200-8"]
def test_the_gpu_schedule_stays_linear_in_tokens_at_a_million_tokens():
  """Triton's tiles at head dim 512 are 16 x 16, so a hop's dense schedule at
  131072 tokens a rank would be 65536 x 8192 tiles: int32 tables of 2 GiB,
  several live at once (the whole ring needed 19.3 GiB of temporaries here,
  against 1.3 GiB at 16384 tokens a rank). Grouped into at most
  ``schedule_tiles`` blocks, the temporaries grow with the tokens: 8 times the
  tokens, at most 8.1 times the bytes (measured 9.53 against 1.20 GiB)."""
  temp = {
    n: compiled_ring("h200-8", "causal", "load_balanced", 512, 8, 1, jnp.float32, seq_len=n)
    .memory_analysis()
    .temp_size_in_bytes
    for n in (1 << 17, 1 << 20)
  }
  assert temp[1 << 20] <= 8.1 * temp[1 << 17], {n: t / 2**30 for n, t in temp.items()}


# The training step on meshes XLA partitions over fsdp and tp; each with the
# compiled memory per device it was recorded at (bytes, arguments + outputs -
# aliases + temporaries): a change that makes the step grow by more than 10%
# fails here, and one that shrinks it should lower the record.
STEPS = {
  ("v5e-8", "tiny", (("fsdp", 2), ("cp", 2), ("tp", 2))): 35_197_440,
}
# In `make soak`: the GPU's kernels are compiled above, in the ring, and the
# MoE step's axes are the tiny step's (fsdp and cp; ep folds onto them).
# The tiny MoE on H200s grew from 80_070_496 with grouped_matmul's loop (off
# TPU it replaced ragged_dot's dense expansion, which took 42 GiB more on the
# 26B-A4B slice): its record is that step's. On v5e-8 it shrank from
# 100_942_336 once XLA:TPU made the experts' weight gradients in their layer.
SLOW_STEPS = {
  ("v5e-8", "tiny-moe", (("fsdp", 2), ("cp", 4), ("ep", 4))): 61_375_488,
  ("h200-8", "tiny", (("fsdp", 2), ("cp", 2), ("tp", 2))): 29_887_380,
  ("v5e-8", "tiny", (("cp", 4), ("tp", 2))): 45_778_944,
  ("h200-8", "tiny", (("fsdp", 2), ("cp", 4))): 20_809_396,
  ("h200-8", "tiny-moe", (("fsdp", 2), ("cp", 4), ("ep", 4))): 94_781_512,
}


def _step_params():
  out = []
  for table, marks in ((STEPS, ()), (SLOW_STEPS, (pytest.mark.slow,))):
    for (target, preset, mesh), record in table.items():
      ident = f"{preset}-{target}-" + "x".join(f"{k}{v}" for k, v in mesh)
      out.append(
        pytest.param(target, preset, dict(mesh), record, id=ident, marks=(needs[target], *marks))
      )
  return out


@pytest.mark.parametrize("target, preset, mesh, record", _step_params())
def test_the_training_step_compiles_for_the_chip(target, preset, mesh, record):
  """Gemma 4's whole step (AdamW, the ring with the chip's kernels, FSDP / TP
  shardings, expert parallelism) through the real compiler, as
  ``cpjax plan --target`` compiles it, and its memory against the record."""
  from cpjax.models.gemma4 import Gemma4Config

  # The records' settings: full remat, the ring (a run's defaults are none and auto).
  compiled, _, _, _ = plan.compile_step(
    Gemma4Config.preset(preset),
    seq_len=4096,
    mesh=mesh,
    remat="full",
    strategy="ring",
    devices=devices(target),
  )
  text = compiled.as_text()
  call, _ = KERNEL[target]
  assert set(re.findall(r"cpjax_ring_(forward|dq|dkdv)", text)) == {"forward", "dq", "dkdv"}
  assert call in text
  total = plan.compiled_bytes(compiled)
  print(f"{target} {preset} {mesh}: {total} bytes per device")
  if record is not None:
    assert total <= 1.1 * record, (total, record)


# `make soak` (a compile of 31 s): the experts' LoRA factors through XLA:TPU's
# grouped matmul. CI checks their numerics on the CPU's loop (test_lora.py).
@needs["v5e-8"]
@pytest.mark.slow
def test_the_expert_lora_step_compiles_for_the_tpu():
  """Per-expert adapters (the MoE default under LoRA) inside ragged_dot's
  grouped matmul, bfloat16, the experts and their factors over ep = 4 on
  fsdp x cp: XLA:TPU accepts the step, and its state is the closed form's
  (71960 bytes of parameters a device)."""
  from cpjax.models.gemma4 import Gemma4Config

  cfg = Gemma4Config.preset("tiny-moe")
  shape = plan.StepShape(
    1024,
    {"fsdp": 2, "cp": 4, "ep": 4},
    dtype="bfloat16",
    lora_rank=4,
    base_dtype="bfloat16",
  )
  compiled = plan.compiled_plan(cfg, shape, model="tiny-moe", target=targets.parse_target("v5e-8"))
  closed = plan.estimate(cfg, shape, model="tiny-moe")
  assert not compiled.refused
  # XLA:TPU's parameters hold 4 bytes more than the closed form's, with or
  # without the experts' adapters (65560 and 65556 without them).
  assert compiled.optimizer == closed.optimizer and abs(compiled.params - closed.params) <= 4
  assert plan.lora_param_count(cfg, rank=4) > plan.lora_param_count(
    cfg, rank=4, target_parameters=()
  )


# ptxas's spills (bytes stored, per kernel) with the default GPU tiles: none
# in bfloat16 at any of Gemma 4's head dims, nor in float32 up to 128; float32
# at 256 and 512 spills in dK/dV (and dq at 512) even at 16 x 16 tiles, by at
# most these many bytes (measured; a change that spills more fails), with one
# tile a schedule block and with grouped blocks.
F32_SPILLS = {
  256: {"cpjax_ring_dkdv": (212, 232)},
  512: {"cpjax_ring_dkdv": (3008, 3044), "cpjax_ring_dq": (136, 136)},
}


@needs["h200-8"]
@pytest.mark.parametrize("grouped", [False, True], ids=["tiles", "grouped"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_the_gpu_kernels_fit_the_registers(monkeypatch, d, dtype, grouped):
  """ptxas -v on the ring's Triton kernels for sm_90a (8 query heads on one
  K/V head): the default tiles (cpjax.attention.ring.kernels.PALLAS_IMPLEMENTATIONS)
  spill no register, also where the schedule groups tiles into blocks (a
  loop more a kernel)."""

  from cpjax.attention.ring.kernels import _implementations, ptxas

  if grouped:
    monkeypatch.setitem(
      _implementations.PALLAS_IMPLEMENTATIONS,
      "pallas_gpu",
      dataclasses.replace(_implementations.PALLAS_IMPLEMENTATIONS["pallas_gpu"], schedule_tiles=4),
    )

  mesh = parallel.make_mesh(cp=CP, devices=devices("h200-8"))
  layout = cpjax.ShardLayout(S, S, CP, "load_balanced")
  rows = NamedSharding(mesh, P(None, "cp"))
  q = jax.ShapeDtypeStruct((1, S, 8, d), dtype, sharding=rows)
  kv = jax.ShapeDtypeStruct((1, S, 1, d), dtype, sharding=rows)

  def loss(q, k, v):
    out = cpjax.context_parallel_attention(q, k, v, mesh=mesh, layout=layout)
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower()
  usage = ptxas.kernel_usage(lowered)
  print(d, jnp.dtype(dtype).name, grouped, usage)
  assert set(usage) == {"cpjax_ring_forward", "cpjax_ring_dq", "cpjax_ring_dkdv"}, usage
  allowed = (
    {name: spills[grouped] for name, spills in F32_SPILLS.get(d, {}).items()}
    if dtype == jnp.float32
    else {}
  )
  for name, use in usage.items():
    assert use.spill_stores <= allowed.get(name, 0), (name, use)
    assert use.registers <= 255


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, r in recipes.RECIPES.items() if r.target])
def test_each_published_recipe_fits_its_chips_by_their_compiler(name):
  """``cpjax plan --recipe NAME --target`` of the chips the recipe names: the
  whole model at full size, compiled by that chip's compiler, fits its memory
  (minutes to a quarter of an hour each on 2 cores: `make soak`)."""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training.run_file import read_run_config

  run, record = read_run_config(recipes.path(name)), recipes.RECIPES[name]
  target = targets.parse_target(record.target)
  if (
    importlib.util.find_spec({"tpu": "libtpu", "cuda": "jax_cuda12_plugin"}[target.chip.platform])
    is None
  ):
    pytest.skip(f"needs the {target.chip.platform} compiler")
  cfg = Gemma4Config.preset(run.model)
  got = plan.compiled_plan(
    cfg, run, model=run.model, target=target, device_memory=target.chip.memory
  )
  assert got.fits(target.chip.memory), got.row()


# The dense single-device step of the training notebook on one v5e (bytes).
NOTEBOOK_STEP_BYTES = 4_806_962_176


# 96 s on 2 cores: `make soak` (CI compiles the tiny step for the v5e on
# three meshes above).
@pytest.mark.slow
@needs["v5e-8"]
def test_the_training_notebooks_single_chip_step_compiles_for_one_v5e():
  """On a Colab TPU runtime of one chip (v5e-1) the training notebook runs the
  ring on 8 CPU devices beside it and the dense single-device step on the
  chip (notebooks/build_notebooks.py): that step, at the notebook's longest
  memory-curve row (8 x 64 tokens on each of 8 ranks, two rows), compiles
  for one v5e and fits its 16 GiB, at the memory it was recorded at."""
  import optax
  from flax import nnx

  from cpjax import training
  from cpjax.models import gemma4

  (chip,) = targets.parse_target("v5e-1").devices()
  on_chip = jax.sharding.SingleDeviceSharding(chip)
  cfg = gemma4.Gemma4Config.preset("tiny")
  graphdef, params, buffers = nnx.split(
    nnx.eval_shape(lambda: gemma4.Gemma4(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...
  )
  opt = optax.adamw(3e-3)
  put = lambda tree: jax.tree.map(  # noqa: E731
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), tree
  )
  seq_len = 8 * 64 * 8
  rows = gemma4.synthetic_batch(np.random.default_rng(0), cfg, batch_size=2, seq_len=seq_len)
  batch = gemma4.prepare_batch(rows, cfg)
  step = training.make_train_step(graphdef, opt, frozen=put(buffers))
  compiled = step.compile(put(params), put(jax.eval_shape(opt.init, params)), put(batch))
  total = plan.compiled_bytes(compiled)
  print(f"notebook's dense step on one v5e: {total} bytes")
  assert "TPU v5" in chip.device_kind, chip.device_kind
  # Dense attention's [B, H, S, S] float32 scores make most of it.
  assert total <= 1.1 * NOTEBOOK_STEP_BYTES and total < targets.CHIPS["v5e"].memory, total


@pytest.mark.parametrize("target", [pytest.param(t, marks=needs[t]) for t in needs])
def test_the_experts_grouped_matmul_compiles_without_a_dense_expansion(target):
  """The experts' grouped matmul and its gradients for each chip: XLA:TPU's
  ragged dot on TPU; on the GPU the loop over (tile, group) pairs, whose
  temporaries stay near the operands' size (JAX's own lowering of
  ``ragged_dot`` expands the rows to a dense [G, M, K]: 1 GiB here)."""
  from cpjax.models.gemma4.experts import grouped_matmul

  m, k, n, g = 16384, 1024, 512, 16
  mesh = jax.sharding.Mesh(devices(target)[:1], ("x",))
  whole = NamedSharding(mesh, P())
  rows = jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=whole)
  weights = jax.ShapeDtypeStruct((g, k, n), jnp.float32, sharding=whole)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=whole)

  def loss(rows, weights, sizes):
    return jnp.sum(jnp.sin(grouped_matmul(rows, weights, sizes)))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(rows, weights, sizes).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(target, temp)
  operands = 4 * (m * k + g * k * n + m * n)
  assert temp <= 2 * operands, (temp, operands)
  if target.startswith("v5e"):
    assert "ragged" in compiled.as_text()


def _experts_backward_temp(layers: int, tokens: int, d: int, k: int) -> int:
  """XLA:TPU's temporaries for the experts' weight gradients through
  ``layers`` rematerialised expert layers over cp = 8 (ep on cp, capacity
  1.25; ``tokens`` a device, ``k`` experts a token, 8 experts of width ``d``)."""
  from cpjax.models.gemma4.experts import grouped_matmul, routed_experts

  mesh = jax.sharding.Mesh(devices("v5e-8"), ("cp",))

  def experts(rows, sizes, params):
    up, down = params
    return grouped_matmul(jax.nn.gelu(grouped_matmul(rows, up, sizes)), down, sizes)

  def layer(x, ids, weights, params):
    y, _ = routed_experts(
      x, weights, ids, params, experts, num_experts=8, expert_axes=("cp",), capacity_factor=1.25
    )
    return x + y

  def loss(x, ids, weights, params):
    def local(x, ids, weights, params):
      for p in params:
        x = jax.checkpoint(layer)(x, ids, weights, p)
      return jnp.sum(x.astype(jnp.float32) ** 2)[None]

    spec = P("cp")
    run = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    return jnp.sum(run(x, ids, weights, params))

  def of(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("cp")))

  n = 8 * tokens
  params = [(of((8, d, d), jnp.bfloat16), of((8, d, d), jnp.bfloat16)) for _ in range(layers)]
  args = (of((n, d), jnp.bfloat16), of((n, k), jnp.int32), of((n, k), jnp.float32), params)
  compiled = jax.jit(jax.grad(loss, argnums=3)).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# Suite budget (79 s): `make soak`, with its mutant.
@pytest.mark.slow
@needs["v5e-8"]
def test_the_experts_weight_gradients_are_made_in_their_layers_backward_on_the_tpu():
  """Expert layers' weight gradients, compiled by XLA:TPU. Each leaves the
  grouped matmul's backward with the rows' gradient, through one barrier, so
  its operands (the dispatched rows and the output's gradient, each the
  dispatch's size) die in their layer's backward: from 2 to 6 layers the
  temporaries grow by 1.4 dispatch buffers a layer. Without it, XLA:TPU made
  every weight gradient at the end, where its one use is: 5.3 a layer here;
  26B-A4B full fine-tuning at S = 131072 on a v6e-32 took 30.3 GiB a device,
  and on a v5e-64 more than 21.1."""
  tokens, d, k = 4096, 256, 4
  dispatch = 1.25 * tokens * k * d * 2  # bfloat16 rows sent, or received, a layer
  grown = (_experts_backward_temp(6, tokens, d, k) - _experts_backward_temp(2, tokens, d, k)) / 4
  assert grown < 2.5 * dispatch, f"each layer keeps {grown / dispatch:.2f} dispatch buffers"


@needs["v5e-8"]
def test_the_ring_lookup_keeps_one_partial_in_flight_on_the_tpu():
  """``parallel.ring_lookup`` and its gradient over cp = 8, compiled by
  XLA:TPU: its hops run as a loop, so the temporaries hold about three of a
  rank's ``[B, L, D]`` partials (the forward's, the cotangent, the one in
  flight). Unrolled, XLA:TPU's scheduler started several hops' ppermutes at
  once: ten partials here (E2B's per-layer table at S = 262144 on a v6e-16:
  four float32 [16384, 8960] cotangents, 2.2 GiB, at the step's peak)."""
  mesh = jax.sharding.Mesh(devices("v5e-8"), ("cp",))
  rows, d, tokens = 8 * 512, 4096, 16384  # a rank's partial: 256 MiB in float32
  table = jax.ShapeDtypeStruct((rows, d), jnp.float32, sharding=NamedSharding(mesh, P("cp")))
  ids = jax.ShapeDtypeStruct(
    (1, 8 * tokens), jnp.int32, sharding=NamedSharding(mesh, P(None, "cp"))
  )
  lookup = jax.shard_map(
    functools.partial(parallel.ring_lookup, axis_name="cp"),
    mesh=mesh,
    in_specs=(P("cp"), P(None, "cp")),
    out_specs=P(None, "cp"),
  )
  grad = jax.jit(jax.grad(lambda t, i: jnp.sum(jnp.sin(lookup(t, i)))))
  temp = grad.lower(table, ids).compile().memory_analysis().temp_size_in_bytes
  partial = 4 * tokens * d
  assert temp <= 4 * partial, temp / partial


def _whole_row_reads(hlo: str, row: str) -> tuple[int, str]:
  """The most values of shape ``row`` made by all-reduces (alone, or as an
  element of a combined all-reduce's tuple) that one instruction reads, and
  that instruction."""
  name = r"%([\w.\-]+)"
  made = set(re.findall(name + r" = .*? all-reduce\(", hlo))
  value = re.compile(rf"\s*(?:ROOT )?{name} = (\S+) (all-reduce|get-tuple-element)\({name}")
  reduced = set()
  for line in hlo.splitlines():
    m = value.match(line)
    if m and row in m.group(2) and (m.group(3) == "all-reduce" or m.group(4) in made):
      reduced.add(m.group(1))
  most = (0, "")
  for line in hlo.splitlines():
    if " = " in line and "get-tuple-element(" not in line:
      lhs, rhs = line.split(" = ", 1)
      most = max(most, (len(set(re.findall(name, rhs)) & reduced), lhs.strip()))
  return most


# Suite budget (65 s): `make soak`, with its mutant.
@pytest.mark.slow
@needs["v5e-8"]
def test_kv_shared_layers_keep_no_whole_row_gradient_alive_on_the_tpu():
  """Layers that reuse one K/V, on the all-gather strategy, compiled by
  XLA:TPU: each layer's key and value gradients go home by a reduce-scatter,
  which XLA:TPU compiles, at this size, as an all-reduce of the whole row and
  a slice. Each row is sliced on its own (no op reads two). Without the
  barrier, XLA:TPU fused the slices into the one add of the sharing layers'
  gradients, so every layer's whole row stayed alive until the last: here an
  op read four; in E2B's step at S = 262144 on a v5e-16, six bfloat16
  [262144, 512] rows (1.5 GiB) at the peak. (XLA's all-reduce combiner may
  still send small rows together, here seven 16 MiB ones; at S = 65536 each
  64 MiB row went alone.)"""

  from cpjax.models.gemma4 import Gemma4Config

  cfg = Gemma4Config.preset("tiny")
  text = dataclasses.replace(
    cfg.text,
    num_hidden_layers=8,
    layer_types=("sliding_attention", "full_attention") * 4,
    num_kv_shared_layers=6,  # layers 2 to 7 reuse layers 0 and 1's K/V
    global_head_dim=512,
    num_global_key_value_heads=1,
  )
  seq_len = 16384
  compiled, _, _, _ = plan.compile_step(
    dataclasses.replace(cfg, text=text, vision=None),
    seq_len=seq_len,
    mesh={"cp": 8},
    dtype="bfloat16",
    remat="full",
    devices=devices("v5e-8"),
    strategy="all_gather",
  )
  reads, op = _whole_row_reads(compiled.as_text(), f"[1,1,{seq_len},512]")
  assert reads == 1, f"{op} reads {reads} whole-row all-reduced gradients"


# Suite budget: `make soak` (a minute a compile); CI compiles the same step
# on CPU devices (test_plan.py) and the chips' attention kernels above.
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-unified"])
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs[t]) for t in ("v5e-8", "h200-8")])
def test_a_step_with_video_and_audio_compiles_for_the_chip(target, preset):
  """Rows that each hold a video (``pixel_values_videos``: 8 frames of 16
  soft tokens) and an audio clip, whole on every device, through the chip's
  compiler as ``cpjax plan --target`` compiles them, on fsdp = 2 x cp = 4 in
  bfloat16: a vision tower and E2B's conformer tower (one layer each) on the
  tiny decoder, or the 12B's patch and waveform embedders on its tiny
  counterpart. The step takes both rows' frames and clips, and runs the
  chip's ring kernels."""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.models.gemma4.audio_config import Gemma4AudioConfig

  cfg = Gemma4Config.preset(preset)
  if preset == "tiny":
    tower = Gemma4AudioConfig(
      num_hidden_layers=1, hidden_size=64, num_attention_heads=4, output_proj_dims=64
    )
    cfg = dataclasses.replace(cfg, audio=tower)
  shape = plan.StepShape(
    4096,
    {"fsdp": 2, "cp": 4},
    dtype="bfloat16",
    remat="full",
    strategy="ring",
    video_frames=8,
    video_frame_tokens=16,
    audio_seconds=2.0 if preset == "tiny" else 0.04,
  )
  (frames, patches, features, _), clip = shape.video(cfg), shape.audio(cfg)
  compiled, _, _, _ = plan.compile_step(cfg, shape, devices=devices(target))
  text = compiled.as_text()
  assert f"f32[{2 * frames},{patches},{features}]" in text  # both rows' frames
  assert f"f32[2,{clip[0]},{clip[1]}]" in text  # and clips
  assert KERNEL[target][0] in text
  print(f"{target} {preset}: {plan.compiled_bytes(compiled)} bytes per device")


# Suite budget: `make soak` (a minute a chip).
@pytest.mark.slow
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs[t]) for t in ("v5e-8", "h200-8")])
def test_a_split_audio_clip_compiles_for_the_chip(target):
  """E2B's audio tower on one clip of 15,360 frames (2.6 minutes of speech)
  split over 8 ranks (``audio.Split``: halos by ppermute), forward and
  backward in bfloat16, compiled by the chip's compiler (measured: 524 MiB
  of temporaries a v5e, 1037 MiB an H200)."""
  from flax import nnx

  from cpjax.models.gemma4.audio import AudioTower, Split
  from cpjax.models.gemma4.audio_config import Gemma4AudioConfig

  cfg = Gemma4AudioConfig()
  mesh = jax.sharding.Mesh(np.array(devices(target)), ("cp",))
  graphdef, params, rest = nnx.split(
    nnx.eval_shape(lambda: AudioTower(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...
  )

  def on(spec):
    return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  params, rest = jax.tree.map(on(P()), params), jax.tree.map(on(P()), rest)
  frames = 8 * Split.quantum(cfg) * 40
  feats = on(P(None, "cp"))(jax.ShapeDtypeStruct((1, frames, cfg.mel_bins), jnp.bfloat16))
  mask = on(P(None, "cp"))(jax.ShapeDtypeStruct((1, frames), jnp.bool_))

  def loss(p, r, f, m):
    def local(p, r, f, m):
      out, real = nnx.merge(graphdef, p, r)(f, m, jnp.bfloat16, split=Split("cp", 8))
      total = jnp.sum(jnp.where(real[..., None], out.astype(jnp.float32), 0) ** 2)
      return jax.lax.psum(total, "cp")

    specs = (P(), P(), P(None, "cp"), P(None, "cp"))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(
      p, r, f, m
    )

  compiled = jax.jit(jax.grad(loss)).lower(params, rest, feats, mask).compile()
  assert "collective-permute" in compiled.as_text()  # the halos
