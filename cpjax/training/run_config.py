"""Configure a training run: :class:`RunConfig`, the one config of ``cpjax train``.

Sections a reader recognises, each a small frozen dataclass: ``dataset``,
``optimizer`` (which builds its optax transform), ``parallel``, ``lora``
(:class:`cpjax.training.lora.LoraConfig`, the config :func:`apply_lora`
takes), ``experts``, ``eval``, ``logging`` and ``checkpointing``; what is
trained (``model`` or ``checkpoint``), in which ``dtype``, with which
``remat``, from which ``seed``, sits at the top. A YAML run file (see
:mod:`cpjax.training.run_file`) has this shape, and ``cpjax train`` takes
every setting as a dotted key (``--optimizer.lr 1e-4``), the most used ones
also by a short flag (``--lr 1e-4``, :data:`cpjax.training.run_file.FLAGS`).

Each setting is declared once, here: its type, its default and its
docstring (the ``--help`` text). :func:`check` validates a config in one
place, naming each setting by its dotted key; :func:`with_values` replaces
settings by their dotted keys.

>>> run = with_values(RunConfig(model="tiny"), {"dataset.seq_len": 64, "dataset.batch_size": 2})
>>> run.dataset.seq_len, run.optimizer.lr, run.parallel.mesh_sizes()
(64, 0.003, {'cp': 8})
>>> check(RunConfig(dataset=DatasetConfig(seq_len=16)))
Traceback (most recent call last):
...
cpjax.training.run_config.RunError: dataset.seq_len must be >= 32, got 16
"""

import dataclasses
import math
import os
import typing
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

from cpjax.attention.cp_context import parse_strategy, unknown_layer_kinds
from cpjax.batch.layout import LayoutKind
from cpjax.training.lora.adapters import LoraConfig, check_lora_config

if TYPE_CHECKING:
  import optax

__all__ = [
  "CheckpointingConfig",
  "DatasetConfig",
  "EvalConfig",
  "ExpertsConfig",
  "LR_SCHEDULES",
  "LoggingConfig",
  "OptimizerConfig",
  "ParallelConfig",
  "RunConfig",
  "RunError",
  "check",
  "get",
  "settings",
  "with_values",
]

Dtype = Literal["float32", "bfloat16"]
Remat = Literal["none", "full", "save_attention_out"]
Schedule = Literal["constant", "cosine", "linear"]
ShardState = Literal["fsdp+cp", "fsdp"]


def state_axes(shard_state: str) -> tuple[str, ...]:
  """Return the mesh axes :func:`cpjax.parallel.param_specs` splits the state over.

  Args:
    shard_state: ``"fsdp+cp"`` or ``"fsdp"``.

  Returns:
    The axes for ``shard_state`` (``"fsdp+cp"``: ``("fsdp", "cp")``).
  """
  return tuple(shard_state.split("+"))


class RunError(ValueError):
  """A run that cannot run as asked, found before any training compute
  (``cpjax train`` prints it as a one-line usage error, exit status 2)."""


MODEL_FLAGS = ("tiny", "tiny-moe", "tiny-unified", "e2b", "e4b", "a4b", "31b", "12b")  # --model
LR_SCHEDULES = typing.get_args(Schedule)


def _setting(
  default: Any = None, *, factory: Optional[Callable[[], Any]] = None, positive: bool = False
) -> Any:
  """A field of a section; ``positive``: :func:`check` requires a value > 0 (or None).

  Typed ``Any`` as :func:`dataclasses.field` is: the field's annotation gives its type."""
  if factory is not None:
    return dataclasses.field(default_factory=factory)
  return dataclasses.field(default=default, metadata={"positive": positive})


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """The training data and the rows it is packed into."""

  path: Optional[str] = _setting()
  """a corpus from cpjax prepare-data (directory or file) or a .jsonl file
  (default: synthetic packed multimodal rows)"""
  tokenizer: Optional[str] = _setting()
  """the directory of tokenizer.json and the chat template, for .jsonl data
  (default: the checkpoint)"""
  truncate: bool = _setting(False)
  """cut .jsonl documents longer than seq_len (default: drop and report them)"""
  seq_len: int = _setting(1024, positive=True)
  """tokens per row before padding"""
  batch_size: int = _setting(2, positive=True)
  """rows per optimizer step"""
  microbatches: int = _setting(1, positive=True)
  """gradient accumulation: each step sums K microbatches of batch_size / K rows"""
  images_per_row: Optional[int] = _setting(positive=True)
  """image slots per packed row (default: the most images of one document)"""
  audio_clips_per_row: Optional[int] = _setting(positive=True)
  """audio clip slots per packed row (default: the most clips of one document)"""
  videos_per_row: Optional[int] = _setting(positive=True)
  """video slots per packed row (default: the most videos of one document)"""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW (weight decay 0.01) and its learning-rate schedule."""

  lr: float = _setting(3e-3, positive=True)
  """the peak learning rate"""
  schedule: Schedule = _setting("constant")
  """after the warmup: constant, or a cosine or linear decay to 0 at the last step"""
  warmup_steps: int = _setting(0)
  """linear warmup from 0 over N steps"""
  max_grad_norm: Optional[float] = _setting(positive=True)
  """clip the global gradient norm to X (default: no clipping)"""
  steps: int = _setting(20, positive=True)
  """optimizer steps"""

  def lr_schedule(self) -> "optax.Schedule":
    """Build the optax schedule: step -> learning rate (step 0 is the first update).

    As transformers' ``get_{constant,cosine,linear}_schedule_with_warmup``:
    ``lr * s / warmup`` during the warmup, then constant, a half cosine or a
    straight line from ``lr`` to 0 at ``steps``.

    Returns:
      An ``optax.Schedule``.

    >>> s = OptimizerConfig(lr=1.0, steps=10, warmup_steps=2, schedule="linear").lr_schedule()
    >>> [round(float(s(i)), 3) for i in (0, 1, 2, 6, 10)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    import optax

    if self.schedule not in LR_SCHEDULES:
      raise RunError(
        f"optimizer.schedule must be one of {list(LR_SCHEDULES)}, got {self.schedule!r}"
      )
    if self.warmup_steps < 0 or (self.schedule != "constant" and self.warmup_steps >= self.steps):
      raise RunError(
        f"optimizer.warmup_steps {self.warmup_steps} must be >= 0, and below "
        f"optimizer.steps {self.steps} for a {self.schedule} schedule (it decays "
        f"after the warmup)"
      )
    lr, warm, rest = self.lr, self.warmup_steps, max(self.steps - self.warmup_steps, 1)
    after = {
      "constant": optax.constant_schedule(lr),
      "cosine": optax.cosine_decay_schedule(lr, rest),
      "linear": optax.linear_schedule(lr, 0.0, rest),
    }[self.schedule]
    if warm == 0:
      return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])

  def build(self) -> "optax.GradientTransformation":
    """Build the optax transform: AdamW (weight decay 0.01) on
    :meth:`lr_schedule`, after clipping the global gradient norm to
    ``max_grad_norm`` when set.

    Returns:
      An ``optax.GradientTransformation``.
    """
    import optax

    optimizer = optax.adamw(self.lr_schedule(), weight_decay=0.01)
    if self.max_grad_norm is None:
      return optimizer
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), optimizer)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """The device mesh and how each row is split over its cp axis."""

  mesh: Optional[str] = _setting()
  """a mesh such as fsdp=2,cp=4 or fsdp=2,cp=2,tp=2 (state sharded over fsdp, cp
  and tp, see shard_state); ep=N folds expert parallelism onto cp and/or the batch
  axis"""
  cp: Optional[int] = _setting(positive=True)
  """a cp-only mesh of this size, instead of mesh (default: 8)"""
  layout: LayoutKind = _setting("load_balanced")
  """how the sequence is split over the cp ranks (document_balanced evens out
  packed rows)"""
  shard_state: ShardState = _setting("fsdp+cp")
  """which axes split the parameters, their gradients and the optimizer state:
  fsdp+cp (every device that shares the model holds 1 / (fsdp * cp) of it; each
  layer's weights are gathered where it runs) or fsdp (whole over cp: no gathers,
  for small models)"""
  strategy: str = _setting("auto")
  """how attention's keys and values reach each rank's queries: auto (the rule
  cpjax plan shows picks one per layer kind, cpjax.training.cp_strategy), ring
  (ppermute hops, O(S/cp) memory a device), all_gather (the row's K/V gathered at
  once, no hops; a window's halo only), ulysses (an all-to-all turns the
  sequence split into a head split: the query heads a tp rank must divide by cp)
  or hybrid (Ulysses inside groups of neighbouring cp ranks as large as the K/V
  heads a tp rank allow, the ring over the groups), for every layer or per layer kind, e.g.
  full_attention=all_gather,sliding_attention=ring (the memory check's estimate
  assumes the ring)"""

  def state_axes(self) -> tuple[str, ...]:
    """Return the mesh axes :func:`cpjax.parallel.param_specs` splits the state over."""
    return state_axes(self.shard_state)

  def mesh_sizes(self) -> dict:
    """Return the ``{axis: size}`` of the mesh, ep included (``{"cp": 8}`` by default)."""
    from cpjax.parallel import parse_mesh

    return parse_mesh(self.mesh) if self.mesh else {"cp": self.cp or 8}


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
  """Mixture-of-experts dispatch."""

  capacity_factor: Optional[float] = _setting(positive=True)
  """each expert takes at most ceil(C * T * k / E) (token, expert) pairs of a
  dispatch's T tokens; later ones are dropped and counted (default: never drop)"""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """A validation loss on fixed rows, with the same CP forward."""

  data: Optional[str] = _setting()
  """validation data (as dataset.path)"""
  every: int = _setting(0)
  """validate every N steps (0: only after the last step)"""
  rows: int = _setting(16, positive=True)
  """validation rows: the first ones of eval.data"""


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Per-step metrics."""

  metrics: Optional[str] = _setting()
  """one JSON line per step (default: STATE_DIR/metrics.jsonl with a state dir)"""
  tensorboard: Optional[str] = _setting()
  """also write the metrics as TensorBoard event files here"""


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
  """The resumable train state (orbax) and the model written at the end."""

  state_dir: Optional[str] = _setting()
  """save the train state (parameters, optimizer state, data position) here"""
  save_every: int = _setting(0)
  """save it every N steps (0: only after the last step)"""
  resume: bool = _setting(False)
  """continue the run saved in state_dir"""
  force_resume: bool = _setting(False)
  """resume even with a different batch_size, seq_len or microbatches"""
  save: Optional[str] = _setting()
  """write the trained model as a Hugging Face checkpoint at the end (with
  LoRA: the adapter, as PEFT saves it)"""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A ``cpjax train`` run: what is trained, on what, and how."""

  model: Optional[str] = _setting()
  """an architecture preset, randomly initialised (default tiny; a4b is 26B-A4B,
  tiny-moe a small one like it)"""
  checkpoint: Optional[str] = _setting()
  """fine-tune this Hugging Face Gemma 4 checkpoint directory instead of model"""
  dtype: Dtype = _setting("float32")
  """activation dtype; trained parameters stay float32"""
  remat: Remat = _setting("none")
  """per-layer rematerialisation: full (keep only each layer's inputs),
  save_attention_out (keep the attention output too) or none"""
  seed: int = _setting(0)
  """seed for the data and the initialisation"""
  parity_check: bool = _setting(True)
  """compare the first step with the single-device model"""
  dataset: DatasetConfig = _setting(factory=DatasetConfig)
  optimizer: OptimizerConfig = _setting(factory=OptimizerConfig)
  parallel: ParallelConfig = _setting(factory=ParallelConfig)
  lora: LoraConfig = _setting(factory=LoraConfig)
  experts: ExpertsConfig = _setting(factory=ExpertsConfig)
  eval: EvalConfig = _setting(factory=EvalConfig)
  logging: LoggingConfig = _setting(factory=LoggingConfig)
  checkpointing: CheckpointingConfig = _setting(factory=CheckpointingConfig)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One leaf of :class:`RunConfig`: its dotted key, type and default, and
  whether it must be positive."""

  key: str
  type: object
  default: object
  positive: bool = False


def settings(cls: type = RunConfig, prefix: str = "") -> list[Setting]:
  """List every leaf setting of ``cls`` in declaration order.

  >>> [s.key for s in settings()][:6]
  ['model', 'checkpoint', 'dtype', 'remat', 'seed', 'parity_check']
  """
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[f.name]):
      out += settings(hints[f.name], f"{prefix}{f.name}.")
    else:
      out.append(
        Setting(f"{prefix}{f.name}", hints[f.name], f.default, bool(f.metadata.get("positive")))
      )
  return out


def _replace(run, key: str, value):
  head, _, rest = key.partition(".")
  if not rest:
    return dataclasses.replace(run, **{head: value})
  return dataclasses.replace(run, **{head: _replace(getattr(run, head), rest, value)})


def get(run: RunConfig, key: str) -> Any:
  """Read a dotted key: ``get(run, "optimizer.lr")``."""
  for part in key.split("."):
    run = getattr(run, part)
  return run


def with_values(run: RunConfig, values: dict) -> RunConfig:
  """Replace settings by their dotted keys.

  Args:
    run: the config to start from.
    values: ``{dotted key: value}``, e.g. ``{"optimizer.steps": 3}``.

  Returns:
    A new :class:`RunConfig`; a key that names no setting raises ``KeyError``.
  """
  known = {s.key for s in settings()}
  unknown = sorted(set(values) - known)
  if unknown:
    raise KeyError(f"unknown run settings {unknown}; known: {sorted(known)}")
  for key, value in values.items():
    run = _replace(run, key, value)
  return run


def _dotted(key: str) -> str:
  return key


def check(run: RunConfig, *, name: Callable[[str], str] = _dotted, files: bool = True) -> None:
  """Raise :class:`RunError` for the first setting that cannot run, before
  any compute. ``name(key)`` names a dotted key in the message (the command
  line names the flag the user typed); ``files``: also check that the paths
  given exist."""
  from cpjax.models.gemma4 import PRESETS

  def fail(message):
    raise RunError(message)

  for s in settings():
    value = get(run, s.key)
    literal = getattr(s.type, "__args__", ())
    if getattr(s.type, "__origin__", None) is Literal and value not in literal:
      fail(f"{name(s.key)} must be one of {list(literal)}, got {value!r}")
    if not _has_type(value, s.type):
      fail(f"{name(s.key)} must be {_type_name(s.type)}, got {value!r}")
    if s.positive and value is not None and not value > 0:
      fail(f"{name(s.key)} must be > 0, got {value!r}")
  for key in ("optimizer.warmup_steps", "eval.every", "checkpointing.save_every"):
    if get(run, key) < 0:
      fail(f"{name(key)} must be >= 0, got {get(run, key)}")
  opt = run.optimizer
  if opt.schedule != "constant" and opt.warmup_steps >= opt.steps:
    fail(
      f"{name('optimizer.warmup_steps')} {opt.warmup_steps} must be >= 0, and below "
      f"{name('optimizer.steps')} {opt.steps} for a {opt.schedule} schedule (it decays after "
      f"the warmup)"
    )
  if run.dataset.seq_len < 32:
    fail(f"{name('dataset.seq_len')} must be >= 32, got {run.dataset.seq_len}")
  if run.model is not None and run.model not in PRESETS:
    fail(f"{name('model')} must be one of {sorted(PRESETS)}, got {run.model!r}")
  if run.model is not None and run.checkpoint is not None:
    fail(f"{name('model')} and {name('checkpoint')} exclude each other")
  if run.parallel.mesh is not None and run.parallel.cp is not None:
    fail(f"{name('parallel.mesh')} sets the cp size; do not add {name('parallel.cp')}")
  try:
    sizes = run.parallel.mesh_sizes()
  except ValueError as e:
    fail(f"{name('parallel.mesh')}: {e}")
  if sizes.get("dp", 1) > 1 and sizes.get("fsdp", 1) > 1:
    fail(f"{name('parallel.mesh')} splits the batch over dp or fsdp, not both")
  strategy = run.parallel.strategy
  if strategy != "auto":
    try:
      strategy = parse_strategy(strategy)
    except ValueError as e:
      fail(f"{name('parallel.strategy')}: {e}")
  if run.model is not None:
    text = PRESETS[run.model].text
    assert text.layer_types is not None  # Gemma4TextConfig.__post_init__ fills it
    kinds = set(text.layer_types)
    for kind, _ in unknown_layer_kinds(strategy, kinds):
      fail(
        f"{name('parallel.strategy')} names layer kind {kind!r}, which {run.model} "
        f"lacks: its layer kinds are {sorted(kinds)}"
      )
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    heads = text.num_attention_heads // tp
    for kind in sorted(kinds):
      chosen = strategy if isinstance(strategy, str) else dict(strategy).get(kind)
      layer = list(text.layer_types).index(kind)
      if chosen == "ulysses" and heads % cp:
        fail(
          f"{name('parallel.strategy')} {run.parallel.strategy!r} splits {run.model}'s "
          f"{heads} query heads a tp rank over cp = {cp}, which does not divide them; use "
          f"ring or all_gather, or a cp size dividing {heads}"
        )
      if chosen == "hybrid" and cp > 1 and math.gcd(text.kv_heads(layer) // tp, cp) == 1:
        fail(
          f"{name('parallel.strategy')} {run.parallel.strategy!r} runs Ulysses over a "
          f"factor of cp = {cp} that splits the K/V heads of {run.model}'s {kind} layers "
          f"({text.kv_heads(layer) // tp} a tp rank), and none does; use ring, all_gather "
          f"or ulysses, or a cp size sharing a factor with them"
        )
  if run.dataset.batch_size % run.dataset.microbatches:
    fail(
      f"{name('dataset.microbatches')} {run.dataset.microbatches} must divide "
      f"{name('dataset.batch_size')} {run.dataset.batch_size}"
    )
  if run.checkpointing.save_every and run.checkpointing.state_dir is None:
    fail(f"{name('checkpointing.save_every')} needs {name('checkpointing.state_dir')}")
  if run.checkpointing.resume and run.checkpointing.state_dir is None:
    fail(f"{name('checkpointing.resume')} needs {name('checkpointing.state_dir')}")
  if run.eval.every and run.eval.data is None:
    fail(f"{name('eval.every')} needs {name('eval.data')}")
  if run.lora.rank is None:
    given = [
      name(f"lora.{f.name}")
      for f in dataclasses.fields(LoraConfig)
      if getattr(run.lora, f.name) != f.default
    ]
    if given:
      fail(f"{', '.join(given)} needs {name('lora.rank')}")
  else:
    try:
      check_lora_config(run.lora, name=lambda field: name(f"lora.{field}"))
    except (ValueError, TypeError) as e:
      fail(str(e))
  if run.lora.merge and run.checkpointing.save is None:
    fail(
      f"{name('lora.merge')} says what {name('checkpointing.save')} writes; add "
      f"{name('checkpointing.save')} DIR"
    )
  if files:
    _check_files(run, name, fail)


def _has_type(value, hint) -> bool:
  """``value`` is a ``hint`` (int, float, bool, str, Optional[...], Literal)."""
  if typing.get_origin(hint) is typing.Union:
    return any(_has_type(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if typing.get_origin(hint) is Literal:
    return True  # checked above, with its choices
  if typing.get_origin(hint) is tuple:  # tuple[str, ...]
    return isinstance(value, tuple) and all(_has_type(v, typing.get_args(hint)[0]) for v in value)
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)


def _type_name(hint) -> str:
  if typing.get_origin(hint) is typing.Union:
    return " or ".join(_type_name(h) for h in typing.get_args(hint))
  if typing.get_origin(hint) is tuple:
    return f"a list of {_type_name(typing.get_args(hint)[0])}"
  return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check_files(run: RunConfig, name, fail) -> None:
  if run.checkpoint is not None and not os.path.isfile(os.path.join(run.checkpoint, "config.json")):
    fail(f"{name('checkpoint')} {run.checkpoint} has no config.json")
  for key in ("dataset.path", "eval.data"):
    path = get(run, key)
    if path is not None and not os.path.exists(path):
      fail(f"{name(key)} {path} does not exist")
  if run.dataset.tokenizer is not None and not os.path.isfile(
    os.path.join(run.dataset.tokenizer, "tokenizer.json")
  ):
    fail(f"{name('dataset.tokenizer')} {run.dataset.tokenizer} has no tokenizer.json")


def devices_needed(run: RunConfig) -> int:
  """Count the devices of the run's mesh (ep folds onto the other axes: not counted).

  Args:
    run: the :class:`RunConfig`.

  Returns:
    The number of devices.
  """
  return math.prod(v for k, v in run.parallel.mesh_sizes().items() if k != "ep")


def __getattr__(name: str):
  # Names that left this module in 0.2, for one release (cpjax/_deprecations.py).
  from cpjax import _deprecations

  return _deprecations.moved_attribute(__name__, name)
