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
out)`` per targeted projection). The frozen base takes ``b N / s`` (``b``:
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
dropped: each device's block for each group has room for all its pairs), and
its backward four more in float32 on XLA:TPU, :data:`DISPATCH_GPU` more on
XLA:GPU (the 26B-A4B slice, 2 layers, S = 8192 and 32768 on fsdp=2 x cp=4,
ep=8, judged on a v5p-16 and 8 H200s: benchmarks/compile_targets.py
--model a4b-slice).

The cast copy, table gradient, widest Dh and ring buffers are from XLA:TPU's
buffer report, and its live-range report at the backward's peak adds
:data:`TPU_PEAK_VALUES` float32 ``B * L * D`` (the residual stream's gradient
and its sum): 0.924x to 1.53x of it on the E2B slice (benchmarks/compile_targets.py).
For a GPU (``platform="cuda"``) XLA:GPU's live-range report adds about
:data:`GPU_LAYER_VALUES` float32 ``B * L * D`` a layer instead (norm outputs
and the MLP loop's, which XLA:TPU fuses into their consumers): 0.908x to
1.32x of XLA:GPU for 8 H200s on the same rows.

Where CPU compilation differs from TPU / GPU: XLA:CPU has no
memory-space assignment or latency-hiding scheduler, so its temporaries are
a liveness-based upper estimate of what the TPU compiler schedules; it
keeps whole-program buffers live longer (no rematerialisation pass); and
on this jax (0.10) the CPU SPMD partitioner aborts on bfloat16 weight
gradients over an fsdp/tp axis inside the ring's shard_map, so the
compiled plan uses float32 activations (the estimate reports both).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import typing

import numpy as np

from cpjax.attention.cp_context import parse_strategy
from cpjax.training import cp_strategy, hlo
from cpjax.training.run_config import ShardState, state_axes
from cpjax.training.step_time import StepTime, step_time
from cpjax.training.targets import collective_bytes

__all__ = [
  "Plan",
  "SMALLER_SLICE_SLACK",
  "TooLarge",
  "best_mesh",
  "collective_bytes",
  "compile_step",
  "compiled_plan",
  "estimate",
  "format_bytes",
  "lora_param_count",
  "parse_bytes",
  "smallest_mesh",
  "smallest_slice",
]

GiB = 2**30
SHARD_STATE = typing.get_args(ShardState)  # cpjax train --shard-state's choices
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
# XLA:GPU's buffers of the expert dispatch's size beyond the four it sends,
# receives, computes and returns, fitted to the 26B-A4B slice's H200 rows.
DISPATCH_GPU = 23
_UNITS = {
  "": 1,
  "b": 1,
  "kib": 2**10,
  "mib": 2**20,
  "gib": GiB,
  "tib": 2**40,
  "kb": 10**3,
  "mb": 10**6,
  "gb": 10**9,
  "tb": 10**12,
}


def parse_bytes(text: str) -> int:
  """Parse a byte count: ``"16GiB"`` -> 17179869184.

  Args:
    text: the byte count with its unit.

  Returns:
    The bytes.

  >>> parse_bytes("95GiB") / 2**30, parse_bytes("141 GiB") / 2**30
  (95.0, 141.0)
  """
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not match or match.group(2).lower() not in _UNITS:
    raise ValueError(f"device memory must look like 16GiB, 95GiB or 141GiB, got {text!r}")
  return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
  """Format bytes in the largest binary unit that keeps three significant digits.

  Args:
    n: the bytes.

  Returns:
    The formatted bytes.

  >>> format_bytes(95 * 10**9), format_bytes(95 * 2**30), format_bytes(3.1 * 2**20)
  ('88.5 GiB', '95 GiB', '3.10 MiB')
  """
  for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      value = n / size
      if value == int(value):
        return f"{int(value)} {unit}"
      return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f} {unit}"
  return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes of one training step (and its FLOPs per device)."""

  model: str
  seq_len: int
  mesh: dict
  remat: str
  dtype: str
  params: float
  optimizer: float
  activations: float  # everything else: temporaries, gradients, batch
  total: float
  flops: float  # NaN where the compiler gives none (XLA:GPU without a device)
  source: str  # "estimate", "compiled" (XLA:CPU) or a target ("v5e-8")
  lora_rank: int | None = None  # None: every weight trained
  base_dtype: str = "float32"  # the frozen base's storage under LoRA
  collectives: dict = dataclasses.field(default_factory=dict)  # compiled: {kind: bytes}
  # The target's compiler refused the step past the chip's memory: ``total``
  # and ``activations`` are lower bounds (what it named), ``flops`` NaN.
  refused: bool = False
  # The step time the compiled program implies on the target's chip
  # (cpjax.training.step_time); None without a target, or where it was refused.
  step: StepTime | None = None

  def fits(self, device_memory: int) -> bool:
    """Return whether the step's total bytes fit one device's memory.

    Args:
      device_memory: the memory of one device, in bytes.

    Returns:
      True when ``total <= device_memory`` and the compiler did not refuse it.
    """
    return not self.refused and self.total <= device_memory

  @property
  def training(self) -> str:
    """``"full"`` or ``"LoRA r=16 (bfloat16 base)"``."""
    if self.lora_rank is None:
      return "full"
    return f"LoRA r={self.lora_rank} ({self.base_dtype} base)"

  def row(self) -> str:
    """Return the plan as one table row: model, length, mesh, source, bytes and TFLOP.

    Returns:
      The row.
    """
    mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
    flops = "      n/a" if math.isnan(self.flops) else f"{self.flops / 1e12:9.3g}"
    over = "> " if self.refused else ""  # a refusal's figures are lower bounds
    return (
      f"{self.model:>4} S={self.seq_len:<7d} {mesh:<18} {self.source:<8} "
      f"params {format_bytes(self.params):>9}  optimizer {format_bytes(self.optimizer):>9}"
      f"  activations+temp {over + format_bytes(self.activations):>9}  total "
      f"{over + format_bytes(self.total):>9}  {flops} TFLOP/device"
    )


@functools.lru_cache(maxsize=8)
def run_shape(run) -> dict:
  """Return what a run config fixes of its step, as :func:`estimate`'s keywords.

  The plan of a run is the plan of one step: one microbatch's rows.

  Args:
    run: a :class:`cpjax.training.run_config.RunConfig`.

  Returns:
    ``seq_len``, ``mesh``, ``remat``, ``dtype``, ``batch_size``, ``lora_rank``,
    ``base_dtype``, ``lora_targets``, ``capacity_factor`` and ``shard_state``;
    :func:`compiled_plan` takes the same.

  Example:
    >>> from cpjax.training.run_config import RunConfig, with_values
    >>> run = with_values(RunConfig(), {"dataset.batch_size": 4, "dataset.microbatches": 2})
    >>> run_shape(run)["batch_size"]
    2
  """
  return dict(
    seq_len=run.dataset.seq_len,
    mesh=run.parallel.mesh_sizes(),
    remat=run.remat,
    dtype=run.dtype,
    batch_size=run.dataset.batch_size // run.dataset.microbatches,
    lora_rank=run.lora.rank,
    base_dtype=run.lora.base_dtype,
    lora_targets=run.lora.targets,
    capacity_factor=run.experts.capacity_factor,
    shard_state=run.parallel.shard_state,
  )


def compiled_bytes(compiled) -> int:
  """Return a compiled program's memory per device, as its compiler counts it.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).

  Returns:
    Bytes: arguments + outputs - outputs aliased to (donated) arguments +
    temporaries, from ``compiled.memory_analysis()``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.zeros(256, jnp.float32)).compile()
    >>> compiled_bytes(compiled) >= 2 * 256 * 4   # the argument and the output
    True
  """
  memory = compiled.memory_analysis()
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )


def _abstract_model(cfg):
  """The model with abstract parameters (shapes only): seconds at a published
  size, so built once per config."""
  from flax import nnx

  from cpjax.models.gemma4 import Gemma4

  return nnx.eval_shape(lambda: Gemma4(cfg, rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=8)
def _count(cfg) -> tuple[int, int, int, int]:
  """(parameters, matmul parameters per text token, largest decoder layer's
  parameters, MoE experts' parameters)."""
  import jax
  from flax import nnx

  params = nnx.state(_abstract_model(cfg), nnx.Param)
  sizes = {
    jax.tree_util.keystr(p): int(np.prod(x.shape))
    for p, x in jax.tree_util.tree_leaves_with_path(params)
  }
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
    (".".join(map(str, path)), *m.weight.shape)
    for path, m in nnx.iter_modules(_abstract_model(cfg))
    if isinstance(m, Linear)
  )


def lora_param_count(cfg, *, rank: int, targets: str | None = None) -> int:
  """Count the adapter values of rank ``rank`` on the projections ``targets`` matches.

  ``r * (in + out)`` each.

  Args:
    cfg: the :class:`Gemma4Config`.
    rank: the adapters' rank.
    targets: the projections to adapt (default
      :data:`cpjax.training.lora.DEFAULT_LORA_TARGETS`).

  Returns:
    The number of adapter values.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> lora_param_count(Gemma4Config.preset("tiny"), rank=4)
  24320
  """
  from cpjax.training.lora import DEFAULT_LORA_TARGETS, LoraConfig

  settings = LoraConfig(rank=rank, targets=targets or DEFAULT_LORA_TARGETS)
  return sum(rank * (out + inp) for path, out, inp in _projections(cfg) if settings.matches(path))


def estimate(
  cfg,
  *,
  model: str,
  seq_len: int,
  mesh: dict,
  remat: str = "full",
  batch_size: int | None = None,
  dtype: str = "bfloat16",
  lora_rank: int | None = None,
  base_dtype: str = "float32",
  lora_targets: str | None = None,
  capacity_factor: float | None = None,
  shard_state: str = "fsdp+cp",
  platform: str = "tpu",
  strategy="ring",
  loss_strategy: str = "ring",
) -> Plan:
  """Estimate the plan with the closed form of the module docstring.

  Args:
    cfg: the :class:`Gemma4Config`.
    model: the model's name in the plan.
    seq_len: the row length ``S``.
    mesh: ``{axis: size}`` (``ep`` included).
    remat: the per-layer rematerialisation.
    batch_size: rows per batch (default: one per batch shard).
    dtype: the activations' dtype.
    lora_rank: LoRA with ``lora_rank``; None: full fine-tuning.
    base_dtype: the frozen base's storage under LoRA.
    lora_targets: the projections LoRA adapts.
    capacity_factor: as :mod:`cpjax.models.gemma4.experts`.
    shard_state: as ``cpjax train --shard-state``: the state over ``fsdp x cp``
      or whole over ``cp``.
    platform: the compiler it follows, ``"tpu"`` or ``"cuda"``, a
      :class:`~cpjax.training.targets.Chip`'s.
    strategy: the CP strategy, one or per layer kind (as
      :func:`cpjax.training.make_train_step`'s): the all-gather's and
      repeated Ulysses' whole-row K/V are added at the worst layer
      (:func:`cpjax.training.cp_strategy.row_buffer`).
    loss_strategy: as :func:`cpjax.training.make_train_step`'s: the loss's
      all-gather holds the row's hidden states and their float32 gradient
      where the ring holds two ranks' worth.

  Returns:
    The :class:`Plan`.
  """
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
    _check_ep(cfg, mesh)
  experts = all_experts if ep > 1 else 0
  # ep's axes, and the token axes it leaves, which store each group's share.
  expert_shards = token_shards if over_cp else ep * (mesh.get("fsdp", 1) if ep == cp else 1)
  local = seq_len // cp
  heads, kv, dh = t.num_attention_heads / tp, max(t.num_key_value_heads / tp, 1), t.head_dim
  dense = max(t.mlp_size(i) for i in range(t.num_hidden_layers))
  routed = t.top_k_experts * t.moe_intermediate_size / tp if t.enable_moe_block else 0
  width = dense / tp + routed
  d, layers, ple = t.hidden_size, t.num_hidden_layers, t.hidden_size_per_layer_input or 0
  base = 2 if base_dtype == "bfloat16" else 4
  stored = (n - experts) / shards + experts / expert_shards  # values per device
  if lora_rank is None:
    base, trained = 4, n
    params = 4 * stored
    optimizer, grads = 8 * stored + 4, 4 * stored  # + step count
  else:
    trained = lora_param_count(cfg, rank=lora_rank, targets=lora_targets)
    params = base * stored + 4 * trained / shards
    optimizer, grads = 8 * trained / shards + 4, 4 * trained / shards
  if cp > 1 and not over_cp:
    grads *= 2  # the sum over the cp ranks is a second buffer
  # A gathered weight in its stored dtype, and its cast copy for compute.
  cast = base + (a if a != base else 0)
  gathered = cast * (largest - experts / layers) if shards > 1 else 0
  if experts and expert_shards > ep:  # fsdp shards each group's experts: gathered where used
    gathered += cast * experts / layers / ep
  if ep > 1:
    # Dispatch buffers, sent, received, computed and returned: ep blocks of
    # T * k rows when no token may be dropped, c * T * k rows in all with a
    # capacity factor c.
    blocks = ep if capacity_factor is None else min(ep, capacity_factor)
    dispatch = blocks * rows * local * t.top_k_experts * d  # values a buffer
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
    peak = GPU_LAYER_VALUES * 4 * layers * rows * local * d
  else:
    peak = TPU_PEAK_VALUES * 4 * rows * local * d
  activations = grads + gathered + ring + tables_grad + full_row + saved + working + logits + peak
  tokens = rows * local
  passes = 6 if lora_rank is None else 4  # forward, input and (full) weight gradients
  matmul = (passes + (2 if remat != "none" else 0)) * active * tokens / tp
  if lora_rank is not None:
    matmul += 6 * trained * tokens / tp
  attention = 0.0
  for i in range(layers):
    visible = seq_len / 2 if t.is_full(i) else min(t.effective_sliding_window, seq_len)
    attention += 4 * tokens * visible * t.num_attention_heads / tp * t.layer_head_dim(i)
  flops = matmul + attention * (4 if remat != "none" else 3)
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


def _check_ep(cfg, mesh: dict) -> None:
  """``ValueError`` unless ``mesh["ep"]`` folds onto its token axes (as
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


def compile_step(
  cfg,
  *,
  seq_len: int,
  mesh: dict,
  remat: str = "full",
  batch_size: int | None = None,
  dtype: str = "float32",
  lora_rank: int | None = None,
  base_dtype: str = "float32",
  lora_targets: str | None = None,
  capacity_factor: float | None = None,
  shard_state: str = "fsdp+cp",
  devices=None,
  strategy="ring",
  loss_strategy: str = "ring",
):
  """Compile the training step of ``cfg`` abstractly (no array is made) on ``prod(mesh)`` devices.

  The batch is laid out on as many CPU devices (its shapes and shardings only).

  Args:
    cfg: the :class:`Gemma4Config`.
    seq_len, remat, batch_size, dtype, lora_rank, base_dtype, lora_targets,
      shard_state: as :func:`estimate`.
    mesh: ``{axis: size}``; it may carry ``ep`` (:func:`cpjax.parallel.expert_axes`).
    capacity_factor: as :mod:`cpjax.models.gemma4.experts`.
    devices: the devices to compile for, by default the process's own
      (``cpjax plan`` sets ``jax_num_cpu_devices`` before JAX starts); or a
      target's compile-only ones (:meth:`cpjax.training.targets.Target.devices`),
      which compile with their own chip's kernels and compiler.
    strategy, loss_strategy: the CP strategies of attention and of the
      loss, as :func:`cpjax.training.make_train_step` takes them (``cpjax
      plan`` passes its rule's choice and ``"auto"``, as ``cpjax train`` does).

  Returns:
    ``(compiled TrainStep, params, opt_state, frozen base or None)``, the
    state as sharded ``ShapeDtypeStruct`` s.

  Raises:
    TooLarge: the target's compiler (XLA:TPU) refused it past the chip's memory.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding

  from cpjax import parallel, training
  from cpjax.attention.ring.kernels import mesh_platform, resolve_implementation
  from cpjax.models.gemma4 import Gemma4
  from cpjax.models.gemma4.partitioning import check_mesh, partition_rule

  count = math.prod(v for k, v in mesh.items() if k != "ep")
  if devices is not None and len(devices) != count:
    raise ValueError(
      f"mesh {mesh} has {count} devices, the target has {len(devices)}: give a "
      f"mesh of {len(devices)}"
    )
  if jax.device_count() < count:  # (a target's batch is laid out on as many)
    raise ValueError(f"mesh {mesh} needs {count} devices, this process has {jax.device_count()}")
  sizes = {k: v for k, v in mesh.items() if k != "ep"}
  grid = parallel.make_mesh(**sizes, devices=devices)
  # A compile-only device holds no array: the batch is laid out on a CPU mesh
  # of the same axes, and only its shapes and shardings cross over.
  host = grid if devices is None else parallel.make_mesh(**sizes)
  ep = mesh.get("ep", 1)
  expert_axes = parallel.expert_axes(grid, ep)
  batch_axis = parallel.batch_axis_of(grid)
  rows = batch_size or (grid.shape[batch_axis] if batch_axis else 1)
  check_mesh(cfg, grid, seq_len=seq_len, batch_size=rows, ep=ep)
  compute = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  storage = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[base_dtype]
  if lora_rank is None:
    abstract = nnx.eval_shape(lambda: Gemma4(cfg, rngs=nnx.Rngs(0), dtype=compute, remat=remat))
    graphdef, params, frozen = nnx.split(abstract, nnx.Param, ...)
  else:
    # The adapters are made by running the model: abstractly here too.
    from cpjax.training import lora

    abstract = nnx.eval_shape(
      lambda: lora.apply_lora(
        Gemma4(cfg, rngs=nnx.Rngs(0), dtype=compute, remat=remat, param_dtype=storage),
        lora.LoraConfig(rank=lora_rank, targets=lora_targets or lora.DEFAULT_LORA_TARGETS),
      )
    )
    graphdef, params, frozen = lora.split_lora(abstract)
  rule = partition_rule(cfg, tp=mesh.get("tp", 1), expert_axes=expert_axes)

  def placed(tree):
    specs = parallel.param_specs(tree, grid, rule=rule, state_axes=state_axes(shard_state))
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(grid, s)),
      tree,
      specs,
    )

  params, frozen = placed(params), placed(frozen)
  optimizer = optax.adamw(1e-4)
  opt_state = parallel.shard_like_params(jax.eval_shape(optimizer.init, params), params)
  text = {
    "input_ids": np.ones((rows, seq_len), np.int32),
    "labels": np.ones((rows, seq_len), np.int32),
  }
  sharder = Gemma4.prepare_model_inputs_for_cp(abstract, layout="load_balanced")["cp_sharder"]
  kernels = resolve_implementation(None, platform=mesh_platform(grid))
  batch, layout = sharder.shard_batch(text, host, batch_axis=batch_axis, implementation=kernels)
  if host is not grid:
    batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(grid, x.sharding.spec)
      ),
      batch,
    )
  step = training.make_train_step(
    graphdef,
    optimizer,
    mesh=grid,
    layout=layout,
    frozen=frozen,
    expert_axes=expert_axes,
    capacity_factor=capacity_factor,
    strategy=strategy,
    loss_strategy=loss_strategy,
  )
  base = None
  if lora_rank is not None:
    base = placed(nnx.split(abstract, nnx.LoRAParam, nnx.Param, ...)[2])
  try:
    compiled = step.compile(params, opt_state, batch)
  except jax.errors.JaxRuntimeError as e:
    refusal = _hbm_refusal(str(e))
    if refusal is None:
      raise
    raise TooLarge(str(e), *refusal, params, opt_state, base) from e
  return compiled, params, opt_state, base


# XLA:TPU refuses a program past the chip's HBM in one of two words: what
# its temporaries alone need, or what the whole program used.
_HBM_REFUSALS = (
  ("temporaries", re.compile(r"required for HLO temporaries \(([0-9.]+)([KMGT])\) exceeds")),
  ("total", re.compile(r"Ran out of memory in memory space hbm\. Used ([0-9.]+)([KMGT]) of")),
)
_SUFFIX = {"K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}


def _hbm_refusal(message: str) -> tuple[float, str] | None:
  """(bytes, "temporaries" or "total") of an XLA:TPU refusal past HBM; None otherwise."""
  for what, pattern in _HBM_REFUSALS:
    found = pattern.search(message)
    if found:
      return float(found.group(1)) * _SUFFIX[found.group(2)], what
  return None


class TooLarge(RuntimeError):
  """A target's compiler refused the step: it needs more than the chip's memory.

  Attributes:
    needed: the bytes the compiler named.
    what: what they count: ``"temporaries"`` (the temporaries alone) or
      ``"total"`` (the whole program).
    params, opt_state, base: the abstract state it was compiled for (as
      :func:`compile_step` returns them).
  """

  def __init__(self, message: str, needed: float, what: str, params, opt_state, base):
    super().__init__(message)
    self.needed, self.what = needed, what
    self.params, self.opt_state, self.base = params, opt_state, base


def compiled_plan(
  cfg,
  *,
  model: str,
  seq_len: int,
  mesh: dict,
  remat: str = "full",
  batch_size: int | None = None,
  dtype: str = "float32",
  lora_rank: int | None = None,
  base_dtype: str = "float32",
  lora_targets: str | None = None,
  capacity_factor: float | None = None,
  shard_state: str = "fsdp+cp",
  target=None,
  strategy="ring",
  loss_strategy: str = "ring",
) -> Plan:
  """Build the :class:`Plan` of :func:`compile_step`'s program.

  Args:
    cfg, model, seq_len, mesh, remat, batch_size, dtype, lora_rank, base_dtype,
      lora_targets, capacity_factor, shard_state: as :func:`estimate`.
    target: a :class:`cpjax.training.targets.Target` to compile for with its
      own compiler and kernels (default: this process's devices).
    strategy, loss_strategy: the CP strategies (:func:`compile_step`).

  Returns:
    The :class:`Plan` of :func:`compile_step`'s program: its memory analysis,
    FLOPs and collective bytes, the parameters' and optimizer state's bytes
    per device; where the target's compiler refused it past the chip's
    memory (:class:`TooLarge`), a plan with ``refused`` set that does not fit.
  """
  from cpjax import parallel

  refused, step = None, None
  try:
    compiled, params, opt_state, base = compile_step(
      cfg,
      seq_len=seq_len,
      mesh=mesh,
      remat=remat,
      batch_size=batch_size,
      dtype=dtype,
      lora_rank=lora_rank,
      base_dtype=base_dtype,
      lora_targets=lora_targets,
      capacity_factor=capacity_factor,
      shard_state=shard_state,
      devices=None if target is None else target.devices(),
      strategy=strategy,
      loss_strategy=loss_strategy,
    )
  except TooLarge as e:  # XLA:TPU: past the chip's HBM
    refused, params, opt_state, base = e, e.params, e.opt_state, e.base
  # The parameters: the trained ones, and under LoRA the frozen base (the
  # buffers, a few numbers, count with the rest as the closed form does).
  param_bytes = parallel.bytes_per_device(params)
  if base is not None:
    param_bytes += parallel.bytes_per_device(base)
  opt_bytes = parallel.bytes_per_device(opt_state)
  if refused is not None:  # at least what it named (and the state, with temporaries)
    total = refused.needed + (param_bytes + opt_bytes if refused.what == "temporaries" else 0)
    cost, collectives = {}, {}
  else:
    cost = compiled.cost_analysis()  # None from XLA:GPU without a device
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    text = compiled.as_text()
    total, collectives = compiled_bytes(compiled), collective_bytes(text)
    if target is not None and not target.chip.missing_figures():
      rows = batch_size or math.prod(v for k, v in mesh.items() if k in ("dp", "fsdp"))
      step = step_time(
        hlo.Program.parse(text),
        target.chip,
        tokens=rows * seq_len,
        devices=target.num_devices,
        cost=cost,
      )
  return Plan(
    model,
    seq_len,
    dict(mesh),
    remat,
    dtype,
    param_bytes,
    opt_bytes,
    total - param_bytes - opt_bytes,
    total,
    float(cost.get("flops", math.nan)),
    "compiled" if target is None else target.name,
    lora_rank,
    base_dtype if lora_rank is not None else "float32",
    collectives,
    refused is not None,
    step,
  )


def _meshes(
  cfg, devices: int, seq_len: int, expert_parallel: bool, batch_size: int | None
) -> list[dict]:
  """List the fsdp x cp meshes of ``devices`` devices the rows split over:
  fsdp dividing ``batch_size`` where one is given; with ``expert_parallel``,
  the largest ep dividing the experts folded onto ``cp * fsdp``, ``cp`` or
  ``fsdp``."""
  meshes = []
  for cp_log in range(int(math.log2(devices)) + 1):
    cp = 2**cp_log
    fsdp = devices // cp
    if seq_len % (2 * cp) or cfg.text.num_attention_heads == 0 or (batch_size or fsdp) % fsdp:
      continue
    mesh = {"fsdp": fsdp, "cp": cp} if fsdp > 1 else {"cp": cp}
    if expert_parallel and cfg.text.enable_moe_block:
      ep = max(
        (n for n in (cp * fsdp, cp, fsdp) if n > 1 and cfg.text.num_experts % n == 0), default=1
      )
      mesh = {**mesh, "ep": ep} if ep > 1 else mesh
    meshes.append(mesh)
  return meshes


def best_mesh(
  cfg,
  *,
  devices: int,
  seq_len: int,
  expert_parallel: bool = False,
  strategy="ring",
  device_memory: int | None = None,
  **settings,
) -> Plan | None:
  """Find the fsdp x cp mesh of ``devices`` devices with the smallest estimate.

  Args:
    cfg: the :class:`Gemma4Config`.
    devices: the mesh's devices (a power of two).
    seq_len: the row length.
    expert_parallel: fold expert parallelism onto the mesh's token axes.
    strategy: as :func:`estimate`'s, or ``"auto"``: the rule's choice on each
      mesh (:func:`cpjax.training.cp_strategy.for_step`, budgeting for
      ``device_memory``), as ``cpjax train`` takes it.
    device_memory: the bytes of one device, for ``"auto"``'s rule.
    **settings: :func:`estimate`'s other keywords (``model`` among them).

  Returns:
    The :class:`Plan` of that mesh (fitting or not); None when no mesh of
    that many devices splits the rows.

  >>> from cpjax.models.gemma4 import Gemma4Config
  >>> best_mesh(Gemma4Config.preset("e2b"), model="e2b", devices=8, seq_len=131072).mesh
  {'cp': 8}
  """
  if not isinstance(devices, int) or devices < 1 or devices & (devices - 1):
    raise ValueError(f"devices must be a power of two, got {devices!r}")
  # Checked here: with no mesh to estimate, estimate() would never see them.
  taken = set(inspect.signature(estimate).parameters) - {"cfg", "seq_len", "mesh", "loss_strategy"}
  if unknown := sorted(set(settings) - taken):
    raise TypeError(f"unknown keywords {unknown}; estimate() takes {sorted(taken)}")
  plans = [
    estimate(
      cfg,
      seq_len=seq_len,
      mesh=mesh,
      **settings,
      **cp_strategy.for_step(
        cfg.text, seq_len=seq_len, mesh=mesh, strategy=strategy, device_memory=device_memory
      ),
    )
    for mesh in _meshes(cfg, devices, seq_len, expert_parallel, settings.get("batch_size"))
  ]
  return min(plans, key=lambda p: p.total, default=None)


def smallest_mesh(
  cfg,
  *,
  model: str,
  seq_len: int,
  device_memory: int,
  max_devices: int = 4096,
  expert_parallel: bool = False,
  strategy="ring",
  **settings,
) -> Plan | None:
  """Find the fewest-device (fsdp, cp) mesh whose estimate fits ``device_memory``.

  Ties: the one with more memory to spare. With ``expert_parallel`` each mesh
  folds the largest ``ep`` that divides the experts onto its token axes
  (``cp * fsdp``, ``cp`` or ``fsdp``).

  Args:
    cfg, model, seq_len: as :func:`estimate`.
    device_memory: the bytes one device holds.
    max_devices: the most devices to try.
    expert_parallel: fold expert parallelism onto each mesh's token axes.
    strategy: as :func:`best_mesh`'s.
    **settings: :func:`estimate`'s other keywords (``remat``, ``dtype``,
      ``lora_rank``, ``base_dtype``, ``capacity_factor``, ``shard_state``,
      ``platform``, ...).

  Returns:
    The :class:`Plan` of that mesh; None when none up to ``max_devices``.
  """
  devices = 1
  while devices <= max_devices:
    best = best_mesh(
      cfg,
      model=model,
      devices=devices,
      seq_len=seq_len,
      expert_parallel=expert_parallel,
      strategy=strategy,
      device_memory=device_memory,
      **settings,
    )
    if best is not None and best.fits(device_memory):
      return best
    devices *= 2
  return None


# How far past the memory the target search still compiles a smaller slice,
# by the compiler-to-closed-form ratio of the slice it just compiled (that
# ratio moves between slices: E2B LoRA at S = 131072 on v5e, 1.32x on 4 chips).
SMALLER_SLICE_SLACK = 1.1


def smallest_slice(
  cfg,
  *,
  chip,
  model: str,
  seq_len: int,
  max_devices: int = 4096,
  expert_parallel: bool = False,
  strategy="auto",
  device_memory: int | None = None,
  dtype: str = "bfloat16",
  report=None,
  **settings,
) -> tuple[Plan | None, list[Plan]]:
  """Find the smallest slice of ``chip`` whose compiler fits the training step.

  The target search: the closed form's smallest slice
  (:meth:`~cpjax.training.targets.Chip.slices`, each with :func:`best_mesh`'s
  mesh) is compiled for its chips (:func:`compiled_plan`); when it fits, the
  next smaller slice is compiled while that fits and its closed form, scaled
  by the compiler-to-closed-form ratio just measured, is within
  :data:`SMALLER_SLICE_SLACK` of the memory; when it does not fit, the next
  larger one until one fits. Each compile takes seconds (tiny) to minutes (a
  published size: XLA:TPU refuses one past the chip's memory only at its end).

  Args:
    cfg, model, seq_len, dtype: as :func:`estimate` (``dtype``: the
      activations of the estimate and of the compiled step).
    chip: a :class:`~cpjax.training.targets.Chip`.
    max_devices: the largest slice to try.
    expert_parallel: as :func:`smallest_mesh`'s.
    strategy: as :func:`best_mesh`'s (default ``"auto"``, cpjax train's).
    device_memory: the bytes to fit (default: the chip's memory).
    report: called with each compiled :class:`Plan` as it comes (a compile
      of a published size takes minutes).
    **settings: :func:`estimate`'s other keywords.

  Returns:
    (the compiled :class:`Plan` of the smallest slice that fits, None when
    none does; every compiled plan, in the order tried). A plan's ``source``
    names its slice (``"v5e-8"``).
  """
  memory = chip.memory if device_memory is None else device_memory
  slices = chip.slices(max_devices)
  estimates = [
    best_mesh(
      cfg,
      model=model,
      devices=t.num_devices,
      seq_len=seq_len,
      expert_parallel=expert_parallel,
      strategy=strategy,
      device_memory=memory,
      platform=chip.platform,
      dtype=dtype,
      **settings,
    )
    for t in slices
  ]
  start = next((i for i, e in enumerate(estimates) if e is not None and e.fits(memory)), None)
  tried: list[Plan] = []

  def compiled(i: int) -> Plan:
    mesh = estimates[i].mesh
    tried.append(
      compiled_plan(
        cfg,
        model=model,
        seq_len=seq_len,
        mesh=mesh,
        target=slices[i],
        dtype=dtype,
        **settings,
        **cp_strategy.for_step(
          cfg.text, seq_len=seq_len, mesh=mesh, strategy=strategy, device_memory=memory
        ),
      )
    )
    if report is not None:
      report(tried[-1])
    return tried[-1]

  if start is None:
    return None, tried
  i = start
  if compiled(i).fits(memory):
    while (
      i > 0
      and estimates[i - 1] is not None
      and estimates[i - 1].total * tried[-1].total / estimates[i].total
      <= SMALLER_SLICE_SLACK * memory
      and compiled(i - 1).fits(memory)
    ):
      i -= 1
  else:
    for j in range(i + 1, len(slices)):
      if estimates[j] is not None and compiled(j).fits(memory):
        break
  fitting = [p for p in tried if p.fits(memory)]
  best = min(
    fitting, key=lambda p: math.prod(v for k, v in p.mesh.items() if k != "ep"), default=None
  )
  return best, tried
