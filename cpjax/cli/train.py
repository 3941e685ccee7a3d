"""``cpjax train``: the run config from files and flags, its checks, the devices, the
memory check, then the trainer (:func:`cpjax.training.trainer.train`)."""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from cpjax.cli import machine
from cpjax.cli.plan import plan_config

if TYPE_CHECKING:  # the command line reads the run config only once it runs
  import jsonargparse

  from cpjax.training.run_config import RunConfig

# Pairs of settings that name the same thing; one given on the command line
# replaces the other's value from a file (a recipe's `model: e2b` gives way
# to --checkpoint DIR, its mesh to --cp N).
_ONE_OF = (("model", "checkpoint"), ("parallel.mesh", "parallel.cp"))


def train(parser: jsonargparse.ArgumentParser, argv: list[str]) -> int:
  """Run ``cpjax train``.

  Read the run config (:func:`read_run`), start JAX on the devices it names,
  train.

  Args:
    parser: ``cpjax train``'s parser.
    argv: the command line's arguments.

  Returns:
    The exit status.
  """
  from cpjax.training.run_config import devices_needed

  run, args = read_run(parser, argv)
  return _train_on_devices(parser, args, run, devices_needed(run))


def read_run(
  parser: jsonargparse.ArgumentParser, argv: list[str]
) -> tuple[RunConfig, jsonargparse.Namespace]:
  """Read ``cpjax train``'s run config and check it, before JAX starts.

  A recipe, files, dotted keys and their short flags, a resumed run's
  run.yaml; a usage error exits with status 2.

  Args:
    parser: ``cpjax train``'s parser.
    argv: the command line's arguments.

  Returns:
    ``(the RunConfig, the parsed namespace)``.
  """
  from cpjax.training.run_config import RunError, check, get, settings, with_values
  from cpjax.training.run_file import RUN_FILE, alias_flag, given_keys, run_from_namespace

  def fail(message):
    parser.exit(2, f"cpjax train: error: {message}\n")

  argv = _files_first(parser, argv)
  args = parser.parse_args(argv)
  if args.resume is not None:
    if not os.path.isdir(args.resume):
      fail(f"--resume {args.resume} is not a directory")
    saved = os.path.join(args.resume, RUN_FILE)
    if os.path.isfile(saved):  # the saved run, under this command line
      args = parser.parse_args(["--config", saved, *argv])
  aliases = given_keys(args)
  typed = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
  flags = {s.key: alias_flag(s) or "--" + s.key for s in settings()}
  defaults = {s.key: s.default for s in settings()}

  def given(key: str) -> bool:
    return key in aliases or "--" + key in typed

  def name(key: str) -> str:
    """A setting as the user gave it: the flag typed; the dotted key when a
    file set it; else (a setting at its default) its short flag."""
    if key in aliases or "--" + key in typed:
      return aliases.get(key) or "--" + key
    return key if get(run, key) != defaults[key] else flags[key]

  run = run_from_namespace(args)
  _keeps_the_files_axes(run, given, fail)
  for pair in _ONE_OF:
    for key, other in (pair, pair[::-1]):
      if given(key) and not given(other):
        run = with_values(run, {other: None})
  if given("checkpointing.resume"):
    fail("--checkpointing.resume: use --resume DIR (it reads the run's run.yaml)")
  if args.resume is not None:
    if given("checkpointing.state_dir"):
      fail("--resume DIR saves into DIR; do not add --state-dir")
    run = with_values(run, {"checkpointing.state_dir": args.resume, "checkpointing.resume": True})
  if run.checkpointing.save_every and run.checkpointing.state_dir is None:
    fail(f"{name('checkpointing.save_every')} needs --state-dir (or --resume)")
  try:
    check(run, name=name)
  except RunError as e:
    fail(e)
  return run, args


def _keeps_the_files_axes(run: "RunConfig", given, fail) -> None:
  """Refuse a command line ``--cp N`` that would drop axes of a file's mesh.

  ``--cp`` replaces a file's (a recipe's) mesh whole; where that mesh has more
  than cp (expert parallelism above all: ``a4b-qlora-128k-v5e``'s ep=16, without
  which the run does not fit), dropping them silently would start another run
  than the recipe's.
  """
  from cpjax.parallel import parse_mesh

  if not given("parallel.cp") or given("parallel.mesh") or run.parallel.mesh is None:
    return
  sizes = parse_mesh(run.parallel.mesh)
  others = ",".join(f"{k}={v}" for k, v in sizes.items() if k != "cp")
  if others:
    whole = ",".join(f"{k}={run.parallel.cp if k == 'cp' else v}" for k, v in sizes.items())
    fail(
      f"--cp {run.parallel.cp} would replace the run's mesh {run.parallel.mesh} and drop "
      f"its {others}; give the whole mesh instead, e.g. --mesh {whole}"
    )


def _train_on_devices(
  parser: jsonargparse.ArgumentParser,
  args: jsonargparse.Namespace,
  run: RunConfig,
  devices: int,
) -> int:
  """Start JAX on the run's devices, check its memory, train."""
  from cpjax.training.run_config import RunError

  def fail(message):
    parser.exit(2, f"cpjax train: error: {message}\n")

  _start_jax(parser, args, devices)
  import jax

  if jax.device_count() < devices:
    what = "--mesh" if run.parallel.mesh else f"--cp {run.parallel.cp or 8}"
    fail(
      f"{what} needs {devices} devices, found {jax.device_count()} "
      f"{jax.devices()[0].platform.upper()} devices"
    )
  from cpjax.training import trainer

  if not args.skip_memory_check:
    _check_memory(parser, run)
  # A RunError is a usage error found before any training compute; anything
  # else raised from here on is a crash: it propagates with its traceback.
  try:
    trainer.train(run)
  except RunError as e:
    fail(e)
  return 0


def _files_first(parser: jsonargparse.ArgumentParser, argv: list[str]) -> list[str]:
  """``argv`` with its files first: each ``--recipe NAME`` (as ``--config``
  of the shipped file) and ``--config FILE`` in the order given, then every
  other argument, so that a key on the command line beats every file
  wherever it stands."""
  from cpjax import recipes

  files, rest, i = [], [], 0
  while i < len(argv):
    flag, _, value = argv[i].partition("=")
    if flag in ("--recipe", "--config"):
      if not value:
        value = argv[i + 1] if i + 1 < len(argv) else ""
        i += 1
      if flag == "--recipe":
        try:
          value = recipes.path(value)
        except KeyError as e:
          parser.exit(2, f"cpjax train: error: --recipe: {e.args[0]}\n")
      files += ["--config", value]
    else:
      rest.append(argv[i])
    i += 1
  return files + rest


def _start_jax(
  parser: jsonargparse.ArgumentParser, args: jsonargparse.Namespace, devices_needed: int
) -> None:
  """Join the cluster the flags name, or emulate enough CPU devices."""
  explicit = [
    flag
    for flag, value in (
      ("--coordinator-address", args.coordinator_address),
      ("--num-processes", args.num_processes),
      ("--process-id", args.process_id),
    )
    if value is not None
  ]
  if args.auto_cluster and explicit:
    parser.exit(
      2,
      f"cpjax train: error: --auto-cluster detects the cluster itself; it cannot "
      f"be combined with {', '.join(explicit)}\n",
    )
  num_processes = 1 if args.num_processes is None else args.num_processes
  process_id = 0 if args.process_id is None else args.process_id
  if num_processes > 1:
    if not args.coordinator_address:
      parser.exit(2, "cpjax train: error: --num-processes > 1 needs --coordinator-address\n")
    if not 0 <= process_id < num_processes:
      parser.exit(
        2, f"cpjax train: error: --process-id must be in [0, {num_processes}), got {process_id}\n"
      )
    if devices_needed % num_processes:
      parser.exit(
        2,
        f"cpjax train: error: the mesh's {devices_needed} devices must be a "
        f"multiple of --num-processes {num_processes}\n",
      )
    machine.use_cpu_devices(devices_needed // num_processes, collectives="gloo")
    import jax

    jax.distributed.initialize(
      coordinator_address=args.coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
    )
  elif args.auto_cluster:
    import jax

    jax.distributed.initialize()
  else:
    machine.use_cpu_devices(max(devices_needed, 8))


def _check_memory(parser: argparse.ArgumentParser, run) -> None:
  """Refuse up front, with the plan's closed-form estimate, a run this machine
  cannot hold (instead of being killed by the kernel minutes later)."""
  import jax

  from cpjax.training import plan

  limit, what = machine.available_memory()
  if limit is None:
    return
  cfg, name = plan_config(
    parser, argparse.Namespace(command="train", model=run.model, checkpoint=run.checkpoint)
  )
  sizes = run.parallel.mesh_sizes()
  # The closed form as the compiler that will run it (XLA:TPU's off a GPU).
  platform = "cuda" if jax.devices()[0].platform == "gpu" else "tpu"
  try:
    rule = None if jax.devices()[0].platform == "cpu" else limit  # as the trainer's
    est = plan.estimate(cfg, run, model=name, platform=platform, device_memory=rule)
  except ValueError as e:  # a mesh the model cannot use (ep), before any compute
    parser.exit(2, f"cpjax train: error: --mesh: {e}\n")
  devices = math.prod(v for k, v in sizes.items() if k != "ep")
  if jax.devices()[0].platform == "cpu":
    # Emulated devices share the host: each holds its own copy or shard.
    need = est.total * devices // jax.process_count()
    if run.parity_check:
      need += plan.estimate(cfg, run, model=name, mesh={}).total
    where = f"{devices // jax.process_count()} emulated CPU devices need"
  else:
    need, where = est.total, "one device needs"
  if need > limit:
    parser.exit(
      2,
      f"cpjax train: error: {name} at --seq-len {run.dataset.seq_len} on mesh "
      f"{','.join(f'{k}={v}' for k, v in sizes.items())}: {where} about "
      f"{plan.format_bytes(need)} (cpjax plan's closed-form estimate: "
      f"{plan.format_bytes(est.total)} per device), more than the "
      f"{plan.format_bytes(limit)} of {what}; use a larger mesh, a shorter "
      f"--seq-len, --remat, or --skip-memory-check\n",
    )
