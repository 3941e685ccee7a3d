"""The ``cpjax`` command line.

    cpjax train [--model NAME | --checkpoint DIR] [--remat] [--save DIR]
                [--data PATH [--tokenizer DIR] [--eval-data PATH --eval-every N] [--metrics F]]
                [--lr X --lr-schedule KIND --warmup-steps N --max-grad-norm X]
                [--state-dir DIR --save-every N | --resume DIR [--force-resume]]
                [--seq-len N] [--cp N] [--layout KIND] [--steps N] [--seed N] [--dtype T]
                [--coordinator-address HOST:PORT --num-processes N --process-id I]
    cpjax prepare-data IN.jsonl OUT --checkpoint DIR [--seq-len N] [--truncate] [--strict]
    cpjax plan  (--model NAME | --checkpoint DIR) --seq-len N [--mesh AXIS=N,...]
                [--device-memory SIZE] [--estimate-only]
    cpjax demo  [--cp N] [--seq-len N]
    cpjax --version
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from cpjax.layout import LAYOUT_KINDS


class _Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr, exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
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


def _mesh(text: str) -> dict:
  from cpjax.parallel import parse_mesh   # imports nothing of JAX's backends

  try:
    return parse_mesh(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _memory(text: str) -> int:
  from cpjax.training.plan import parse_bytes

  try:
    return parse_bytes(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
  from cpjax import __version__

  parser = _Parser(prog="cpjax", description="Context-parallel training for JAX.")
  parser.add_argument("--version", action="version", version=f"cpjax {__version__}")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

  train = sub.add_parser(
      "train", help="train Gemma 4 with context parallelism",
      description="Train Gemma 4 (a tiny real-architecture model by default, a published "
                  "size with --model, or a Hugging Face checkpoint with --checkpoint) on "
                  "synthetic packed multimodal data "
                  "(documents of random lengths, image spans, padding) with its sequence "
                  "split over a cp mesh axis; checks the first step against the "
                  "single-device model and prints a summary. It runs on JAX's default "
                  "backend (the TPU or GPU chips when JAX finds them); only when that "
                  "backend is the CPU (JAX_PLATFORMS=cpu, or no accelerator) does it emulate "
                  "max(--cp, 8) CPU devices.")
  train.add_argument("--model", choices=("tiny", "tiny-moe", "e2b", "e4b", "a4b", "31b"),
                     default=None,
                     help="architecture preset, randomly initialised (default tiny; tiny-moe has 4 "
                          "experts, top-2, like a small 26B-A4B, which is a4b)")
  train.add_argument("--checkpoint", metavar="DIR", default=None,
                     help="fine-tune this Hugging Face Gemma 4 checkpoint directory "
                          "(config.json + safetensors) instead of --model")
  data = train.add_argument_group(
      "your own data", "instead of synthetic data: a corpus from cpjax prepare-data (or any "
                       "ArrayRecord documents, see cpjax.data.corpus), or JSONL texts and "
                       "conversations tokenized at the start with the checkpoint's tokenizer "
                       "and chat template (only the assistant turns count in the loss)")
  data.add_argument("--data", metavar="PATH", default=None,
                    help="the training data: a corpus directory or file, or a .jsonl file; "
                         "packed into rows of --seq-len")
  data.add_argument("--tokenizer", metavar="DIR", default=None,
                    help="the directory of tokenizer.json and the chat template, for .jsonl "
                         "data (default: --checkpoint)")
  data.add_argument("--truncate", action="store_true",
                    help="cut .jsonl documents longer than --seq-len (default: drop and report "
                         "them)")
  data.add_argument("--eval-data", metavar="PATH", default=None,
                    help="validation data (as --data): the loss of its first --eval-rows rows, "
                         "with the same CP forward, after the last step and every --eval-every")
  data.add_argument("--eval-every", type=_positive, default=None, metavar="N",
                    help="validate every N steps (needs --eval-data)")
  data.add_argument("--eval-rows", type=_positive, default=16, metavar="N",
                    help="validation rows (default 16)")
  data.add_argument("--metrics", metavar="FILE", default=None,
                    help="append one JSON line per step (step, loss, grad_norm, learning_rate, "
                         "tokens, tokens_per_s, eval_loss when computed); default "
                         "STATE_DIR/metrics.jsonl with --state-dir or --resume")
  data.add_argument("--tensorboard", metavar="DIR", default=None,
                    help="also write the per-step metrics as TensorBoard event files in DIR")
  data.add_argument("--images-per-row", type=_positive, default=None, metavar="N",
                    help="image slots per packed row, for data with images (default: the most "
                         "images of one document)")
  state = train.add_argument_group(
      "resumable runs", "save the train state (parameters, optimizer state, data position) with "
                        "orbax, and continue a run from it")
  state.add_argument("--state-dir", metavar="DIR", default=None,
                     help="where to save the train state (see --save-every); also saved after "
                          "the last step")
  state.add_argument("--save-every", type=_positive, default=None, metavar="N",
                     help="save the train state every N steps (needs --state-dir or --resume)")
  state.add_argument("--resume", metavar="DIR", default=None,
                     help="continue the run saved in DIR up to --steps, saving there")
  state.add_argument("--force-resume", action="store_true",
                     help="resume even with a different --batch-size or --seq-len")
  train.add_argument("--remat", nargs="?", const="full", default="none",
                     choices=("none", "full", "save_attention_out"), metavar="POLICY",
                     help="per-layer rematerialisation: full (the default when the flag is "
                          "given: keep only each layer's inputs), save_attention_out (keep the "
                          "attention output too) or none")
  train.add_argument("--save", metavar="DIR", default=None,
                     help="write the trained model as a Hugging Face checkpoint at the end "
                          "(with --lora-rank: the adapter, as PEFT saves it)")
  train.add_argument("--seq-len", type=_positive, default=1024,
                     help="tokens per row before padding (default 1024)")
  train.add_argument("--cp", type=_positive, default=None,
                     help="context-parallel size, i.e. devices on the cp axis (default 8)")
  train.add_argument("--mesh", type=_mesh, default=None, metavar="AXIS=N,...",
                     help="a training mesh instead of --cp: fsdp (or dp), cp and tp sizes, e.g. "
                          "fsdp=2,cp=4 or fsdp=2,cp=2,tp=2 (parameters and optimizer state "
                          "sharded over fsdp and tp, see cpjax.parallel); ep=N folds expert "
                          "parallelism onto cp and/or the batch axis, e.g. fsdp=2,cp=4,ep=8")
  train.add_argument("--capacity-factor", type=_positive_float, default=None, metavar="C",
                     help="MoE: each expert takes at most ceil(C * T * k / E) (token, expert) "
                          "pairs from the T tokens of each dispatch (a device's with ep, a cp "
                          "rank's without); later ones are dropped and counted in "
                          "expert_dropped (default: never drop)")
  train.add_argument("--microbatches", type=_positive, default=1, metavar="K",
                     help="gradient accumulation: each step sums K microbatches of "
                          "batch-size/K rows (default 1)")
  train.add_argument("--layout", choices=LAYOUT_KINDS, default="load_balanced",
                     help="how the sequence is split over the ranks (default load_balanced; "
                          "document_balanced evens out packed rows)")
  train.add_argument("--steps", type=_positive, default=20, help="optimizer steps (default 20)")
  train.add_argument("--seed", type=int, default=0, help="seed for data and init (default 0)")
  train.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="activation dtype; parameters stay float32 (default float32)")
  train.add_argument("--batch-size", type=_positive, default=2, help="rows per step (default 2)")
  train.add_argument("--lr", type=_positive_float, default=3e-3,
                     help="AdamW learning rate (default 3e-3), the peak of --lr-schedule")
  train.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"),
                     default="constant",
                     help="after the warmup: constant, or a cosine or linear decay to 0 at "
                          "--steps (default constant)")
  train.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                     help="linear warmup from 0 over N steps (default 0)")
  train.add_argument("--max-grad-norm", type=_positive_float, default=None, metavar="X",
                     help="clip the global gradient norm to X (default: no clipping)")
  train.add_argument("--no-parity-check", action="store_true",
                     help="skip the first-step comparison with the single-device model")
  train.add_argument("--skip-memory-check", action="store_true",
                     help="start even when the plan's closed-form estimate says the run does "
                          "not fit this machine's memory (see cpjax plan)")
  adapters = train.add_argument_group(
      "LoRA", "train low-rank adapters on a frozen base instead of every weight (cpjax.training.lora, "
              "with qwix); --save then writes the adapter as PEFT does")
  adapters.add_argument("--lora-rank", type=_positive, default=None, metavar="R",
                        help="train rank-R LoRA adapters; the base is frozen")
  adapters.add_argument("--lora-alpha", type=_positive_float, default=None, metavar="A",
                        help="the adapters' scale is A / R (default 8, PEFT's)")
  adapters.add_argument("--lora-targets", default=None, metavar="REGEX",
                        help="modules to adapt: a regex matched in full against module paths "
                             "such as model.language_model.layers.0.self_attn.q_proj (default: "
                             "the decoder's q/k/v/o and gate/up/down projections)")
  adapters.add_argument("--base-dtype", choices=("float32", "bfloat16"), default=None,
                        help="storage dtype of the frozen base (default float32)")
  adapters.add_argument("--merge-lora", action="store_true",
                        help="with --save: write the base with the adapter merged in, as a "
                             "Hugging Face checkpoint, instead of the adapter")
  cluster = train.add_argument_group(
      "cluster", "run as one process of a multi-process JAX cluster (every process runs the "
                 "same command with its own --process-id)")
  cluster.add_argument("--coordinator-address", metavar="HOST:PORT",
                       help="address of process 0's coordinator, e.g. 127.0.0.1:12355")
  cluster.add_argument("--num-processes", type=_positive, default=None,
                       help="processes in the cluster (default 1: no cluster)")
  cluster.add_argument("--process-id", type=int, default=None,
                       help="this process's index (default 0)")
  cluster.add_argument("--auto-cluster", action="store_true",
                       help="let jax.distributed.initialize() detect the cluster (Cloud TPU "
                            "slices, SLURM) instead of the three flags above; not together "
                            "with them")

  plan = sub.add_parser(
      "plan", help="per-device memory and FLOPs of a training step, before renting devices",
      description="Compile the Gemma 4 training step (AdamW, CP ring, FSDP/TP shardings) "
                  "abstractly for emulated CPU devices: no weights are materialised. Reports "
                  "per-device parameters, optimizer state, activations and temporaries, FLOPs, "
                  "and whether it fits --device-memory, beside a closed-form estimate (see "
                  "cpjax.training.plan). Without --mesh, finds the fewest-device fsdp x cp mesh that "
                  "the estimate fits into --device-memory.")
  what = plan.add_mutually_exclusive_group(required=True)
  what.add_argument("--model", choices=("e2b", "e4b", "a4b", "31b", "tiny", "tiny-moe"),
                    help="architecture preset (a4b is 26B-A4B)")
  what.add_argument("--checkpoint", metavar="DIR",
                    help="a Hugging Face Gemma 4 checkpoint directory: plans from its "
                         "config.json without reading any weight")
  plan.add_argument("--seq-len", type=_positive, required=True, help="tokens per row")
  plan.add_argument("--mesh", type=_mesh, default=None, metavar="AXIS=N,...",
                    help="e.g. fsdp=8,cp=16 or fsdp=4,cp=4,tp=2 (default: search with "
                         "--device-memory)")
  plan.add_argument("--remat", default="full", choices=("none", "full", "save_attention_out"),
                    help="per-layer rematerialisation (default full)")
  plan.add_argument("--batch-size", type=_positive, default=None,
                    help="rows per step (default: one per batch shard)")
  plan.add_argument("--device-memory", type=_memory, default=None, metavar="SIZE",
                    help="memory of one device, e.g. 16GiB (v5e), 95GiB (v5p), 141GiB (H200)")
  plan.add_argument("--lora-rank", type=_positive, default=None, metavar="R",
                    help="plan LoRA training: rank-R adapters on a frozen base")
  plan.add_argument("--base-dtype", choices=("float32", "bfloat16"), default=None,
                    help="storage dtype of the frozen LoRA base (default float32)")
  plan.add_argument("--expert-parallel", action="store_true",
                    help="MoE: with --device-memory, each searched mesh folds the largest ep "
                         "dividing the experts onto its token axes (give ep in --mesh otherwise)")
  plan.add_argument("--capacity-factor", type=_positive_float, default=None, metavar="C",
                    help="MoE with ep: the dispatch's capacity factor (default: never drop, "
                         "buffers sized for the worst case)")
  plan.add_argument("--estimate-only", action="store_true",
                    help="print the closed-form estimate without compiling")

  prep = sub.add_parser(
      "prepare-data", help="tokenize a JSONL of texts or conversations into a training corpus",
      description="Read IN.jsonl (one {\"text\": ...} document or {\"messages\": [...]} "
                  "conversation per line), tokenize it with the checkpoint's tokenizer.json and "
                  "chat template (only the assistant turns of a conversation count in the "
                  "loss), and write the ArrayRecord corpus OUT that cpjax train --data reads. "
                  "Bad records are dropped and reported with their line number.")
  prep.add_argument("source", metavar="IN.jsonl", help="the JSONL records")
  prep.add_argument("out", metavar="OUT", help="the corpus directory to write")
  prep.add_argument("--checkpoint", metavar="DIR", required=True,
                    help="the checkpoint directory holding tokenizer.json, "
                         "tokenizer_config.json and the chat template")
  prep.add_argument("--seq-len", type=_positive, default=None,
                    help="the training row length: longer documents are dropped (or cut, "
                         "with --truncate); default: no limit")
  prep.add_argument("--truncate", action="store_true",
                    help="keep the first --seq-len tokens of longer documents")
  prep.add_argument("--strict", action="store_true",
                    help="stop at the first bad record instead of dropping it")

  demo = sub.add_parser("demo", help="shard a packed multimodal batch and print each rank's part")
  demo.add_argument("--cp", type=_positive, default=8, help="context-parallel size (default 8)")
  demo.add_argument("--seq-len", type=_positive, default=22, help="tokens in the row (default 22)")
  return parser


def _use_cpu_devices(n: int, *, collectives: str | None = None) -> None:
  """Emulate ``n`` CPU devices (per process); must run before JAX initialises.

  The setting only shapes the CPU backend: when JAX finds TPU or GPU chips it
  uses them and ignores it (``JAX_PLATFORMS=cpu`` forces the CPU).
  """
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    if collectives:
      jax.config.update("jax_cpu_collectives_implementation", collectives)


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command == "demo":
    if args.seq_len < 6:
      parser.exit(2, "cpjax demo: error: --seq-len must be >= 6\n")
    _use_cpu_devices(max(args.cp, 8))
    from cpjax.demo import run_demo

    print(run_demo(args.cp, args.seq_len))
    return 0

  if args.command == "plan":
    return _plan(parser, args)
  if args.command == "prepare-data":
    return _prepare_data(parser, args)

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
    _use_cpu_devices(devices_needed // args.num_processes, collectives="gloo")
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
  elif args.auto_cluster:
    import jax

    jax.distributed.initialize()
  else:
    _use_cpu_devices(max(devices_needed, 8))
  import jax

  if jax.device_count() < devices_needed:
    what = "--mesh" if args.mesh else f"--cp {args.cp}"
    parser.exit(2, f"cpjax train: error: {what} needs {devices_needed} devices, found "
                   f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices\n")
  from cpjax.training.train_job import JobError, TrainJob, run_train_job

  sizes = dict(args.mesh) if args.mesh else {"cp": args.cp}
  if not args.skip_memory_check:
    cfg, name = _plan_config(parser, args)
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


def _prepare_data(parser, args) -> int:
  from cpjax.data.records import BadRecord, prepare_data

  if args.truncate and args.seq_len is None:
    parser.exit(2, "cpjax prepare-data: error: --truncate needs --seq-len\n")
  try:
    summary = prepare_data(args.source, args.out, checkpoint=args.checkpoint,
                           seq_len=args.seq_len, truncate=args.truncate, strict=args.strict)
  except (BadRecord, FileNotFoundError, ValueError) as e:
    parser.exit(2, f"cpjax prepare-data: error: {e}\n")
  print("\n".join(summary.lines()))
  print(f"wrote {os.path.join(args.out, 'documents.array_record')} and summary.json")
  return 0


def _plan_config(parser, args):
  """(config, display name) of --model or --checkpoint; a bad config.json is a usage error."""
  from cpjax.models.gemma4 import Gemma4Config

  if args.checkpoint is None:
    return Gemma4Config.preset(args.model or "tiny"), args.model or "tiny"
  if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
    parser.exit(2, f"cpjax {args.command}: error: --checkpoint {args.checkpoint} has no "
                   f"config.json\n")
  try:
    cfg = Gemma4Config.from_hf(args.checkpoint)
  except (ValueError, KeyError, TypeError) as e:
    parser.exit(2, f"cpjax {args.command}: error: --checkpoint {args.checkpoint}: {e}\n")
  return cfg, os.path.basename(os.path.normpath(args.checkpoint))


def _plan(parser, args) -> int:
  from cpjax.training import plan

  if args.mesh is None and args.device_memory is None:
    parser.exit(2, "cpjax plan: error: give --mesh, or --device-memory to search for one\n")
  if args.base_dtype is not None and args.lora_rank is None:
    parser.exit(2, "cpjax plan: error: --base-dtype needs --lora-rank\n")
  if args.expert_parallel and args.mesh is not None:
    parser.exit(2, "cpjax plan: error: --expert-parallel searches meshes; with --mesh give "
                   "ep in it (e.g. fsdp=2,cp=4,ep=8)\n")
  lora = {"lora_rank": args.lora_rank, "base_dtype": args.base_dtype or "float32"}
  cfg, name = _plan_config(parser, args)
  mesh = args.mesh
  if mesh is None:
    found = plan.smallest_mesh(cfg, model=name, seq_len=args.seq_len,
                               device_memory=args.device_memory, remat=args.remat,
                               expert_parallel=args.expert_parallel,
                               capacity_factor=args.capacity_factor, **lora)
    if found is None:
      print(f"no fsdp x cp mesh up to 4096 devices fits {name} at S={args.seq_len} "
            f"into {plan.format_bytes(args.device_memory)} per device (estimate)")
      return 1
    mesh = found.mesh
  devices = math.prod(v for k, v in mesh.items() if k != "ep")
  _use_cpu_devices(devices)
  try:
    rows = [plan.estimate(cfg, model=name, seq_len=args.seq_len, mesh=mesh,
                          remat=args.remat, batch_size=args.batch_size, dtype=dtype,
                          capacity_factor=args.capacity_factor, **lora)
            for dtype in ("bfloat16", "float32")]
    if not args.estimate_only:
      rows.append(plan.compiled_plan(cfg, model=name, seq_len=args.seq_len, mesh=mesh,
                                     remat=args.remat, batch_size=args.batch_size,
                                     capacity_factor=args.capacity_factor, **lora))
  except ValueError as e:   # a mesh the model cannot use: a usage error, before compiling
    parser.exit(2, f"cpjax plan: error: {e}\n")
  print(f"cpjax plan: Gemma 4 {name}, S={args.seq_len}, remat {args.remat}, "
        f"{rows[0].training} training, {devices} devices; per device:")
  for row in rows:
    fits = ""
    if args.device_memory is not None:
      fits = ("  fits " if row.fits(args.device_memory) else "  does NOT fit ") + \
          plan.format_bytes(args.device_memory)
    print(f"  {row.row()} [{row.dtype} activations]{fits}")
  return 0


def _machine_memory() -> tuple[int | None, str]:
  """(bytes one training device may use, what they are): an accelerator's
  own limit, or on the CPU backend the host's available memory, which every
  emulated device shares."""
  import jax

  device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (int(limit) if limit else None), f"{device.device_kind} memory"
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024, "available host memory"
  except (OSError, KeyError, ValueError):
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    return (pages * os.sysconf("SC_PAGE_SIZE") if pages else None), "available host memory"


def _check_memory(parser, args, cfg, name: str, sizes: dict) -> None:
  """Refuse up front, with the plan's closed-form estimate, a run this machine
  cannot hold (instead of being killed by the kernel minutes later)."""
  import jax

  from cpjax.training import plan

  limit, what = _machine_memory()
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


if __name__ == "__main__":
  sys.exit(main())
