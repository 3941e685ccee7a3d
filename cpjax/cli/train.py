"""``cpjax train``: the flags' checks, the devices, the memory check, then the job."""

from __future__ import annotations

import math
import os

from cpjax.cli import machine
from cpjax.cli.plan import plan_config


def train(parser, args) -> int:
  """``cpjax train``: check the flags, start JAX on the devices they name, run the job."""
  if args.model is not None and args.checkpoint is not None:
    parser.exit(2, "cpjax train: error: --model and --checkpoint exclude each other\n")
  if args.checkpoint is not None and not os.path.isfile(os.path.join(args.checkpoint,
                                                                     "config.json")):
    parser.exit(2, f"cpjax train: error: --checkpoint {args.checkpoint} has no config.json\n")
  if args.resume is not None and args.state_dir is not None:
    parser.exit(2, "cpjax train: error: --resume DIR saves into DIR; do not add --state-dir\n")
  if args.save_every is not None and args.resume is None and args.state_dir is None:
    parser.exit(2, "cpjax train: error: --save-every needs --state-dir (or --resume)\n")
  if args.resume is not None and not os.path.isdir(args.resume):
    parser.exit(2, f"cpjax train: error: --resume {args.resume} is not a directory\n")
  for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
    if path is not None and not os.path.exists(path):
      parser.exit(2, f"cpjax train: error: {flag} {path} does not exist\n")
  if args.tokenizer is not None and not os.path.isfile(os.path.join(args.tokenizer,
                                                                    "tokenizer.json")):
    parser.exit(2, f"cpjax train: error: --tokenizer {args.tokenizer} has no tokenizer.json\n")
  if args.eval_every is not None and args.eval_data is None:
    parser.exit(2, "cpjax train: error: --eval-every needs --eval-data\n")
  if args.warmup_steps < 0:
    parser.exit(2, f"cpjax train: error: --warmup-steps must be >= 0, got {args.warmup_steps}\n")
  if args.seq_len < 32:
    parser.exit(2, f"cpjax train: error: --seq-len must be >= 32, got {args.seq_len}\n")
  if args.mesh is not None and args.cp is not None:
    parser.exit(2, "cpjax train: error: --mesh sets the cp size; do not add --cp\n")
  if args.mesh is not None and args.mesh.get("dp", 1) > 1 and args.mesh.get("fsdp", 1) > 1:
    parser.exit(2, "cpjax train: error: --mesh splits the batch over dp or fsdp, not both\n")
  if args.batch_size % args.microbatches:
    parser.exit(2, f"cpjax train: error: --microbatches {args.microbatches} must divide "
                   f"--batch-size {args.batch_size}\n")
  if args.lora_rank is None:
    given = [flag for flag, value in (("--lora-alpha", args.lora_alpha),
                                      ("--lora-targets", args.lora_targets),
                                      ("--base-dtype", args.base_dtype),
                                      ("--merge-lora", args.merge_lora or None))
             if value is not None]
    if given:
      parser.exit(2, f"cpjax train: error: {', '.join(given)} needs --lora-rank\n")
  if args.merge_lora and args.save is None:
    parser.exit(2, "cpjax train: error: --merge-lora says what --save writes; add --save DIR\n")
  if args.lora_targets is not None:
    import re

    try:
      re.compile(args.lora_targets)
    except re.error as e:
      parser.exit(2, f"cpjax train: error: --lora-targets {args.lora_targets!r} is not a "
                     f"regular expression: {e}\n")
  args.cp = 8 if args.cp is None and args.mesh is None else args.cp
  devices_needed = (math.prod(v for k, v in args.mesh.items() if k != "ep") if args.mesh
                    else args.cp)
  explicit = [flag for flag, value in (("--coordinator-address", args.coordinator_address),
                                       ("--num-processes", args.num_processes),
                                       ("--process-id", args.process_id)) if value is not None]
  if args.auto_cluster and explicit:
    parser.exit(2, f"cpjax train: error: --auto-cluster detects the cluster itself; it cannot "
                   f"be combined with {', '.join(explicit)}\n")
  args.num_processes = 1 if args.num_processes is None else args.num_processes
  args.process_id = 0 if args.process_id is None else args.process_id
  if args.num_processes > 1:
    if not args.coordinator_address:
      parser.exit(2, "cpjax train: error: --num-processes > 1 needs --coordinator-address\n")
    if not 0 <= args.process_id < args.num_processes:
      parser.exit(2, f"cpjax train: error: --process-id must be in [0, {args.num_processes}), "
                     f"got {args.process_id}\n")
    if devices_needed % args.num_processes:
      parser.exit(2, f"cpjax train: error: the mesh's {devices_needed} devices must be a "
                     f"multiple of --num-processes {args.num_processes}\n")
    machine.use_cpu_devices(devices_needed // args.num_processes, collectives="gloo")
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
  elif args.auto_cluster:
    import jax

    jax.distributed.initialize()
  else:
    machine.use_cpu_devices(max(devices_needed, 8))
  import jax

  if jax.device_count() < devices_needed:
    what = "--mesh" if args.mesh else f"--cp {args.cp}"
    parser.exit(2, f"cpjax train: error: {what} needs {devices_needed} devices, found "
                   f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices\n")
  from cpjax.training.train_job import JobError, TrainJob, run_train_job

  sizes = dict(args.mesh) if args.mesh else {"cp": args.cp}
  if not args.skip_memory_check:
    cfg, name = plan_config(parser, args)
    _check_memory(parser, args, cfg, name, sizes)
  mesh = ",".join(f"{k}={v}" for k, v in args.mesh.items()) if args.mesh else None
  job = TrainJob(seq_len=args.seq_len, cp=args.cp or args.mesh.get("cp", 1), mesh=mesh,
                 microbatches=args.microbatches, layout=args.layout, steps=args.steps,
                 seed=args.seed, dtype=args.dtype, batch_size=args.batch_size,
                 learning_rate=args.lr, parity_check=not args.no_parity_check,
                 model=args.model or "tiny", checkpoint=args.checkpoint, remat=args.remat,
                 save=args.save, data=args.data, state_dir=args.resume or args.state_dir,
                 save_every=args.save_every or 0, resume=args.resume is not None,
                 force_resume=args.force_resume, tokenizer=args.tokenizer,
                 truncate=args.truncate, eval_data=args.eval_data,
                 eval_every=args.eval_every or 0, eval_rows=args.eval_rows,
                 warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
                 max_grad_norm=args.max_grad_norm, metrics=args.metrics,
                 tensorboard=args.tensorboard, images_per_row=args.images_per_row,
                 lora_rank=args.lora_rank, lora_alpha=args.lora_alpha or 8.0,
                 lora_targets=args.lora_targets, base_dtype=args.base_dtype or "float32",
                 merge_lora=args.merge_lora, capacity_factor=args.capacity_factor)
  # A JobError is a usage error found before any training compute; anything
  # else raised from here on is a crash: it propagates with its traceback.
  try:
    run_train_job(job)
  except JobError as e:
    parser.exit(2, f"cpjax train: error: {e}\n")
  return 0


def _check_memory(parser, args, cfg, name: str, sizes: dict) -> None:
  """Refuse up front, with the plan's closed-form estimate, a run this machine
  cannot hold (instead of being killed by the kernel minutes later)."""
  import jax

  from cpjax.training import plan

  limit, what = machine.available_memory()
  if limit is None:
    return
  lora = {"lora_rank": args.lora_rank, "base_dtype": args.base_dtype or "float32",
          "lora_targets": args.lora_targets}
  try:
    est = plan.estimate(cfg, model=name, seq_len=args.seq_len, mesh=sizes, remat=args.remat,
                        batch_size=args.batch_size // args.microbatches, dtype=args.dtype,
                        capacity_factor=args.capacity_factor, **lora)
  except ValueError as e:   # a mesh the model cannot use (ep), before any compute
    parser.exit(2, f"cpjax train: error: --mesh: {e}\n")
  devices = math.prod(v for k, v in sizes.items() if k != "ep")
  if jax.devices()[0].platform == "cpu":
    # Emulated devices share the host: each holds its own copy or shard.
    need = est.total * devices // jax.process_count()
    if not args.no_parity_check:
      need += plan.estimate(cfg, model=name, seq_len=args.seq_len, mesh={}, remat=args.remat,
                            batch_size=args.batch_size // args.microbatches,
                            dtype=args.dtype, **lora).total
    where = f"{devices // jax.process_count()} emulated CPU devices need"
  else:
    need, where = est.total, "one device needs"
  if need > limit:
    parser.exit(2, f"cpjax train: error: {name} at --seq-len {args.seq_len} on mesh "
                   f"{','.join(f'{k}={v}' for k, v in sizes.items())}: {where} about "
                   f"{plan.format_bytes(need)} (cpjax plan's closed-form estimate: "
                   f"{plan.format_bytes(est.total)} per device), more than the "
                   f"{plan.format_bytes(limit)} of {what}; use a larger mesh, a shorter "
                   f"--seq-len, --remat, or --skip-memory-check\n")
