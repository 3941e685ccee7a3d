"""One training step's shape, as a run fixes it, and the plan's report of it.

:class:`StepShape` is what the plan of a run needs of it: the row length,
the mesh, the rows, the dtypes, remat, LoRA, experts, the state's placement,
the layout and the CP strategy. :meth:`StepShape.of` derives it from a
:class:`~cpjax.training.run_config.RunConfig` in one place, and its defaults
are the run config's, so a plan and the run it plans agree on every setting
(``tests/test_plan.py`` checks both, for every recipe).

>>> from cpjax.training.run_config import RunConfig
>>> shape = StepShape.of(RunConfig())
>>> shape.dtype, shape.remat, shape.strategy, shape == StepShape(shape.seq_len, shape.mesh, 2)
('float32', 'none', 'auto', True)
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cpjax.batch.layout import LayoutKind, ShardLayout, layout_kind
from cpjax.training.run_config import RunConfig, ShardState
from cpjax.training.step_time import StepTime

if TYPE_CHECKING:
  from cpjax.models.gemma4.config import Gemma4Config
  from cpjax.models.gemma4.text_config import Gemma4TextConfig

__all__ = ["GiB", "Plan", "SHARD_STATE", "StepShape", "format_bytes", "parse_bytes", "run_shape"]

GiB = 2**30
SHARD_STATE = typing.get_args(ShardState)  # cpjax train --shard-state's choices
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


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What a run fixes of one training step: the plan's input.

  Every default is :class:`~cpjax.training.run_config.RunConfig`'s, so the
  plan of a step and the run of it agree unless told otherwise.

  Attributes:
    seq_len: the row length ``S``.
    mesh: ``{axis: size}`` (``ep`` included); None where a search picks it.
    batch_size: rows a step (one microbatch); None: one per batch shard.
    dtype: the activations' dtype.
    remat: the per-layer rematerialisation.
    lora_rank: LoRA's rank; None: every weight trained.
    base_dtype: the frozen base's storage under LoRA.
    lora_targets: the projections LoRA adapts (None: the default targets).
    lora_target_parameters: the expert tensors LoRA adapts (None: the
      default, every expert tensor of an MoE).
    group_size: a quantized base's input values a scale (None: per channel).
    capacity_factor: the expert dispatch's (:mod:`cpjax.models.gemma4.experts`).
    shard_state: the state over ``fsdp x cp`` or whole over ``cp``.
    layout: the batch's layout kind (the strategy rule and the sharder read
      it): a :data:`~cpjax.batch.LayoutKind`, or a :class:`cpjax.ShardLayout`
      whose ``kind`` the shape keeps.
    strategy: the CP strategy, ``"auto"`` (the rule's choice per layer
      kind), one strategy, or one per layer kind.
    loss_strategy: the loss's CP strategy; None: as the run takes it (the
      rule's ``"auto"`` with ``strategy="auto"``, else the ring).
    audio_seconds: seconds of audio in each row, one clip whose soft tokens
      (25 a second: :func:`audio_shape`) are among the row's ``S``; 0: text
      only. A model with an audio tower or the 12B's embedder.
    video_frames: frames of one video in each row, each ``video_frame_tokens``
      soft tokens among the row's ``S`` (:meth:`video`); 0: no video. A
      model with a vision tower or the 12B's embedder.
    video_frame_tokens: each frame's soft tokens: the video processor's
      ``max_soft_tokens`` (70 by default), which the plan takes every frame
      to fill.
  """

  seq_len: int
  mesh: Mapping[str, int] | None
  batch_size: int | None = None
  dtype: str = "float32"
  remat: str = "none"
  lora_rank: int | None = None
  base_dtype: str = "float32"
  lora_targets: Any = None
  lora_target_parameters: Any = None
  group_size: int | None = None
  capacity_factor: float | None = None
  shard_state: str = "fsdp+cp"
  layout: LayoutKind | ShardLayout = "load_balanced"
  strategy: Any = "auto"
  loss_strategy: str | None = None
  audio_seconds: float = 0.0
  video_frames: int = 0
  video_frame_tokens: int = 70

  def __post_init__(self):
    # A step's shape is of rows of seq_len: a ShardLayout's kind is all it keeps.
    object.__setattr__(self, "layout", layout_kind(self.layout))

  @classmethod
  def of(cls, run: RunConfig) -> StepShape:
    """Return the step of a run config: one microbatch's rows.

    Args:
      run: a :class:`~cpjax.training.run_config.RunConfig`.

    Returns:
      The step's shape.

    >>> from cpjax.training.run_config import RunConfig, with_values
    >>> run = with_values(RunConfig(), {"dataset.batch_size": 4, "dataset.microbatches": 2})
    >>> StepShape.of(run).batch_size
    2
    """
    from cpjax.training.lora import DEFAULT_LORA_PARAMETERS, DEFAULT_LORA_TARGETS

    targets, tensors = run.lora.targets, run.lora.target_parameters
    return cls(
      seq_len=run.dataset.seq_len,
      mesh=run.parallel.mesh_sizes(),
      batch_size=run.dataset.batch_size // run.dataset.microbatches,
      dtype=run.dtype,
      remat=run.remat,
      lora_rank=run.lora.rank,
      base_dtype=run.lora.base_dtype,
      lora_targets=None if targets == DEFAULT_LORA_TARGETS else targets,
      lora_target_parameters=None if tensors == DEFAULT_LORA_PARAMETERS else tensors,
      group_size=run.lora.group_size,
      capacity_factor=run.experts.capacity_factor,
      shard_state=run.parallel.shard_state,
      layout=run.parallel.layout,
      strategy=run.parallel.strategy,
    )

  @classmethod
  def take(
    cls, shape: StepShape | RunConfig | None = None, settings: Mapping[str, Any] | None = None
  ) -> StepShape:
    """Return ``shape`` (a :class:`StepShape`, a run config, or None) with ``settings`` over it.

    The plan's entry points take a shape, a run config or the shape's fields
    as keywords; this is where they meet.

    >>> StepShape.take(None, {"seq_len": 8, "mesh": {"cp": 2}}).remat
    'none'
    >>> StepShape.take(None, {"seq_len": 8, "mesh": {"cp": 2}, "rank": 4})
    Traceback (most recent call last):
    ...
    TypeError: unknown step settings ['rank']; a StepShape has ['audio_seconds', ...]
    """
    settings = dict(settings or {})
    fields = sorted(f.name for f in dataclasses.fields(cls))
    if unknown := sorted(set(settings) - set(fields)):
      raise TypeError(f"unknown step settings {unknown}; a StepShape has {fields}")
    if shape is None:
      missing = [k for k in ("seq_len", "mesh") if k not in settings]
      if missing:
        raise TypeError(f"give a StepShape, a run config or {missing}")
      return cls(**settings)
    if isinstance(shape, RunConfig):
      shape = cls.of(shape)
    elif not isinstance(shape, cls):
      raise TypeError(f"shape must be a StepShape or a RunConfig, got {type(shape).__name__}")
    return dataclasses.replace(shape, **settings)

  def audio(self, cfg: Gemma4Config) -> tuple[int, int, int] | None:
    """Return each row's clip as ``(frames T, features W, soft tokens U)``, or None.

    E2B and E4B: log-mel frames every 10 ms of ``W`` mel bins, ``U =
    ceil(ceil(T / 2) / 2)`` after the tower's two stride-2 convolutions; the
    12B: frames of ``W`` waveform samples (640: 40 ms), one soft token each.

    Args:
      cfg: the model's :class:`~cpjax.models.gemma4.Gemma4Config`.

    Raises:
      ValueError: audio for a model without audio, or more soft tokens than
        the row holds.

    >>> from cpjax.models.gemma4 import Gemma4Config
    >>> StepShape(131072, {"cp": 16}, audio_seconds=3600).audio(Gemma4Config.preset("e4b"))
    (360000, 128, 90000)
    """
    from cpjax.models.gemma4.audio_config import Gemma4AudioConfig

    if not self.audio_seconds:
      return None
    if cfg.audio is None:
      raise ValueError(
        f"audio_seconds={self.audio_seconds} needs a model that takes audio (E2B, E4B, "
        f"12B); this Gemma 4 has no audio_config"
      )
    if isinstance(cfg.audio, Gemma4AudioConfig):
      width, frames = cfg.audio.mel_bins, round(100 * self.audio_seconds)
      soft = -(-(-(-frames // 2)) // 2)
    else:
      width = cfg.audio.audio_embed_dim
      frames = soft = math.ceil(16000 * self.audio_seconds / width)
    if soft > self.seq_len:
      raise ValueError(
        f"audio_seconds={self.audio_seconds} makes {soft} soft tokens, more than the "
        f"row's seq_len={self.seq_len}"
      )
    return frames, width, soft

  def video(self, cfg: Gemma4Config) -> tuple[int, int, int, int] | None:
    """Return each row's video as ``(frames N, patches P, features F, soft tokens U)``, or None.

    Each frame is cut as the video processor cuts it at ``max_soft_tokens =
    video_frame_tokens`` (``T``): E2B to 31B's tower pools ``k x k`` patches
    of ``p`` pixels into a soft token, so ``P = T k^2`` patches of ``3 p^2``
    features; the 12B embeds one patch of ``k p`` pixels a soft token, ``P =
    T`` of ``3 (k p)^2``. ``U = N T`` (the frames' timestamps and delimiters
    are text among the row's other tokens).

    Args:
      cfg: the model's :class:`~cpjax.models.gemma4.Gemma4Config`.

    Raises:
      ValueError: video for a model without vision, or more soft tokens
        (with the audio clip's) than the row holds.

    >>> from cpjax.models.gemma4 import Gemma4Config
    >>> StepShape(131072, {"cp": 16}, video_frames=1024).video(Gemma4Config.preset("e4b"))
    (1024, 630, 768, 71680)
    >>> StepShape(131072, {"cp": 16}, video_frames=1024).video(Gemma4Config.preset("12b"))
    (1024, 70, 6912, 71680)
    """
    from cpjax import checks

    checks.integer("video_frames", self.video_frames, minimum=0)
    checks.integer("video_frame_tokens", self.video_frame_tokens, minimum=1)
    if not self.video_frames:
      return None
    v = cfg.vision
    if v is None:
      raise ValueError(
        f"video_frames={self.video_frames} needs a model that takes video (every Gemma 4 "
        f"with a vision_config); this Gemma 4 has none"
      )
    tokens, k = self.video_frame_tokens, v.pooling_kernel_size
    patches = tokens if cfg.unified else tokens * k * k
    soft = self.video_frames * tokens
    clip = self.audio(cfg)
    heard = 0 if clip is None else clip[2]
    if soft + heard > self.seq_len:
      audio = f" and the audio clip's {heard}" if heard else ""
      raise ValueError(
        f"video_frames={self.video_frames} of video_frame_tokens={tokens} make {soft} "
        f"soft tokens{audio}, more than the row's seq_len={self.seq_len}"
      )
    return self.video_frames, patches, v.patch_features, soft

  def strategies(self, text: Gemma4TextConfig, *, device_memory: int | None = None) -> dict:
    """Return the step's ``{"strategy": ..., "loss_strategy": ...}`` as the run takes them.

    ``"auto"``: the rule's choice on this mesh
    (:func:`cpjax.training.cp_strategy.for_step`, budgeting for
    ``device_memory``); a named strategy as it is. ``loss_strategy``, where
    set, over the loss's.

    Args:
      text: the model's Gemma 4 text config.
      device_memory: the bytes of one device, for the rule.
    """
    from cpjax.training import cp_strategy

    chosen = cp_strategy.for_step(
      text,
      seq_len=self.seq_len,
      mesh=dict(self.mesh or {}),
      strategy=self.strategy,
      layout=self.layout,
      device_memory=device_memory,
    )
    if self.loss_strategy is not None:
      chosen["loss_strategy"] = self.loss_strategy
    return chosen


def run_shape(run: RunConfig) -> dict:
  """Return :meth:`StepShape.of`'s fields as a dict (0.1's name; removed in 0.3).

  >>> import warnings
  >>> from cpjax.training.run_config import RunConfig
  >>> with warnings.catch_warnings(record=True):
  ...   warnings.simplefilter("always")
  ...   run_shape(RunConfig())["remat"]
  'none'
  """
  from cpjax import _deprecations

  _deprecations.warn("cpjax.training.plan.run_shape", "cpjax.training.plan.StepShape.of")
  return dataclasses.asdict(StepShape.of(run))
