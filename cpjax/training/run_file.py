"""A run's config as a YAML file (``run.yaml``), and the parser that reads it.

The parser is jsonargparse's, built from :class:`~cpjax.training.run_config.RunConfig`:
every setting is a dotted key on the command line (``--optimizer.lr 1e-4``)
and in a YAML file (``optimizer: {lr: 1e-4}``), typed, documented and
checked by jsonargparse from the dataclasses; ``--config FILE`` reads a file
where it stands, so later keys override it. The short flags of
:data:`FLAGS` (``--lr``, ``--seq-len``, ...) are aliases of dotted keys.

Every run writes its resolved config, defaults included, as ``run.yaml``;
passed back with ``--config`` (or read with :func:`read_run_config`) it is
the same run.

>>> import tempfile
>>> from cpjax.training.run_config import DatasetConfig, RunConfig
>>> run = RunConfig(model="tiny", dataset=DatasetConfig(seq_len=64))
>>> with tempfile.TemporaryDirectory() as d:
...   read_run_config(write_run_config(run, d)) == run
True
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import typing
from typing import TYPE_CHECKING

from cpjax.training.run_config import (
  MODEL_FLAGS,
  RunConfig,
  RunError,
  Setting,
  settings,
  with_values,
)

if TYPE_CHECKING:
  import jsonargparse

__all__ = [
  "FLAGS",
  "RUN_FILE",
  "alias_flag",
  "given_keys",
  "positive_float",
  "positive_int",
  "read_run_config",
  "run_from_namespace",
  "run_parser",
  "to_yaml",
  "write_run_config",
]

RUN_FILE = "run.yaml"
_ALIAS = "alias__"  # an alias's argparse dest: alias__<key with dots as __>


class _ArgType:
  """An argparse type with a readable name in ``--help``."""

  def __init__(self, name: str, parse):
    self.name, self.parse = name, parse

  def __call__(self, text: str):
    return self.parse(text)

  def __repr__(self):
    return self.name


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
  return value


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
  if not value > 0:
    raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
  return value


positive_int = _ArgType("int >= 1", _positive_int)  # argparse type: an integer >= 1
positive_float = _ArgType("float > 0", _positive_float)  # argparse type: a number > 0


def _parse_mesh(text: str) -> str:
  from cpjax.parallel import parse_mesh

  try:
    parse_mesh(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


_mesh = _ArgType("AXIS=N,...", _parse_mesh)


# The command line's short flags: {dotted key: (flag, argparse keywords)}.
# Each is an alias of its key (``--lr 1e-4`` is ``--optimizer.lr 1e-4``);
# the keywords say how it parses beyond what the setting's type gives. A
# top-level setting whose flag is its key (``--model``) is that flag itself.
FLAGS: dict[str, tuple[str, dict]] = {
  "model": ("--model", {"choices": MODEL_FLAGS}),
  "checkpoint": ("--checkpoint", {"metavar": "DIR"}),
  "dtype": ("--dtype", {}),
  "remat": ("--remat", {"nargs": "?", "const": "full", "metavar": "POLICY"}),
  "seed": ("--seed", {"type": int}),
  "parity_check": ("--no-parity-check", {"action": "store_false"}),
  "dataset.path": ("--data", {"metavar": "PATH"}),
  "dataset.tokenizer": ("--tokenizer", {"metavar": "DIR"}),
  "dataset.truncate": ("--truncate", {}),
  "dataset.seq_len": ("--seq-len", {}),
  "dataset.batch_size": ("--batch-size", {}),
  "dataset.microbatches": ("--microbatches", {"metavar": "K"}),
  "dataset.images_per_row": ("--images-per-row", {"metavar": "N"}),
  "dataset.audio_clips_per_row": ("--audio-clips-per-row", {"metavar": "N"}),
  "dataset.videos_per_row": ("--videos-per-row", {"metavar": "N"}),
  "optimizer.lr": ("--lr", {}),
  "optimizer.schedule": ("--lr-schedule", {}),
  "optimizer.warmup_steps": ("--warmup-steps", {"metavar": "N"}),
  "optimizer.max_grad_norm": ("--max-grad-norm", {"metavar": "X"}),
  "optimizer.steps": ("--steps", {}),
  "parallel.mesh": ("--mesh", {"metavar": "AXIS=N,..."}),
  "parallel.cp": ("--cp", {}),
  "parallel.layout": ("--layout", {}),
  "parallel.shard_state": ("--shard-state", {}),
  "lora.rank": ("--lora-rank", {"metavar": "R"}),
  "lora.alpha": ("--lora-alpha", {"metavar": "A"}),
  "lora.targets": ("--lora-targets", {"metavar": "REGEX"}),
  "lora.base_dtype": ("--base-dtype", {}),
  "lora.merge": ("--merge-lora", {}),
  "experts.capacity_factor": ("--capacity-factor", {"metavar": "C"}),
  "eval.data": ("--eval-data", {"metavar": "PATH"}),
  "eval.every": ("--eval-every", {"metavar": "N"}),
  "eval.rows": ("--eval-rows", {"metavar": "N"}),
  "logging.metrics": ("--metrics", {"metavar": "FILE"}),
  "logging.tensorboard": ("--tensorboard", {"metavar": "DIR"}),
  "checkpointing.state_dir": ("--state-dir", {"metavar": "DIR"}),
  "checkpointing.save_every": ("--save-every", {"metavar": "N"}),
  "checkpointing.force_resume": ("--force-resume", {}),
  "checkpointing.save": ("--save", {"metavar": "DIR"}),
}


def alias_flag(s: Setting) -> str | None:
  """Return the short flag of a setting (``--seq-len``), or None.

  Args:
    s: the setting.

  Returns:
    The short flag, or None.
  """
  return FLAGS[s.key][0] if s.key in FLAGS else None


def _alias_kwargs(s: Setting) -> dict:
  """argparse keywords of the short flag."""
  kwargs = dict(FLAGS[s.key][1])
  base: typing.Any = s.type  # int for Optional[int]
  if typing.get_origin(base) is typing.Union:
    base = next(t for t in typing.get_args(base) if t is not type(None))
  if typing.get_origin(base) is not typing.Literal and base is not bool and "choices" not in kwargs:
    kwargs.setdefault("metavar", {int: "N", float: "X"}.get(base, "VALUE"))
  if typing.get_origin(base) is typing.Literal:
    kwargs.setdefault("choices", typing.get_args(base))
  elif base is bool:
    kwargs.setdefault("action", "store_true")
  elif s.key == "parallel.mesh":
    kwargs.setdefault("type", _mesh)
  elif base in (int, float):
    kwargs.setdefault(
      "type", (positive_int if base is int else positive_float) if s.positive else base
    )
  return kwargs


class _RunParser(argparse.ArgumentParser):
  """Mixed into jsonargparse's parser (an ``argparse.ArgumentParser``): a usage
  error is one line, exit 2 (or, reading a file from Python, a :class:`RunError`)."""

  def error(self, message, ex=None):  # noqa: D401 -- argparse's hook
    if not self.exit_on_error:
      raise RunError(one_line(message))
    self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def one_line(message: str) -> str:
  """Rewrite jsonargparse's multi-line type errors as one line that names the key.

  Args:
    message: jsonargparse's error message.

  Returns:
    The one-line message.

  >>> one_line('Parser key "dataset.seq_len":\\n  Expected a <class \\'int\\'>. Got value: x')
  "--dataset.seq_len: expected int, got 'x'"
  """
  key = re.match(r'Parser key "([^"]+)":', message)
  value = re.search(r"(?:Got|Given) value: (.*)$", message.strip())
  if key and value:
    types = {s.key: s.type for s in settings()}
    expected = types.get(key.group(1))
    expected = (
      list(typing.get_args(expected))
      if typing.get_origin(expected) is typing.Literal
      else getattr(expected, "__name__", None) or str(expected).replace("typing.", "")
    )
    return f"--{key.group(1)}: expected {expected}, got {value.group(1)!r}"
  return " ".join(message.split())


def run_parser(
  prog: str = "cpjax train",
  description: str | None = None,
  *,
  aliases: bool = True,
  exit_on_error: bool = True,
) -> jsonargparse.ArgumentParser:
  """Build jsonargparse's parser of a :class:`RunConfig`: ``--config FILE``
  and every setting by its dotted key (the top-level ones, ``--model``,
  ``--dtype``, ..., by their name), typed by their annotations, with the
  short flags of :data:`FLAGS` as aliases. Each setting's help is its
  docstring."""
  import jsonargparse

  parser_class = type("RunParser", (_RunParser, jsonargparse.ArgumentParser), {})
  # No --print_config (it would print the parser's namespace, aliases and the
  # command line's own flags, not the run: run.yaml is the run), and no
  # abbreviated keys (what the user typed must be what it names).
  parser = parser_class(
    prog=prog,
    description=description,
    exit_on_error=exit_on_error,
    print_config=None,
    allow_abbrev=False,
  )
  parser.add_argument(
    "--config",
    action=jsonargparse.ActionConfigFile,
    metavar="FILE",
    help="a YAML run config (a recipe, or the run.yaml a run wrote); keys "
    "after it on the command line override it",
  )
  hints = typing.get_type_hints(RunConfig)
  groups = {
    f.name: parser.add_argument_group(hints[f.name].__doc__.split("\n")[0].rstrip("."), name=f.name)
    for f in dataclasses.fields(RunConfig)
    if dataclasses.is_dataclass(hints[f.name])
  }
  assert RunConfig.__doc__ is not None  # @dataclass always sets one
  top = parser.add_argument_group(RunConfig.__doc__.rstrip("."))
  for s in settings():
    flag = alias_flag(s)
    if "." not in s.key and flag == "--" + s.key:
      # A top-level setting whose flag is its key (--model, --remat): one
      # argument, parsed with its FLAGS keywords (--remat alone means full).
      top.add_argument(flag, dest=s.key, default=s.default, help=_doc(s), **_alias_kwargs(s))
      continue
    group = groups[s.key.split(".")[0]] if "." in s.key else top
    group.add_argument("--" + s.key, type=s.type, default=s.default, help=_doc(s))
    if aliases and flag is not None:
      kwargs = _alias_kwargs(s)
      inverted = " false" if kwargs.get("action") == "store_false" else ""
      dest = _ALIAS + s.key.replace(".", "__")
      group.add_argument(
        flag, dest=dest, default=argparse.SUPPRESS, help=f"= --{s.key}{inverted}", **kwargs
      )
  return parser


def _doc(s: Setting) -> str:
  """A setting's docstring (the string under its field), on one line."""
  section, _, field = s.key.rpartition(".")
  cls = typing.get_type_hints(RunConfig)[section] if section else RunConfig
  return _field_docs(cls).get(field, "")


@functools.cache
def _field_docs(cls) -> dict[str, str]:
  import docstring_parser

  return {
    p.arg_name: " ".join((p.description or "").split())
    for p in docstring_parser.parse_from_object(cls).params
  }


def given_keys(namespace: jsonargparse.Namespace) -> dict[str, str]:
  """List the aliases the command line gave.

  Args:
    namespace: the parsed command line.

  Returns:
    ``{dotted key: flag}`` for each alias the command line gave.
  """
  out: dict[str, str] = {}
  for s in settings():
    if namespace.get(_ALIAS + s.key.replace(".", "__"), argparse.SUPPRESS) is not argparse.SUPPRESS:
      flag = alias_flag(s)
      assert flag is not None  # only a short flag sets its key
      out[s.key] = flag
  return out


def run_from_namespace(namespace: jsonargparse.Namespace) -> RunConfig:
  """Return the :class:`RunConfig` a parsed command line (or file) describes.

  An alias beats the dotted key's value (the file's, or the command line's).

  Args:
    namespace: the parsed command line (or file).

  Returns:
    The :class:`RunConfig`.
  """
  values = {}
  for s in settings():
    alias = namespace.get(_ALIAS + s.key.replace(".", "__"), argparse.SUPPRESS)
    values[s.key] = namespace.get(s.key) if alias is argparse.SUPPRESS else alias
  return with_values(RunConfig(), values)


def to_yaml(run: RunConfig, note: str | None = None) -> str:
  """Write the resolved config as YAML, every value, under a comment naming cpjax's version.

  ``checkpointing.resume`` and ``force_resume`` say how one command started,
  not what the run is: they are written false (``--resume`` and
  ``--force-resume`` ask again).

  Args:
    run: the :class:`RunConfig`.
    note: lines to add to the comment, or None.

  Returns:
    The YAML text.
  """
  import importlib.metadata

  import yaml

  version = importlib.metadata.version("cpjax")
  run = with_values(run, {"checkpointing.resume": False, "checkpointing.force_resume": False})

  def plain(value):  # YAML has lists, not tuples (lora.targets' module names)
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value

  body = yaml.safe_dump(plain(dataclasses.asdict(run)), sort_keys=False, default_flow_style=False)
  head = [f"cpjax {version} run config (cpjax train --config FILE runs it)"]
  head += (note or "").splitlines()
  return "".join(f"# {line}".rstrip() + "\n" for line in head) + body


def write_run_config(run: RunConfig, directory: str | os.PathLike) -> str:
  """Write ``directory/run.yaml`` and return its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, RUN_FILE)
  with open(path, "w") as f:
    f.write(to_yaml(run))
  return path


def read_run_config(path: str | os.PathLike) -> RunConfig:
  """Read the :class:`RunConfig` of a YAML file (a ``run.yaml`` or a recipe).

  Args:
    path: the YAML file.

  Returns:
    The :class:`RunConfig`.

  Raises:
    RunError: naming the key, for unknown keys and wrong types.
  """
  parser = run_parser(aliases=False, exit_on_error=False)
  try:
    namespace = parser.parse_args(["--config", os.fspath(path)])
  except RunError as e:
    raise RunError(f"{path}: {e}") from None
  return run_from_namespace(namespace)
