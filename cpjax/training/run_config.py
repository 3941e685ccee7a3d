"""A training run's settings, as a nested config: :class:`RunConfig`.

Sections a reader recognises, each a small frozen dataclass: ``dataset``,
``optimizer`` (and its schedule), ``parallel``, ``lora``, ``experts``,
``eval``, ``logging`` and ``checkpointing``; what is trained (``model`` or
``checkpoint``), in which ``dtype``, with which ``remat``, from which ``seed``,
sits at the top. A YAML run file (see :mod:`cpjax.training.run_file`) has
this shape, and ``cpjax train`` takes every setting as a dotted key
(``--optimizer.lr 1e-4``) or by its older flat flag (``--lr 1e-4``).

Each setting is declared once, here: its type, its default, its docstring
(the ``--help`` text), and in its field metadata the flat name that
:class:`TrainJob` and the command line's older flag use. :func:`check`
validates a config in one place, naming each setting by its dotted key.

>>> run = RunConfig(model="tiny", dataset=DataConfig(seq_len=64, batch_size=2))
>>> run.dataset.seq_len, run.optimizer.lr, run.parallel.mesh_sizes()
(64, 0.003, {'cp': 8})
>>> check(RunConfig(dataset=DataConfig(seq_len=16)))
Traceback (most recent call last):
...
cpjax.training.run_config.JobError: dataset.seq_len must be >= 32, got 16
"""

import dataclasses
import math
import os
import re
import typing
from typing import Callable, Literal, Optional

__all__ = ["CheckpointingConfig", "JobError", "DataConfig", "EvalConfig", "ExpertsConfig", "LoggingConfig",
           "LoraConfig", "OptimizerConfig", "ParallelConfig", "RunConfig", "TrainJob",
           "as_run_config", "check", "flat_settings", "from_flat", "settings"]

Dtype = Literal["float32", "bfloat16"]
Remat = Literal["none", "full", "save_attention_out"]
Layout = Literal["contiguous", "load_balanced", "document_balanced"]
Schedule = Literal["constant", "cosine", "linear"]
ShardState = Literal["fsdp+cp", "fsdp"]


def state_axes(shard_state: str) -> tuple[str, ...]:
  """The mesh axes :func:`cpjax.parallel.param_specs` splits the state over for
  ``shard_state`` (``"fsdp+cp"``: ``("fsdp", "cp")``)."""
  return tuple(shard_state.split("+"))


class JobError(ValueError):
  """A job that cannot run as asked, found before any training compute
  (``cpjax train`` prints it as a one-line usage error, exit status 2)."""

MODEL_FLAGS = ("tiny", "tiny-moe", "e2b", "e4b", "a4b", "31b")   # what --model offers


def _flat(name: str | None = None, **alias) -> dict:
  """Field metadata: the flat name (:class:`TrainJob`'s field; ``--flat-name``
  on the command line) and how that older flag parses (argparse keywords)."""
  return {"flat": name, "alias": alias}


def _setting(default=None, *, flat: str | None = None, factory=None, **alias):
  if factory is not None:
    return dataclasses.field(default_factory=factory)
  return dataclasses.field(default=default, metadata=_flat(flat, **alias))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The training data and the rows it is packed into."""

  path: Optional[str] = _setting(flat="data", metavar="PATH")
  """a corpus from cpjax prepare-data (directory or file) or a .jsonl file
  (default: synthetic packed multimodal rows)"""
  tokenizer: Optional[str] = _setting(metavar="DIR")
  """the directory of tokenizer.json and the chat template, for .jsonl data
  (default: the checkpoint)"""
  truncate: bool = _setting(False)
  """cut .jsonl documents longer than seq_len (default: drop and report them)"""
  seq_len: int = _setting(1024, positive=True)
  """tokens per row before padding"""
  batch_size: int = _setting(2, positive=True)
  """rows per optimizer step"""
  microbatches: int = _setting(1, positive=True, metavar="K")
  """gradient accumulation: each step sums K microbatches of batch_size / K rows"""
  images_per_row: Optional[int] = _setting(positive=True, metavar="N")
  """image slots per packed row (default: the most images of one document)"""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW (weight decay 0.01) and its learning-rate schedule."""

  lr: float = _setting(3e-3, flat="learning_rate", flags=("--lr",), positive=True)
  """the peak learning rate"""
  schedule: Schedule = _setting("constant", flat="lr_schedule")
  """after the warmup: constant, or a cosine or linear decay to 0 at the last step"""
  warmup_steps: int = _setting(0, metavar="N")
  """linear warmup from 0 over N steps"""
  max_grad_norm: Optional[float] = _setting(positive=True, metavar="X")
  """clip the global gradient norm to X (default: no clipping)"""
  steps: int = _setting(20, positive=True)
  """optimizer steps"""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """The device mesh and how each row is split over its cp axis."""

  mesh: Optional[str] = _setting(metavar="AXIS=N,...")
  """a mesh such as fsdp=2,cp=4 or fsdp=2,cp=2,tp=2 (state sharded over fsdp, cp
  and tp, see shard_state); ep=N folds expert parallelism onto cp and/or the batch
  axis"""
  cp: Optional[int] = _setting(positive=True)
  """a cp-only mesh of this size, instead of mesh (default: 8)"""
  layout: Layout = _setting("load_balanced")
  """how the sequence is split over the cp ranks (document_balanced evens out
  packed rows)"""
  shard_state: ShardState = _setting("fsdp+cp")
  """which axes split the parameters, their gradients and the optimizer state:
  fsdp+cp (every device that shares the model holds 1 / (fsdp * cp) of it; each
  layer's weights are gathered where it runs) or fsdp (whole over cp: no gathers,
  for small models)"""

  def state_axes(self) -> tuple[str, ...]:
    """The mesh axes :func:`cpjax.parallel.param_specs` splits the state over."""
    return state_axes(self.shard_state)

  def mesh_sizes(self) -> dict:
    """``{axis: size}`` of the mesh, ep included (``{"cp": 8}`` by default)."""
    from cpjax.parallel import parse_mesh

    return parse_mesh(self.mesh) if self.mesh else {"cp": self.cp or 8}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on a frozen base instead of every weight (PEFT's format)."""

  rank: Optional[int] = _setting(flat="lora_rank", positive=True, metavar="R")
  """train rank-R adapters; the base is frozen (default: train every weight)"""
  alpha: float = _setting(8.0, flat="lora_alpha", positive=True, metavar="A")
  """the adapters' scale is alpha / rank (PEFT's default 8)"""
  targets: Optional[str] = _setting(flat="lora_targets", metavar="REGEX")
  """modules to adapt, a regex matched in full against paths such as
  model.language_model.layers.0.self_attn.q_proj (default: the decoder's
  q/k/v/o and gate/up/down projections)"""
  base_dtype: Dtype = _setting("float32", flat="base_dtype")
  """the frozen base's storage dtype"""
  merge: bool = _setting(False, flat="merge_lora")
  """with checkpointing.save: write the base with the adapter merged in,
  instead of the adapter"""


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
  """Mixture-of-experts dispatch."""

  capacity_factor: Optional[float] = _setting(positive=True, metavar="C")
  """each expert takes at most ceil(C * T * k / E) (token, expert) pairs of a
  dispatch's T tokens; later ones are dropped and counted (default: never drop)"""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """A validation loss on fixed rows, with the same CP forward."""

  data: Optional[str] = _setting(flat="eval_data", metavar="PATH")
  """validation data (as dataset.path)"""
  every: int = _setting(0, flat="eval_every", metavar="N")
  """validate every N steps (0: only after the last step)"""
  rows: int = _setting(16, flat="eval_rows", positive=True, metavar="N")
  """validation rows: the first ones of eval.data"""


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Per-step metrics."""

  metrics: Optional[str] = _setting(metavar="FILE")
  """one JSON line per step (default: STATE_DIR/metrics.jsonl with a state dir)"""
  tensorboard: Optional[str] = _setting(metavar="DIR")
  """also write the metrics as TensorBoard event files here"""


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
  """The resumable train state (orbax) and the model written at the end."""

  state_dir: Optional[str] = _setting(metavar="DIR")
  """save the train state (parameters, optimizer state, data position) here"""
  save_every: int = _setting(0, metavar="N")
  """save it every N steps (0: only after the last step)"""
  resume: bool = _setting(False, flags=())
  """continue the run saved in state_dir"""
  force_resume: bool = _setting(False)
  """resume even with a different batch_size, seq_len or microbatches"""
  save: Optional[str] = _setting(metavar="DIR")
  """write the trained model as a Hugging Face checkpoint at the end (with
  LoRA: the adapter, as PEFT saves it)"""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A ``cpjax train`` run: what is trained, on what, and how."""

  model: Optional[str] = _setting(choices=MODEL_FLAGS)
  """an architecture preset, randomly initialised (default tiny; a4b is 26B-A4B,
  tiny-moe a small one like it)"""
  checkpoint: Optional[str] = _setting(metavar="DIR")
  """fine-tune this Hugging Face Gemma 4 checkpoint directory instead of model"""
  dtype: Dtype = _setting("float32")
  """activation dtype; trained parameters stay float32"""
  remat: Remat = _setting("none", nargs="?", const="full", metavar="POLICY")
  """per-layer rematerialisation: full (keep only each layer's inputs),
  save_attention_out (keep the attention output too) or none"""
  seed: int = _setting(0, type=int)
  """seed for the data and the initialisation"""
  parity_check: bool = _setting(True, flags=("--no-parity-check",), action="store_false")
  """compare the first step with the single-device model"""
  dataset: DataConfig = _setting(factory=DataConfig)
  optimizer: OptimizerConfig = _setting(factory=OptimizerConfig)
  parallel: ParallelConfig = _setting(factory=ParallelConfig)
  lora: LoraConfig = _setting(factory=LoraConfig)
  experts: ExpertsConfig = _setting(factory=ExpertsConfig)
  eval: EvalConfig = _setting(factory=EvalConfig)
  logging: LoggingConfig = _setting(factory=LoggingConfig)
  checkpointing: CheckpointingConfig = _setting(factory=CheckpointingConfig)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One leaf of :class:`RunConfig`: its dotted key, flat name, type, default
  and how its older flag parses."""

  key: str
  flat: str
  type: object
  default: object
  alias: dict


def settings(cls=RunConfig, prefix: str = "") -> list[Setting]:
  """Every leaf setting of ``cls`` in declaration order.

  >>> [s.key for s in settings()][:6]
  ['model', 'checkpoint', 'dtype', 'remat', 'seed', 'parity_check']
  """
  import typing

  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[f.name]):
      out += settings(hints[f.name], f"{prefix}{f.name}.")
    else:
      flat = f.metadata.get("flat") or f.name
      out.append(Setting(f"{prefix}{f.name}", flat, hints[f.name], f.default,
                         dict(f.metadata.get("alias", {}))))
  return out


def flat_settings() -> dict[str, Setting]:
  """``{flat name: setting}``: :class:`TrainJob`'s fields."""
  out = {s.flat: s for s in settings()}
  assert len(out) == len(settings()), "two settings share a flat name"
  return out


def _replace(run, key: str, value):
  head, _, rest = key.partition(".")
  if not rest:
    return dataclasses.replace(run, **{head: value})
  return dataclasses.replace(run, **{head: _replace(getattr(run, head), rest, value)})


def get(run: RunConfig, key: str):
  """The value of a dotted key: ``get(run, "optimizer.lr")``."""
  for part in key.split("."):
    run = getattr(run, part)
  return run


def with_values(run: RunConfig, values: dict) -> RunConfig:
  """``run`` with ``{dotted key: value}`` replaced."""
  for key, value in values.items():
    run = _replace(run, key, value)
  return run


def from_flat(**flat) -> RunConfig:
  """A :class:`RunConfig` from :class:`TrainJob`'s flat names (unknown names:
  ``TypeError``). ``remat`` may be a bool as before (True is ``full``)."""
  table = flat_settings()
  unknown = sorted(set(flat) - set(table))
  if unknown:
    raise TypeError(f"unknown TrainJob settings {unknown}; known: {sorted(table)}")
  if isinstance(flat.get("remat"), bool):
    flat["remat"] = "full" if flat["remat"] else "none"
  if flat.get("checkpoint") is not None and flat.get("model") == _FLAT_DEFAULTS["model"]:
    flat["model"] = None      # TrainJob's default model gives way to a checkpoint, as before
  return with_values(RunConfig(), {table[k].key: v for k, v in flat.items()})


# The flat form: one field per leaf, named by its flat name, as the job's
# settings were before they had sections. Generated, so that a setting is
# declared once (above); its model defaults to tiny, as it always did.
_FLAT_DEFAULTS = {"model": "tiny"}
TrainJob = dataclasses.make_dataclass(
    "TrainJob", [(s.flat, s.type, dataclasses.field(default=_FLAT_DEFAULTS.get(s.flat, s.default)))
                 for s in flat_settings().values()],
    frozen=True)
TrainJob.__module__ = __name__
TrainJob.__doc__ = """The run's settings under their flat names (``seq_len``,
``learning_rate``, ``lora_rank``, ...), for code written before
:class:`RunConfig`; :func:`as_run_config` turns one into a RunConfig.

>>> as_run_config(TrainJob(seq_len=64, learning_rate=0.1)).optimizer.lr
0.1
"""


def as_run_config(job) -> RunConfig:
  """``job`` as a :class:`RunConfig` (a TrainJob is converted)."""
  if isinstance(job, RunConfig):
    return job
  if isinstance(job, TrainJob):
    return from_flat(**{f.name: getattr(job, f.name) for f in dataclasses.fields(job)})
  raise TypeError(f"expected a RunConfig or a TrainJob, got {type(job).__name__}")


def _dotted(key: str) -> str:
  return key


def check(run: RunConfig, *, name: Callable[[str], str] = _dotted, files: bool = True) -> None:
  """Raise :class:`JobError` for the first setting that cannot run, before
  any compute. ``name(key)`` names a dotted key in the message (the command
  line names the flag the user typed); ``files``: also check that the paths
  given exist."""
  from cpjax.models.gemma4 import PRESETS

  def fail(message):
    raise JobError(message)

  for s in settings():
    value = get(run, s.key)
    literal = getattr(s.type, "__args__", ())
    if getattr(s.type, "__origin__", None) is Literal and value not in literal:
      fail(f"{name(s.key)} must be one of {list(literal)}, got {value!r}")
    if not _has_type(value, s.type):
      fail(f"{name(s.key)} must be {_type_name(s.type)}, got {value!r}")
    if s.alias.get("positive") and value is not None and not value > 0:
      fail(f"{name(s.key)} must be > 0, got {value!r}")
  for key in ("optimizer.warmup_steps", "eval.every", "checkpointing.save_every"):
    if get(run, key) < 0:
      fail(f"{name(key)} must be >= 0, got {get(run, key)}")
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
  if run.dataset.batch_size % run.dataset.microbatches:
    fail(f"{name('dataset.microbatches')} {run.dataset.microbatches} must divide "
         f"{name('dataset.batch_size')} {run.dataset.batch_size}")
  if run.checkpointing.save_every and run.checkpointing.state_dir is None:
    fail(f"{name('checkpointing.save_every')} needs {name('checkpointing.state_dir')}")
  if run.checkpointing.resume and run.checkpointing.state_dir is None:
    fail(f"{name('checkpointing.resume')} needs {name('checkpointing.state_dir')}")
  if run.eval.every and run.eval.data is None:
    fail(f"{name('eval.every')} needs {name('eval.data')}")
  if run.lora.rank is None:
    given = [name(f"lora.{f.name}") for f in dataclasses.fields(LoraConfig)
             if getattr(run.lora, f.name) != f.default]
    if given:
      fail(f"{', '.join(given)} needs {name('lora.rank')}")
  if run.lora.merge and run.checkpointing.save is None:
    fail(f"{name('lora.merge')} says what {name('checkpointing.save')} writes; add "
         f"{name('checkpointing.save')} DIR")
  if run.lora.targets is not None:
    try:
      re.compile(run.lora.targets)
    except re.error as e:
      fail(f"{name('lora.targets')} {run.lora.targets!r} is not a regular expression: {e}")
  if files:
    _check_files(run, name, fail)


def _has_type(value, hint) -> bool:
  """``value`` is a ``hint`` (int, float, bool, str, Optional[...], Literal)."""
  if typing.get_origin(hint) is typing.Union:
    return any(_has_type(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if typing.get_origin(hint) is Literal:
    return True                                   # checked above, with its choices
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)


def _type_name(hint) -> str:
  if typing.get_origin(hint) is typing.Union:
    return " or ".join(_type_name(h) for h in typing.get_args(hint))
  return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check_files(run: RunConfig, name, fail) -> None:
  if run.checkpoint is not None and not os.path.isfile(os.path.join(run.checkpoint,
                                                                    "config.json")):
    fail(f"{name('checkpoint')} {run.checkpoint} has no config.json")
  for key in ("dataset.path", "eval.data"):
    path = get(run, key)
    if path is not None and not os.path.exists(path):
      fail(f"{name(key)} {path} does not exist")
  if run.dataset.tokenizer is not None and not os.path.isfile(
      os.path.join(run.dataset.tokenizer, "tokenizer.json")):
    fail(f"{name('dataset.tokenizer')} {run.dataset.tokenizer} has no tokenizer.json")


def devices_needed(run: RunConfig) -> int:
  """Devices of the run's mesh (ep folds onto the other axes: not counted)."""
  return math.prod(v for k, v in run.parallel.mesh_sizes().items() if k != "ep")
