"""``cpjax plan``: memory per device for a model, a length and a mesh (compiled for
this machine or for a target's chips), or the smallest mesh that fits."""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from cpjax.cli import machine

if TYPE_CHECKING:
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training.plan import StepShape


def plan_config(
  parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[Gemma4Config, str]:
  """Return the (config, display name) of --model or --checkpoint.

  A bad config.json is a usage error.

  Args:
    parser: the command's parser (for the usage error).
    args: the parsed command line.

  Returns:
    (config, display name).
  """
  from cpjax.models.gemma4 import Gemma4Config

  if args.checkpoint is None:
    return Gemma4Config.preset(args.model or "tiny"), args.model or "tiny"
  if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
    parser.exit(
      2, f"cpjax {args.command}: error: --checkpoint {args.checkpoint} has no config.json\n"
    )
  try:
    cfg = Gemma4Config.from_hf(args.checkpoint)
  except (ValueError, KeyError, TypeError) as e:
    parser.exit(2, f"cpjax {args.command}: error: --checkpoint {args.checkpoint}: {e}\n")
  return cfg, os.path.basename(os.path.normpath(args.checkpoint))


def _run_of(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """The :class:`RunConfig` of ``--recipe`` / ``--config`` and the dotted keys
  after them (``--dataset.seq_len 262144``), read as cpjax train reads them;
  None when none was given."""
  keys = args.run_keys
  if args.recipe is None and args.config is None and not keys:
    return None
  stray = [k for k in keys if k.startswith("--") and "." not in k.split("=", 1)[0]]
  if stray or (keys and not keys[0].startswith("--")):
    parser.exit(
      2,
      f"cpjax plan: error: unrecognized arguments: {' '.join(stray or keys)} "
      f"(a run's settings are dotted keys, --section.key VALUE)\n",
    )
  from cpjax import recipes
  from cpjax.training.run_config import RunError
  from cpjax.training.run_file import run_from_namespace, run_parser

  try:
    path = recipes.path(args.recipe) if args.recipe is not None else args.config
  except KeyError as e:
    parser.exit(2, f"cpjax plan: error: --recipe: {e.args[0]}\n")
  argv = (["--config", path] if path is not None else []) + list(keys)
  try:
    return run_from_namespace(run_parser(aliases=False, exit_on_error=False).parse_args(argv))
  except (OSError, RunError) as e:
    what = "--recipe" if args.recipe is not None else "--config" if path else "a dotted key"
    parser.exit(2, f"cpjax plan: error: {what}: {e}\n")


def _from_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Fill the flags not given from the run config (``--recipe`` / ``--config``
  and dotted keys), as cpjax train would run it; the defaults for the rest."""
  args.run_keys = list(getattr(args, "run_keys", []))  # set by cpjax.cli.main
  run = args.run = _run_of(parser, args)
  # Without a file, only the settings the dotted keys name come from the run.
  typed = {k.split("=", 1)[0][2:] for k in args.run_keys if k.startswith("--")}
  # A mesh given here, before the run's fills it in (a bare --target refuses one).
  args.mesh_flag = args.mesh or ({"parallel.mesh", "parallel.cp"} & typed or None)
  whole = args.recipe is not None or args.config is not None

  def named(*keys):
    return run is not None and (whole or any(k in typed for k in keys))

  if named("model", "checkpoint") and args.model is None and args.checkpoint is None:
    assert run is not None  # named() says False without a run
    args.model, args.checkpoint = run.model, run.checkpoint
  if args.model is None and args.checkpoint is None:
    args.model = "tiny"
  if args.recipe is not None and args.audio_seconds is None:
    from cpjax import recipes

    # A long-audio recipe was planned with its clip.
    args.audio_seconds = recipes.RECIPES[args.recipe].audio_seconds or None
  if run is not None:
    # A step holds one microbatch at a time.
    rows = run.dataset.batch_size // run.dataset.microbatches
    given = {
      "seq_len": (run.dataset.seq_len, ("dataset.seq_len",)),
      "batch_size": (rows, ("dataset.batch_size", "dataset.microbatches")),
      "remat": (run.remat, ("remat",)),
      "shard_state": (run.parallel.shard_state, ("parallel.shard_state",)),
      "lora_rank": (run.lora.rank, ("lora.rank",)),
      "capacity_factor": (run.experts.capacity_factor, ("experts.capacity_factor",)),
      "mesh": (run.parallel.mesh_sizes(), ("parallel.mesh", "parallel.cp")),
      "base_dtype": (
        run.lora.base_dtype if run.lora.rank is not None else None,
        ("lora.base_dtype", "lora.rank"),
      ),
      "group_size": (run.lora.group_size, ("lora.group_size",)),
    }
    for key, (value, keys) in given.items():
      # A run's rows are its own even when no key names them: cpjax train
      # runs dataset.batch_size's default (a plan without a run: one row a
      # batch shard).
      if getattr(args, key) is None and (named(*keys) or key == "batch_size"):
        setattr(args, key, value)
  if args.seq_len is None:
    parser.exit(
      2,
      "cpjax plan: error: give --seq-len (or a run config: --recipe, --config, "
      "--dataset.seq_len)\n",
    )
  # Every setting left unset is the run config's default (StepShape's), so
  # the plan is of the run cpjax train would start.
  from cpjax.training.plan import StepShape

  default = StepShape(args.seq_len, None)
  ran = StepShape.of(run) if run is not None else default
  args.strategy = ran.strategy if named("parallel.strategy") else default.strategy
  args.remat = args.remat or default.remat
  args.shard_state = args.shard_state or default.shard_state
  args.lora_targets = ran.lora_targets if named("lora.targets") else default.lora_targets
  args.lora_target_parameters = (
    ran.lora_target_parameters
    if named("lora.target_parameters")
    else default.lora_target_parameters
  )
  args.layout = ran.layout if named("parallel.layout") else default.layout
  # The compiled step's activations: the run's dtype, float32 by default
  # (XLA:CPU's partitioner aborts on bfloat16 weight gradients over fsdp/tp).
  args.dtype_flag = args.dtype
  args.dtype_given = args.dtype is not None or (run is not None and named("dtype"))
  if args.dtype is None:
    args.dtype = run.dtype if run is not None and named("dtype") else default.dtype


def step_shape(args: argparse.Namespace, mesh: dict | None) -> StepShape:
  """Return the :class:`~cpjax.training.plan.StepShape` this plan is of, on ``mesh``.

  The one place ``cpjax plan`` turns its flags (filled from the run config
  by :func:`_from_run`) into the step it estimates, compiles or searches.

  Args:
    args: the parsed command line, after :func:`_from_run`.
    mesh: ``{axis: size}``, or None where a search picks it.
  """
  from cpjax.training.plan import StepShape

  return StepShape(
    seq_len=args.seq_len,
    mesh=None if mesh is None else dict(mesh),
    batch_size=args.batch_size,
    dtype=args.dtype,
    remat=args.remat,
    lora_rank=args.lora_rank,
    base_dtype=args.base_dtype or "float32",
    group_size=args.group_size,
    lora_targets=args.lora_targets,
    lora_target_parameters=args.lora_target_parameters,
    capacity_factor=args.capacity_factor,
    shard_state=args.shard_state,
    layout=args.layout,
    strategy=args.strategy,
    audio_seconds=args.audio_seconds or 0.0,
    video_frames=args.video_frames or 0,
    video_frame_tokens=args.video_frame_tokens,
  )


def _target(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """The ``--target`` chips (None without), its mesh and memory filled in; a
  bare chip (``--target v5e``) is that :class:`Chip`, whose slices
  :func:`_search` compiles."""
  args.mesh_of_target = False
  if args.target is None:
    return None
  from cpjax.training import targets

  chip = targets.CHIPS.get(targets.ALIASES.get(args.target.lower(), args.target.lower()))
  if chip is not None:
    if args.mesh_flag is not None:
      parser.exit(
        2,
        f"cpjax plan: error: --target {args.target} searches its slices and their meshes; "
        f"with --mesh name the slice ({chip.name}-N)\n",
      )
    if args.device_memory is None:
      args.device_memory = chip.memory
    return chip
  try:
    target = targets.parse_target(args.target)
  except ValueError as e:
    parser.exit(2, f"cpjax plan: error: --target: {e}\n")
  # The mesh defaults to cp over all the chips (ep folds onto it with
  # --expert-parallel, once the model is known: plan()).
  args.mesh_of_target = args.mesh is None
  if args.mesh is None:
    args.mesh = {"cp": target.num_devices}
  devices = math.prod(v for k, v in args.mesh.items() if k != "ep")
  if devices != target.num_devices:
    mesh = ",".join(f"{k}={v}" for k, v in args.mesh.items())
    parser.exit(
      2,
      f"cpjax plan: error: --mesh {mesh} has {devices} devices, --target "
      f"{args.target} has {target.num_devices} ({target.topology})\n",
    )
  if args.device_memory is None:
    args.device_memory = target.chip.memory
  return target


def plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """Run ``cpjax plan``: print the step's per-device memory and FLOPs.

  The closed-form estimate in bfloat16 and float32, and the compiled step unless
  ``--estimate-only``; without ``--mesh``, on the smallest fsdp x cp mesh that the
  estimate fits into ``--device-memory``. Writes ``--write-config`` when given.

  Args:
    parser: the command's parser (for usage errors).
    args: the parsed command line.

  Returns:
    The exit code: 1 when no mesh fits or the target's compiled step does not fit, else 0.
  """
  import time

  from cpjax.training import cp_strategy, plan, targets

  _from_run(parser, args)
  target = _target(parser, args)
  if isinstance(target, targets.Chip):
    return _search(parser, args, target)
  if args.mesh is None and args.device_memory is None:
    parser.exit(2, "cpjax plan: error: give --mesh, or --device-memory to search for one\n")
  if args.base_dtype is not None and args.lora_rank is None:
    parser.exit(2, "cpjax plan: error: --base-dtype needs --lora-rank\n")
  from cpjax.training.lora.quantize import QUANTIZED_DTYPES

  if args.group_size is not None and args.base_dtype not in QUANTIZED_DTYPES:
    parser.exit(
      2,
      "cpjax plan: error: --group-size needs a quantized --base-dtype "
      f"({', '.join(QUANTIZED_DTYPES)})\n",
    )
  if args.expert_parallel and args.mesh is not None and not args.mesh_of_target:
    parser.exit(
      2,
      "cpjax plan: error: --expert-parallel searches meshes; with --mesh give "
      "ep in it (e.g. fsdp=2,cp=4,ep=8)\n",
    )
  if args.dtype_flag is not None and target is None:
    parser.exit(
      2,
      "cpjax plan: error: --dtype sets the activations of a --target compile; "
      "XLA:CPU compiles float32 (its partitioner aborts on bfloat16 gradients "
      "over fsdp/tp), and the estimate prints both\n",
    )
  if target is not None and args.estimate_only:
    parser.exit(2, "cpjax plan: error: --target compiles; it does not go with --estimate-only\n")
  cfg, name = plan_config(parser, args)
  # The closed form follows the target's compiler (XLA:TPU's without one).
  platform = target.chip.platform if target is not None else "tpu"
  mesh = args.mesh
  if args.mesh_of_target and args.expert_parallel and cfg.text.enable_moe_block:
    # As the target search folds it: ep over the chips' cp, which must divide the experts.
    if cfg.text.num_experts % mesh["cp"]:
      parser.exit(
        2,
        f"cpjax plan: error: --expert-parallel folds ep onto --target {args.target}'s "
        f"cp={mesh['cp']}, which does not divide the {cfg.text.num_experts} experts; "
        "give --mesh with ep in it\n",
      )
    mesh = {**mesh, "ep": mesh["cp"]}
  if mesh is None:
    # The fewest devices that hold the step in the activations the run
    # names, else in bfloat16, the lighter of the two the estimate prints
    # (--write-config then keeps float32 where that fits too).
    found = plan.smallest_mesh(
      cfg,
      step_shape(args, None),
      dtype=args.dtype if args.dtype_given else "bfloat16",
      model=name,
      device_memory=args.device_memory,
      expert_parallel=args.expert_parallel,
      platform=platform,
    )
    if found is None:
      print(
        f"no fsdp x cp mesh up to 4096 devices fits {name} at S={args.seq_len} "
        f"into {plan.format_bytes(args.device_memory)} per device (estimate)"
      )
      return 1
    mesh = found.mesh
  shards = mesh.get("fsdp", 1) * mesh.get("dp", 1)
  if args.batch_size is not None and args.batch_size % shards:
    parser.exit(
      2,
      f"cpjax plan: error: a step's {args.batch_size} row(s) (--batch-size, or the "
      f"run's dataset.batch_size / dataset.microbatches) must be a multiple of "
      f"the mesh's fsdp x dp = {shards}\n",
    )
  devices = math.prod(v for k, v in mesh.items() if k != "ep")
  # (With --target the CPU devices only lay out the abstract batch.)
  machine.use_cpu_devices(devices)
  seconds = None
  try:
    shape = step_shape(args, mesh)
    choices = cp_strategy.choose(
      cfg.text,
      seq_len=args.seq_len,
      cp=mesh.get("cp", 1),
      tp=mesh.get("tp", 1),
      layout=shape.layout,
      device_memory=args.device_memory,
    )
    memory = args.device_memory
    rows = [
      plan.estimate(cfg, shape, model=name, dtype=d, platform=platform, device_memory=memory)
      for d in ("bfloat16", "float32")
    ]
    if not args.estimate_only:
      start = time.perf_counter()
      dtype = args.dtype if target is not None else "float32"
      rows.append(
        plan.compiled_plan(cfg, shape, model=name, target=target, dtype=dtype, device_memory=memory)
      )
      seconds = time.perf_counter() - start
  except ImportError as e:  # a target's compiler is not installed
    parser.exit(2, f"cpjax plan: error: --target: {e}\n")
  except ValueError as e:  # a mesh the model cannot use: a usage error, before compiling
    parser.exit(2, f"cpjax plan: error: {e}\n")
  where = "" if target is None else f" ({target.chip.kind}, {target.topology})"
  inputs = f", {args.audio_seconds:g} s of audio a row" if args.audio_seconds else ""
  if args.video_frames:
    inputs += f", a video of {args.video_frames} frames a row"
  print(
    f"cpjax plan: Gemma 4 {name}, S={args.seq_len}{inputs}, remat {args.remat}, "
    f"{rows[0].training} training, {devices} devices{where}; per device:"
  )
  for row in rows:
    fits = ""
    if args.device_memory is not None:
      fits = ("  fits " if row.fits(args.device_memory) else "  does NOT fit ") + plan.format_bytes(
        args.device_memory
      )
    print(f"  {row.row()} [{row.dtype} activations]{fits}")
  if args.strategy != "auto":
    print(f"  cp strategy: {args.strategy} (the run's parallel.strategy)")
  for kind, choice in choices.items():  # what cpjax train's parallel.strategy auto takes
    taken = "" if args.strategy == "auto" else ", not taken"
    print(f"  cp strategy for {kind}: {choice.strategy} ({choice.why}{taken})")
  if seconds is not None:
    compiled = rows[-1]
    moved = ", ".join(
      f"{k} {plan.format_bytes(v)}" for k, v in sorted(compiled.collectives.items())
    )
    compiler = "XLA:CPU" if target is None else f"{target.name}'s compiler"
    if compiled.refused:
      print(
        f"  refused by {compiler} in {seconds:.0f} s: past the chip's memory (the total is "
        f"the state and the temporaries it named, at least)"
      )
    else:
      print(
        f"  compiled by {compiler} in {seconds:.0f} s; collectives per step (outputs, a loop "
        f"body once): {moved or 'none'}"
      )
      if compiled.step is not None:
        assert target is not None  # only a target's chip gives a step time
        print(f"  step time on {target.name}, from the compiled program: {compiled.step.summary()}")
      elif target is not None:
        missing = ", ".join(target.chip.missing_figures())
        print(f"  no step time: {target.chip.name} has no {missing} figure")
  compiled = rows[-1] if target is not None else None
  if args.write_config is not None:
    if compiled is not None and not compiled.fits(args.device_memory):
      assert target is not None  # compiled is a target's
      print(f"not written: {args.write_config} (the step does not fit by {target.name}'s compiler)")
    else:
      _write_config(args, cfg, name, rows, mesh, compiled, platform)
  if compiled is not None and not compiled.fits(args.device_memory):
    return 1
  return 0


def _search(parser: argparse.ArgumentParser, args: argparse.Namespace, chip) -> int:
  """``cpjax plan --target CHIP``: compile the step for the chip's slices (the
  target search, :func:`cpjax.training.plan.smallest_slice`) and print each;
  the smallest that fits is the plan (``--write-config`` writes it)."""
  import time

  from cpjax.training import plan

  if args.estimate_only:
    parser.exit(2, "cpjax plan: error: --target compiles; it does not go with --estimate-only\n")
  if args.base_dtype is not None and args.lora_rank is None:
    parser.exit(2, "cpjax plan: error: --base-dtype needs --lora-rank\n")
  from cpjax.training.lora.quantize import QUANTIZED_DTYPES

  if args.group_size is not None and args.base_dtype not in QUANTIZED_DTYPES:
    parser.exit(
      2,
      "cpjax plan: error: --group-size needs a quantized --base-dtype "
      f"({', '.join(QUANTIZED_DTYPES)})\n",
    )
  cfg, name = plan_config(parser, args)
  # A run with ep keeps expert parallelism: each searched mesh folds the
  # largest ep dividing the experts onto its token axes.
  expert_parallel = args.expert_parallel or "ep" in (args.mesh or {})
  largest = 4096
  machine.use_cpu_devices(largest)  # (they lay out the abstract batch only)
  shape = step_shape(args, None)
  print(
    f"cpjax plan: Gemma 4 {name}, S={args.seq_len}, remat {args.remat}, searching the "
    f"slices of {chip.name} ({plan.format_bytes(args.device_memory)} a device) from the "
    f"closed form's smallest; each compiled by its compiler:"
  )
  start = time.perf_counter()

  def report(row):
    fits = "fits" if row.fits(args.device_memory) else "does NOT fit"
    seconds = time.perf_counter() - start
    print(
      f"  {row.row()} [{row.dtype} activations]  {fits} "
      f"{plan.format_bytes(args.device_memory)} ({seconds:.0f} s in)",
      flush=True,
    )

  try:
    found, tried = plan.smallest_slice(
      cfg,
      shape,
      chip=chip,
      model=name,
      max_devices=largest,
      expert_parallel=expert_parallel,
      device_memory=args.device_memory,
      report=report,
    )
  except ImportError as e:  # the chip's compiler is not installed
    parser.exit(2, f"cpjax plan: error: --target: {e}\n")
  except ValueError as e:
    parser.exit(2, f"cpjax plan: error: {e}\n")
  seconds = time.perf_counter() - start
  if found is None:
    why = (
      f"{len(tried)} compiled, {seconds:.0f} s" if tried else "by the closed form; none compiled"
    )
    print(
      f"no slice of {chip.name} up to {largest} devices fits {name} at S={args.seq_len} ({why})"
    )
    return 1
  print(
    f"  smallest: {found.source} ({len(tried)} compiled in {seconds:.0f} s); "
    f"cpjax plan --target {found.source} plans it alone"
  )
  if args.write_config is not None:
    rows = [
      plan.estimate(
        cfg,
        shape,
        model=name,
        mesh=found.mesh,
        dtype=d,
        platform=chip.platform,
        device_memory=args.device_memory,
      )
      for d in ("bfloat16", "float32")
    ]
    _write_config(args, cfg, name, rows, found.mesh, found, chip.platform)
  return 0


def _write_config(
  args, cfg, name: str, rows, mesh: dict, compiled=None, platform: str = "tpu"
) -> None:
  """``--write-config FILE``: the plan as a run config. Activations in float32
  when that fits ``--device-memory`` (or no memory was given), else bfloat16;
  with ``--target``, the activations its compiler accepted (``compiled``, a
  step that fits), whose figure the note gives beside the closed form's. The
  first step's parity check (the step again on one device) only when one
  device holds that step."""
  from cpjax.training import plan
  from cpjax.training.run_config import RunConfig, with_values
  from cpjax.training.run_file import to_yaml

  estimates = {row.dtype: row for row in rows if row.source == "estimate"}
  fitting = [
    d
    for d in ("float32", "bfloat16")
    if args.device_memory is None or estimates[d].fits(args.device_memory)
  ]
  dtype = fitting[0] if fitting else "float32"
  if compiled is not None:
    dtype = compiled.dtype
  fsdp = mesh.get("fsdp", 1) * mesh.get("dp", 1)
  batch = args.batch_size or fsdp
  parity = args.device_memory is None or plan.estimate(
    cfg,
    step_shape(args, {}),
    model=name,
    dtype=dtype,
    batch_size=batch,
    platform=platform,
  ).fits(args.device_memory)
  # The run read (a recipe, a file, dotted keys) keeps every setting the plan
  # does not choose: its data, optimizer, checkpointing, ...
  base = args.run if args.run is not None else RunConfig()
  run = with_values(
    base,
    {
      "model": args.model,
      "checkpoint": args.checkpoint,
      "dtype": dtype,
      "remat": args.remat,
      "parity_check": parity,
      "dataset.seq_len": args.seq_len,
      # plan's batch is one microbatch's rows
      "dataset.batch_size": batch * base.dataset.microbatches,
      "parallel.mesh": ",".join(f"{k}={v}" for k, v in mesh.items()),
      "parallel.cp": None,
      "parallel.shard_state": args.shard_state,
      "lora.rank": args.lora_rank,
      "lora.base_dtype": args.base_dtype or "float32",
      "lora.group_size": args.group_size,
      "experts.capacity_factor": args.capacity_factor,
    },
  )
  where = (
    f"{plan.format_bytes(args.device_memory)} per device"
    if args.device_memory
    else "no device memory given"
  )
  est = estimates[dtype]
  verdict = (
    ""
    if args.device_memory is None
    else (" fits" if est.fits(args.device_memory) else " does NOT fit")
  )
  row = " ".join(est.row().split())
  note = f"planned by cpjax plan: {row} [{dtype} activations]{verdict} ({where})"
  if compiled is not None:
    note += (
      f"\ncompiled by {compiled.source}'s compiler: "
      f"{plan.format_bytes(compiled.total)} per device, fits"
    )
  with open(args.write_config, "w") as f:
    f.write(to_yaml(run, note))
  print(
    f"wrote the run config to {args.write_config}: cpjax train --config {args.write_config} runs it"
  )
