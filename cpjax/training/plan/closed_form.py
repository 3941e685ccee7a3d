"""Plan before renting: per-device memory and FLOPs of a Gemma 4 training step on a mesh.

Two independent answers for one (model, sequence length, mesh, remat):

* :func:`compiled_plan` builds the real training step (AdamW, CP ring, FSDP
  and TP shardings) with ``jax.ShapeDtypeStruct`` parameters and compiles it
  for emulated CPU devices: no weight is materialised. XLA's
  ``memory_analysis()`` gives the per-device arguments (parameters,
  optimizer state, batch) and temporaries (activations, gathered weights,
  gradients); ``cost_analysis()`` the FLOPs.
* :func:`estimate` is the closed form below, written from the architecture.

Closed form, per device (``N`` parameters, ``s = fsdp * cp * tp`` shards
with the state over every token axis, the default, or ``s = fsdp * tp``
with ``shard_state="fsdp"``; ``B`` rows per batch shard, ``L = S / cp``
local tokens, ``a`` activation bytes):

* state: parameters ``4N/s``, Adam moments ``8N/s`` (and a 4-byte step count),
  gradients ``4N/s`` (reduce-scattered); whole over cp (``"fsdp"``) the
  gradients are there twice when ``cp > 1`` (the sum over the cp ranks is
  a second buffer);
* gathered weights (FSDP/TP gather a weight where it is used, and the ring
  a decoder layer's split over cp): the largest decoder layer in its stored
  dtype, plus its cast copy when the activations' dtype differs; full
  fine-tuning makes the embedding tables' float32 gradient beside the one it
  is added into, ``4 V (D + layers D_ple) / s``. Embedding tables and the
  tied head are never gathered
  (:func:`cpjax.parallel.lookup` and :func:`cpjax.parallel.ring_lookup`,
  the vocabulary-parallel loss); with the head split over cp the loss's
  tokens travel the cp ring, two ranks' worth at a time with their float32
  gradient, ``2 * B * L * (a + 4) * D``;
* full-row inputs: only integer streams (ids, soft-token numbers, vision
  groups) see the whole row, ``3 * B * S * 4``;
* saved activations: per layer its input ``B * L * D * a`` with remat (plus
  the per-layer input slice), or about ``B * L * (4D + 2(H + 2Hkv) Dh + 3I) * a``
  without;
* one layer's recompute / backward working set: ``2 * B * (L * (2 H Dh +
  4 Hkv Dh) + T * 3 I) * a`` at the widest layer's ``Dh`` (512 on Gemma 4's
  full layers), plus the ring's float32 hop results and accumulators (out,
  dq, dk, dv), ``16 * B * L * Dh * (H + Hkv)``, the MLP taking ``T = min(L,
  tile)`` tokens at a time (:data:`cpjax.models.gemma4.text.MLP_TILE_VALUES`);
* the loss (:func:`cpjax.training.loss.linear_cross_entropy`): four float32 buffers
  of one chunk's logits ``C x V / s`` (``C`` from
  :data:`cpjax.training.loss.LOSS_CHUNK_LOGITS`) and one log-sum-exp per token.

FLOPs: ``6 * N_active * tokens`` (plus ``2 * N_active * tokens`` for a full
remat's recompute) and attention ``4 * S_q * S_k_visible * H * Dh`` per
layer forward, three times that with the backward.

LoRA (``lora_rank``, :mod:`cpjax.training.lora`): ``N_a`` adapter values (``r * (in +
out)`` per targeted projection, ``E * r * (in + out)`` per targeted expert
tensor, stored as its experts are). The frozen base takes ``b N / s`` (``b``:
``base_dtype``'s bytes) and only the adapters have gradients and Adam
moments: parameters ``b N / s + 4 N_a / s``, moments ``8 N_a / s``,
gradients ``4 N_a / s`` (twice with ``cp > 1``); a gathered layer takes
``b`` bytes a value. The activations are full fine-tuning's (the adapters'
``B x L x r`` intermediates are left out: a few MB). FLOPs: the base needs
no weight gradient, ``4 N_active`` per token (plus the remat's ``2``), and
the adapters ``6 N_a``.

Expert parallelism (``mesh["ep"]``, :mod:`cpjax.models.gemma4.experts`): the ``N_e``
expert values are split ``ep`` ways, and the gathered layer leaves its
experts out; the token axes ``ep`` does not fold onto split each group's
experts further (``N_e / (fsdp * cp)`` stored; whole over cp, ``N_e / ep``,
or ``N_e / (ep * fsdp)`` when ``ep`` folds onto ``cp`` alone) and gather a
layer's group of them where used. The dispatch adds four buffers (sent,
received, computed, returned) of ``min(ep, c) * B * L * k * D * a`` (``k``
experts per token; ``c`` the capacity factor, or ``ep`` when no token may be
dropped: each device's block for each group has room for all its pairs; one
block without ep, where the rows are only sorted by expert and back: the
26B-A4B LoRA recipes on v5p within 0.97x to 1.11x of XLA:TPU), and
its backward four more in float32 on XLA:TPU, :data:`DISPATCH_GPU` more on
XLA:GPU (the 26B-A4B slice, 2 layers, S = 8192 and 32768 on fsdp=2 x cp=4,
ep=8, judged on a v5p-16 and 8 H200s: benchmarks/compile_targets.py
--model a4b-slice).

Audio (``audio_seconds``: one clip a row, ``U`` soft tokens of ``T``
frames of ``W`` features, :meth:`StepShape.audio`): every device holds
the step's whole ``input_features`` and mask, ``B_g * T * (4W + 1)`` (``B_g``
the step's rows over every batch shard), and
every clip's soft tokens after the tower, ``B_g * U * D * a`` (and their
float32 gradient when the tower trains). E2B and E4B's tower runs on
``U_r = B_g * U / cp`` soft tokens a rank (a clip split over the ranks when
``B_g < cp``, else ``ceil(B_g / cp)`` whole clips): training it keeps
:data:`AUDIO_CONV_BYTES` bytes a value of its first convolution's output
(``2 * (W / 2) * C0`` values a soft token, ``C0`` its channels) and
:data:`AUDIO_LAYER_VALUES` values of ``H`` a conformer layer, per soft
token; frozen (LoRA) only the forward's :data:`AUDIO_FORWARD_BYTES` a
convolution value (fitted to XLA:TPU for v5e-4, cp = 4, towers of 1 and 3
layers at H = 1024, 20 and 60 s a row). FLOPs: ``6`` (frozen: ``2``) times
the tower's and ``embed_audio``'s parameters per soft token.

Video (``video_frames``: one video a row, ``N`` frames of ``P`` patches of
``F`` features and ``U = N T`` soft tokens, :meth:`StepShape.video`):
every device holds the step's whole ``pixel_values_videos`` and positions,
``B_g N P (4F + 8)`` (``B_g`` the step's rows over every batch shard).
E2B to 31B's tower runs on ``ceil(B_g N / cp)`` frames a rank, each frame
once across the ranks, and every rank gathers every frame's soft tokens,
``B_g U D a`` (with their float32 gradient when the tower trains). A
rank's frames hold their float32 patches and :data:`VISION_EMBED_VALUES`
values of ``H`` a patch (embedding, pooling), and a layer's
:data:`VISION_LAYER_VALUES` values of ``H`` a patch beside its float32
scores and probabilities, ``(4 + a) heads P^2``: every layer's when the
tower trains (with the encoder layers' float32 gradient),
:data:`VISION_FORWARD_LAYERS` of a layer's when it is frozen (LoRA). The
12B embeds the patch of each of a rank's ``L`` tokens and gathers no soft
token: a gather of ``B L F`` float32 from :data:`UNIFIED_PIXEL_COPIES`
copies of the patches, and :data:`UNIFIED_EMBED_VALUES` (frozen:
:data:`UNIFIED_FORWARD_VALUES`) values of its width ``E`` a token, with
the embedder's float32 gradient when it trains. FLOPs: ``6`` (frozen:
``2``) times the tower's parameters a patch and its attention's ``4 P^2
heads head_dim`` a layer, per frame; the 12B's embedder's parameters a
token.

The cast copy, table gradient, widest Dh and ring buffers are from XLA:TPU's
buffer report, and its live-range report at the backward's peak adds
:data:`TPU_PEAK_VALUES` float32 ``B * L * D`` (the residual stream's gradient
and its sum): 0.924x to 1.53x of it on the E2B slice (benchmarks/compile_targets.py).
For a GPU (``platform="cuda"``) XLA:GPU's live-range report adds about
:data:`GPU_LAYER_VALUES` float32 ``B * L * D`` a layer instead (norm outputs
and the MLP loop's, which XLA:TPU fuses into their consumers): 0.908x to
1.32x of XLA:GPU for 8 H200s on the same rows; under LoRA
:data:`GPU_LAYER_VALUES_LORA` (one-chip QLoRA steps of E2B and E4B).

Where CPU compilation differs from TPU / GPU: XLA:CPU has no
memory-space assignment or latency-hiding scheduler, so its temporaries are
a liveness-based upper estimate of what the TPU compiler schedules; it
keeps whole-program buffers live longer (no rematerialisation pass); and
on this jax (0.10) the CPU SPMD partitioner aborts on bfloat16 weight
gradients over an fsdp/tp axis inside the ring's shard_map, so the
compiled plan uses float32 activations (the estimate reports both).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from cpjax.attention.cp_context import parse_strategy
from cpjax.training import cp_strategy
from cpjax.training.lora.quantize import QUANTIZED_DTYPES, QUANTIZED_MODULES
from cpjax.training.plan.shape import SHARD_STATE, Plan, StepShape

if TYPE_CHECKING:
  from cpjax.models.gemma4.config import Gemma4Config
  from cpjax.training.run_config import RunConfig

__all__ = [
  "AUDIO_CONV_BYTES",
  "AUDIO_FORWARD_BYTES",
  "AUDIO_LAYER_VALUES",
  "DISPATCH_GPU",
  "GPU_LAYER_VALUES",
  "GPU_LAYER_VALUES_LORA",
  "LOSS_CHUNK_LOGITS",
  "MLP_TILE_VALUES",
  "PLATFORMS",
  "TPU_PEAK_VALUES",
  "UNIFIED_EMBED_VALUES",
  "UNIFIED_FORWARD_VALUES",
  "UNIFIED_PIXEL_COPIES",
  "VISION_EMBED_VALUES",
  "VISION_FORWARD_LAYERS",
  "VISION_LAYER_VALUES",
  "check_ep",
  "estimate",
  "lora_param_count",
]

LOSS_CHUNK_LOGITS = 1 << 26  # cpjax.training.loss.LOSS_CHUNK_LOGITS (plan imports no JAX)
MLP_TILE_VALUES = 1 << 23  # cpjax.models.gemma4.text.MLP_TILE_VALUES
PLATFORMS = ("tpu", "cuda")  # the compilers the closed form follows
# XLA:TPU's float32 [B, L, D] values at the backward's peak: the residual
# stream's gradient and the sum it is added into (the E2B slice's live-range
# report at S=131072 on fsdp=2 x cp=4, full fine-tuning in bfloat16).
TPU_PEAK_VALUES = 2
# XLA:GPU's float32 [B, L, D] values a layer beyond XLA:TPU's, fitted to the
# H200 column of benchmarks/compile_targets.py (within 10% of it, or above).
GPU_LAYER_VALUES = 4.5
# ... and under LoRA (no weight gradients), fitted to one-chip compiles with a
# 4-bit base and remat full: E2B at S = 65536 on an H100 (59.9 GiB) and 131072
# on an H200 (109), E4B at 32768 on an H100 (58.4); 2.8 puts each within 2%.
GPU_LAYER_VALUES_LORA = 2.8
# The audio tower's activations per soft token a rank (XLA:TPU, v5e-4, cp = 4,
# bfloat16 steps of a tiny decoder with E2B's tower at 1 and 3 layers, 20 and
# 60 s a row: the slopes of the temporaries in the clip's length). Training
# the tower: bytes a value of the first convolution's output (its activations,
# norms and their float32 gradients), and values of H a conformer layer keeps.
AUDIO_CONV_BYTES = 27
AUDIO_LAYER_VALUES = 40
# Frozen (LoRA): the forward's working set, bytes a first-convolution value:
# the largest of the same fits (1, 2 and 3 layers gave 1.9, 2.9 and 1.0; XLA
# schedules the transient differently each time), so that the plan errs high.
AUDIO_FORWARD_BYTES = 3
# The vision tower's activations on a rank's video frames, in values of H a
# patch (XLA:TPU, v5e-4, cp = 4, bfloat16 steps of a tiny decoder with
# E2B's tower at 1 and 3 layers, 16 and 32 frames of 630 patches a row: the
# slopes of the temporaries in the frames and the layers). Training the
# tower: each layer keeps 11.1 beside its scores, and the patch embedding
# and pooling 2.3; frozen (LoRA), the forward holds 0.51 of a layer's
# (0.52 at 3 layers: XLA frees each layer's scores as it goes). The last
# two are rounded up, so that the plan errs high there.
VISION_LAYER_VALUES = 11
VISION_EMBED_VALUES = 2.5
VISION_FORWARD_LAYERS = 0.55
# The 12B's embedder (XLA:TPU, v5e-4, cp = 4, bfloat16 steps of its tiny
# decoder with the published embedder, 0, 16 and 32 frames a row): values of
# its width E a token it keeps to train (4.2 fitted), or holds frozen (0.4);
# and the copies of the frames' patches, which XLA:TPU lays out again for
# the gather of each token's patch (1.86 fitted).
UNIFIED_EMBED_VALUES = 4.5
UNIFIED_FORWARD_VALUES = 0.5
UNIFIED_PIXEL_COPIES = 2
# XLA:GPU's buffers of the expert dispatch's size beyond the four it sends,
# receives, computes and returns, fitted to the 26B-A4B slice's H200 rows.
DISPATCH_GPU = 23


def _audio_params(cfg) -> int:
  """Parameters of the audio path: the tower (or the unified embedder) and ``embed_audio``."""
  return sum(n for p, n in _param_sizes(cfg).items() if "audio" in p)


def _audio(cfg, clip, *, rows: int, cp: int, a: int, trained: bool) -> tuple[float, float]:
  """(bytes a device, FLOPs a device) of each row's clip (the module's docstring)."""
  from cpjax.models.gemma4.audio_config import Gemma4AudioConfig

  frames, width, soft = clip
  d = cfg.text.hidden_size
  local = rows * soft / cp if rows < cp else -(-rows // cp) * soft
  here = rows * frames * (4 * width + 1) + rows * soft * d * (a + (4 if trained else 0))
  if isinstance(cfg.audio, Gemma4AudioConfig):
    conv = 2 * (width // 2) * cfg.audio.subsampling_conv_channels[0]
    if trained:
      layer = AUDIO_LAYER_VALUES * cfg.audio.hidden_size * a * cfg.audio.num_hidden_layers
      here += local * (AUDIO_CONV_BYTES * conv + layer)
    else:
      here += local * AUDIO_FORWARD_BYTES * conv
  return here, (6 if trained else 2) * _audio_params(cfg) * local


def _vision_params(cfg) -> tuple[int, int]:
  """Parameters of the vision path (the tower, or the 12B's embedder, and
  ``embed_vision``), and of the tower's encoder layers among them."""
  vision = {p: n for p, n in _param_sizes(cfg).items() if "vision" in p}
  return sum(vision.values()), sum(n for p, n in vision.items() if "['encoder']" in p)


def _video(
  cfg, video, *, rows: int, tokens: int, cp: int, a: int, trained: bool
) -> tuple[float, float]:
  """(bytes a device, FLOPs a device) of each row's video (the module's
  docstring): ``rows`` the step's rows over every batch shard, ``tokens``
  those a rank holds (its rows' share)."""
  frames, patches, features, soft = video
  n = rows * frames
  pixels = n * patches * (4 * features + 8)
  passes = 6 if trained else 2
  params, encoder = _vision_params(cfg)
  if cfg.unified:
    # Each rank gathers its own tokens' patches (one a token) and embeds
    # them: no soft token is made for, or gathered from, another rank.
    values = UNIFIED_EMBED_VALUES if trained else UNIFIED_FORWARD_VALUES
    here = UNIFIED_PIXEL_COPIES * pixels
    here += tokens * (4 * features + values * cfg.vision.mm_embed_dim * a)
    here += 4 * params if trained else 0  # the embedder's float32 gradient
    return here, passes * params * tokens
  # Every frame's soft tokens, gathered on every rank.
  here = rows * soft * cfg.text.hidden_size * (a + (4 if trained else 0))
  v = cfg.vision
  mine = -(-n // cp)  # frames a rank (each once across the ranks)
  layer = VISION_LAYER_VALUES * v.hidden_size * patches * a
  layer += (4 + a) * v.num_attention_heads * patches**2  # float32 scores, probabilities
  layers = v.num_hidden_layers if trained else VISION_FORWARD_LAYERS
  frame = 4 * patches * features + VISION_EMBED_VALUES * v.hidden_size * patches * a
  here += pixels + mine * (frame + layers * layer)
  here += 4 * encoder if trained else 0  # the encoder layers' float32 gradient
  attention = 4 * patches**2 * v.num_attention_heads * v.head_dim * v.num_hidden_layers
  return here, passes * (params * patches + attention) * mine


@functools.lru_cache(maxsize=8)
def _param_sizes(cfg) -> dict[str, int]:
  """``{path: values}`` of every parameter of the model."""
  import jax
  from flax import nnx

  params = nnx.state(_abstract_model(cfg), nnx.Param)
  return {
    jax.tree_util.keystr(p): int(np.prod(x.shape))
    for p, x in jax.tree_util.tree_leaves_with_path(params)
  }


@functools.lru_cache(maxsize=8)
def _abstract_model(cfg):
  """The model with abstract parameters (shapes only): seconds at a published
  size, so built once per config (and only read)."""
  from flax import nnx

  from cpjax.models.gemma4 import Gemma4
  from cpjax.parallel import abstract_model

  return abstract_model(lambda: Gemma4(cfg, rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=8)
def _count(cfg) -> tuple[int, int, int, int]:
  """(parameters, matmul parameters per text token, largest decoder layer's
  parameters, MoE experts' parameters)."""
  sizes = _param_sizes(cfg)
  total = sum(sizes.values())
  t = cfg.text
  layer = [0] * t.num_hidden_layers
  experts = 0
  for path, n in sizes.items():
    m = re.search(r"\['layers'\]\[(\d+)\]", path)
    if m and "language_model" in path:
      layer[int(m.group(1))] += n
      if "'experts'" in path:
        experts += n
  # Parameters a text token multiplies by: the decoder layers (only k of the
  # experts) and the head (the tied embedding, V x D); embedding lookups and
  # the vision tower (no images in a plan) do no matmul FLOPs.
  active = sum(layer) - (
    experts * (1 - t.top_k_experts / t.num_experts) if t.enable_moe_block else 0
  )
  active += t.vocab_size * t.hidden_size
  per_layer = sum(n for p, n in sizes.items() if "per_layer_model_projection" in p)
  return total, int(active + per_layer), max(layer), experts


@functools.lru_cache(maxsize=None)
def _projections(cfg) -> tuple[tuple[str, int, int], ...]:
  """(dotted module path, out, in) of every projection weight ([out, in])."""
  from flax import nnx

  from cpjax.models.gemma4.layers import Linear

  return tuple(
    (".".join(map(str, path)), m.weight.shape[0], m.weight.shape[1])  # [out, in]
    for path, m in nnx.iter_modules(_abstract_model(cfg))
    if isinstance(m, Linear)
  )


def lora_param_count(
  cfg: Gemma4Config,
  *,
  rank: int,
  targets: str | tuple[str, ...] | None = None,
  target_parameters: str | tuple[str, ...] | None = None,
) -> int:
  """Count the adapter values of rank ``rank`` on what ``targets`` and ``target_parameters`` match.

  ``r * (in + out)`` a projection, ``E * r * (in + out)`` an expert tensor.

  Args:
    cfg: the :class:`Gemma4Config`.
    rank: the adapters' rank.
    targets: the projections to adapt (default
      :data:`cpjax.training.lora.DEFAULT_LORA_TARGETS`).
    target_parameters: the expert tensors to adapt (default
      :data:`cpjax.training.lora.DEFAULT_LORA_PARAMETERS`).

  Returns:
    The number of adapter values.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> lora_param_count(Gemma4Config.preset("tiny"), rank=4)
  24320
  """
  return sum(_lora_counts(cfg, rank, targets, target_parameters))


def _quantized_base(
  cfg: Gemma4Config, base_dtype: str, group_size: int | None, a: int, shards: tuple[int, int]
) -> tuple[float, float]:
  """A quantized base's bytes a quantized value, and its bytes a device.

  The decoder's projections and the experts at ``q`` bytes a value (1 for
  int8 and float8, 1/2 for 4 bits: the values' own size, as the chips'
  compilers hold them) and
  one scale a group (an output channel without ``group_size``): a
  projection's in the activations' dtype (``a`` bytes: qwix quantizes the
  weight as the projection casts it), an expert's in bfloat16, as the rest;
  split over ``shards`` (the state's, the experts').
  """
  q = 0.5 if base_dtype in ("int4", "nf4") else 1.0
  weights = [
    (1, out, inp) for path, out, inp in _projections(cfg) if re.fullmatch(QUANTIZED_MODULES, path)
  ]
  t = cfg.text
  experts: list[tuple[int, int, int]] = []
  if t.enable_moe_block:
    assert t.num_experts is not None and t.moe_intermediate_size is not None
    e, d, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
    experts = [(e, 2 * i, d), (e, d, i)] * t.num_hidden_layers

  def nbytes(e: int, out: int, inp: int, scale: int) -> float:
    return e * out * (inp * q + scale * (inp // (group_size or inp)))

  rest = _count(cfg)[0] - sum(e * o * i for e, o, i in weights + experts)
  here = (2 * rest + sum(nbytes(e, o, i, a) for e, o, i in weights)) / shards[0]
  # The experts are quantized as stored (bfloat16), not as a projection casts them.
  return q, here + sum(nbytes(e, o, i, 2) for e, o, i in experts) / shards[1]


def _lora_counts(cfg: Gemma4Config, rank: int, targets, target_parameters) -> tuple[int, int]:
  """Adapter values on the projections and on the expert tensors."""
  from cpjax.training.lora import DEFAULT_LORA_PARAMETERS, DEFAULT_LORA_TARGETS, LoraConfig

  settings = LoraConfig(
    rank=rank,
    targets=DEFAULT_LORA_TARGETS if targets is None else targets,
    target_parameters=DEFAULT_LORA_PARAMETERS if target_parameters is None else target_parameters,
  )
  on_projections = sum(
    rank * (out + inp) for path, out, inp in _projections(cfg) if settings.matches(path)
  )
  t = cfg.text
  on_experts = 0
  if t.enable_moe_block:
    assert t.num_experts is not None and t.moe_intermediate_size is not None
    e, d, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
    for layer in range(t.num_hidden_layers):
      prefix = f"model.language_model.layers.{layer}.experts."
      for name, out, inp in (("gate_up_proj", 2 * i, d), ("down_proj", d, i)):
        if settings.matches_parameter(prefix + name):
          on_experts += e * rank * (out + inp)
  return on_projections, on_experts


def estimate(
  cfg: Gemma4Config,
  shape: StepShape | RunConfig | None = None,
  *,
  model: str,
  platform: str = "tpu",
  device_memory: int | None = None,
  **settings: Any,
) -> Plan:
  """Estimate the plan with the closed form of the module docstring.

  Args:
    cfg: the :class:`Gemma4Config`.
    shape: the step (:class:`StepShape`), or a run config to take it from.
    model: the model's name in the plan.
    platform: the compiler it follows, ``"tpu"`` or ``"cuda"``, a
      :class:`~cpjax.training.targets.Chip`'s.
    device_memory: the bytes of one device, for the strategy rule's
      ``"auto"`` (:meth:`StepShape.strategies`).
    **settings: :class:`StepShape` fields, over ``shape``'s (or the whole
      shape without one: ``seq_len=..., mesh=...``). The CP strategy's
      whole-row K/V (all-gather, repeated Ulysses) is added at the worst
      layer (:func:`cpjax.training.cp_strategy.row_buffer`), and the loss's
      all-gather holds the row's hidden states and their float32 gradient
      where the ring holds two ranks' worth.

  Returns:
    The :class:`Plan`.
  """
  step = StepShape.take(shape, settings)
  if step.mesh is None:
    raise ValueError("estimate needs a mesh: give StepShape.mesh (or search one: best_mesh)")
  seq_len, mesh, remat, dtype = step.seq_len, dict(step.mesh), step.remat, step.dtype
  batch_size, lora_rank, lora_targets = step.batch_size, step.lora_rank, step.lora_targets
  base_dtype, capacity_factor, shard_state = step.base_dtype, step.capacity_factor, step.shard_state
  chosen = step.strategies(cfg.text, device_memory=device_memory)
  strategy, loss_strategy = chosen["strategy"], chosen["loss_strategy"]
  if shard_state not in SHARD_STATE:
    raise ValueError(f"shard_state must be one of {SHARD_STATE}, got {shard_state!r}")
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
  t = cfg.text
  fsdp = mesh.get("fsdp", 1) * mesh.get("dp", 1)
  cp, tp, ep = mesh.get("cp", 1), mesh.get("tp", 1), mesh.get("ep", 1)
  over_cp = shard_state == "fsdp+cp" and cp > 1
  # The devices one copy of the state is split over.
  token_shards = mesh.get("fsdp", 1) * (cp if over_cp else 1)
  shards = token_shards * tp
  rows = (batch_size or fsdp) // fsdp
  a = 2 if dtype == "bfloat16" else 4
  n, active, largest, all_experts = _count(cfg)
  # Expert parallelism (cpjax.models.gemma4.experts): the experts split ep ways (and over
  # fsdp too when ep folds onto cp alone, then gathered per group).
  if ep > 1:
    check_ep(cfg, mesh)
  experts = all_experts if ep > 1 else 0
  # ep's axes, and the token axes it leaves, which store each group's share.
  expert_shards = token_shards if over_cp else ep * (mesh.get("fsdp", 1) if ep == cp else 1)
  local = seq_len // cp
  heads, kv, dh = t.num_attention_heads / tp, max(t.num_key_value_heads / tp, 1), t.head_dim
  dense = max(t.mlp_size(i) for i in range(t.num_hidden_layers))
  # Both are set whenever enable_moe_block is (Gemma4TextConfig checks it).
  top_k, moe_width = t.top_k_experts or 0, t.moe_intermediate_size or 0
  routed = top_k * moe_width / tp if t.enable_moe_block else 0
  width = dense / tp + routed
  d, layers, ple = t.hidden_size, t.num_hidden_layers, t.hidden_size_per_layer_input or 0
  base = 2 if base_dtype == "bfloat16" else 4
  stored = (n - experts) / shards + experts / expert_shards  # values per device
  if lora_rank is None:
    base, trained = 4, n
    params = 4 * stored
    optimizer, grads = 8 * stored + 4, 4 * stored  # + step count
  else:
    on_projections, on_experts = _lora_counts(
      cfg, lora_rank, lora_targets, step.lora_target_parameters
    )
    trained = on_projections + on_experts
    # Expert adapters are stored as their experts are.
    adapters_here = on_projections / shards + on_experts / (expert_shards if ep > 1 else shards)
    if base_dtype in QUANTIZED_DTYPES:
      base, frozen_here = _quantized_base(
        cfg, base_dtype, step.group_size, a, (shards, expert_shards if ep > 1 else shards)
      )
    else:
      frozen_here = base * stored
    params = frozen_here + 4 * adapters_here
    optimizer, grads = 8 * adapters_here + 4, 4 * adapters_here
  if cp > 1 and not over_cp:
    grads *= 2  # the sum over the cp ranks is a second buffer
  # A gathered weight in its stored dtype, and its cast copy for compute.
  cast = base + (a if a != base else 0)
  gathered = cast * (largest - experts / layers) if shards > 1 else 0
  if experts and expert_shards > ep:  # fsdp shards each group's experts: gathered where used
    gathered += cast * experts / layers / ep
  if t.enable_moe_block:
    # Dispatch buffers, sent, received, computed and returned: ep blocks of
    # T * k rows when no token may be dropped, c * T * k rows in all with a
    # capacity factor c; without ep, the T * k rows sorted by expert, their
    # products and their way back, the same four of one block.
    blocks = 1 if ep == 1 else ep if capacity_factor is None else min(ep, capacity_factor)
    dispatch = blocks * rows * local * top_k * d  # values a buffer
    # Their transposes in the backward hold more of that size (the 26B-A4B
    # slice's buffer reports): XLA:TPU four in float32, XLA:GPU (each zero
    # fill and copy its own buffer) about DISPATCH_GPU in the activations'.
    gathered += (4 * a + (DISPATCH_GPU * a if platform == "cuda" else 4 * 4)) * dispatch
  full_row = 3 * rows * seq_len * 4
  if remat == "none":
    saved = layers * rows * local * (4 * d + 2 * (heads + 2 * kv) * dh + 3 * width) * a
  else:
    saved = layers * rows * local * (d + ple) * a
    if remat == "save_attention_out":
      saved += layers * rows * local * heads * dh * a
  # The dense MLP's intermediates for one tile of tokens (the whole row when
  # short; the tile counts the MLP's whole width, as the model does); the
  # experts' for every token.
  tile = 1 << max(0, (MLP_TILE_VALUES // (rows * dense)).bit_length() - 1)
  widest = max(t.layer_head_dim(i) for i in range(layers))
  working = (
    2
    * rows
    * (
      local * (2 * heads * widest + 4 * kv * widest + 3 * routed)
      + min(local, tile) * 3 * dense / tp
    )
    * a
  )
  chunk = max(16, min(4096, LOSS_CHUNK_LOGITS // t.vocab_size))
  logits = 4 * chunk * t.vocab_size / shards * 4 + rows * local * 4
  if over_cp:
    # The head split over cp: the tokens travel the cp ring, two ranks'
    # worth in flight (this hop's and the next's), with their labels and
    # log-sum-exps and, in the backward, their float32 d hidden; or the
    # all-gather holds the whole row's (the loss's auto: while it fits the
    # CP strategy rule's share, as cpjax.training.loss.cross_entropy).
    gathered_row = rows * seq_len * d * (a + 4)
    if loss_strategy == "all_gather" or (
      loss_strategy == "auto" and cp_strategy.row_fits(gathered_row)
    ):
      logits += rows * seq_len * (d * a + 4 * d + 4 + 4)
    else:
      logits += 2 * rows * local * (d * a + 4 * d + 4 + 4)
  # The ring's float32 hop results and accumulators in a layer's backward,
  # at the widest head: forward out and dq [B, L, H, Dh], dk and dv [B, L, Hkv, Dh].
  ring = 4 * rows * local * widest * 4 * (heads + kv)
  ring += rows * _row_buffers(t, strategy, seq_len=seq_len, cp=cp, tp=tp, itemsize=a)
  # Full fine-tuning: the lookups' transposes make the tables' gradient in
  # float32 beside the one it is added into (one more table-sized buffer).
  tables_grad = 4 * t.vocab_size * (d + ple * layers) / shards if lora_rank is None else 0
  # XLA:GPU keeps float32 [B, L, D] values of every layer into the backward
  # that XLA:TPU fuses away: its norms' multi-output fusions and the MLP
  # loop's output and copies (its live-range report at the peak).
  if platform == "cuda":
    values = GPU_LAYER_VALUES if lora_rank is None else GPU_LAYER_VALUES_LORA
    peak = values * 4 * layers * rows * local * d
  else:
    peak = TPU_PEAK_VALUES * 4 * rows * local * d
  activations = grads + gathered + ring + tables_grad + full_row + saved + working + logits + peak
  clip = step.audio(cfg)
  audio_bytes, audio_flops = 0.0, 0.0
  if clip is not None:
    audio_bytes, audio_flops = _audio(
      cfg, clip, rows=rows * fsdp, cp=cp, a=a, trained=lora_rank is None
    )
  activations += audio_bytes
  video = step.video(cfg)
  video_bytes, video_flops = 0.0, 0.0
  if video is not None:
    video_bytes, video_flops = _video(
      cfg, video, rows=rows * fsdp, tokens=rows * local, cp=cp, a=a, trained=lora_rank is None
    )
  activations += video_bytes
  tokens = rows * local
  passes = 6 if lora_rank is None else 4  # forward, input and (full) weight gradients
  matmul = (passes + (2 if remat != "none" else 0)) * active * tokens / tp
  if lora_rank is not None:
    matmul += 6 * trained * tokens / tp
  attention = 0.0
  for i in range(layers):
    visible = seq_len / 2 if t.is_full(i) else min(t.effective_sliding_window, seq_len)
    attention += 4 * tokens * visible * t.num_attention_heads / tp * t.layer_head_dim(i)
  flops = matmul + attention * (4 if remat != "none" else 3) + audio_flops + video_flops
  return Plan(
    model,
    seq_len,
    dict(mesh),
    remat,
    dtype,
    params,
    optimizer,
    activations,
    params + optimizer + activations,
    flops,
    "estimate",
    lora_rank,
    base_dtype if lora_rank is not None else "float32",
  )


def _row_buffers(text, strategy, *, seq_len: int, cp: int, tp: int, itemsize: int) -> int:
  """The worst layer kind's whole-row K/V under ``strategy`` (one or per kind)."""
  strategy = parse_strategy(strategy)
  chosen = {} if isinstance(strategy, str) else dict(strategy)
  return max(
    cp_strategy.row_buffer(
      text,
      kind,
      strategy if isinstance(strategy, str) else chosen.get(kind, "ring"),
      seq_len=seq_len,
      cp=cp,
      tp=tp,
      itemsize=itemsize,
    )
    for kind in sorted(set(text.layer_types))
  )


def check_ep(cfg: Gemma4Config, mesh: dict) -> None:
  """Raise a ``ValueError`` unless ``mesh["ep"]`` folds onto its token axes (as
  :func:`cpjax.parallel.expert_axes`) and divides the experts; sizes only."""
  t, ep = cfg.text, mesh["ep"]
  if not t.enable_moe_block:
    raise ValueError(f"ep={ep} needs a mixture of experts; this Gemma 4 has none")
  if t.num_experts % ep:
    raise ValueError(f"ep={ep} does not divide the {t.num_experts} experts")
  if mesh.get("tp", 1) > 1:
    raise ValueError(f"ep={ep} does not combine with tp={mesh['tp']}")
  cp, rows = mesh.get("cp", 1), mesh.get("fsdp", 1) * mesh.get("dp", 1)
  if ep not in (cp, rows, cp * rows):
    raise ValueError(
      f"ep={ep} must equal the size of the token axes it folds onto: cp = {cp}, "
      f"the batch axis = {rows} or both = {cp * rows}"
    )
