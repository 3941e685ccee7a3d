"""The command line's flags: one parser, its subcommands and their argument types;
``cpjax train``'s own parser comes from the run config (:func:`train_parser`).

Bad flags are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import typing
from typing import TYPE_CHECKING

from cpjax.training.run_config import MODEL_FLAGS, ShardState
from cpjax.training.run_file import positive_float as _positive_float
from cpjax.training.run_file import positive_int as _positive

if TYPE_CHECKING:
  import jsonargparse


class _Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr, exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _mesh(text: str) -> dict:
  from cpjax.parallel import parse_mesh  # imports nothing of JAX's backends

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


TRAIN_DESCRIPTION = (
  "Train Gemma 4 (a tiny real-architecture model by default, a published size with --model, "
  "or a Hugging Face checkpoint with --checkpoint) on synthetic packed multimodal data "
  "(documents of random lengths, image spans, padding) or your own (--data), with its "
  "sequence split over a cp mesh axis; checks the first step against the single-device model "
  "and prints a summary. Settings come from a YAML run config (--config FILE, or --recipe "
  "NAME from cpjax/recipes), overridden by dotted keys (--optimizer.lr 1e-4) or their short "
  "flags (--lr 1e-4); the run writes its resolved config as run.yaml. It runs on JAX's "
  "default backend (the TPU or GPU chips when JAX finds them); only when that backend is the "
  "CPU (JAX_PLATFORMS=cpu, or no accelerator) does it emulate max(devices, 8) CPU devices."
)


def train_parser() -> jsonargparse.ArgumentParser:
  """Build ``cpjax train``'s parser.

  It takes the run config's settings (see
  :func:`cpjax.training.run_file.run_parser`), then what only the command
  line says: a recipe, resuming, the memory check and the cluster.

  Returns:
    The parser.
  """
  from cpjax.training.run_file import run_parser

  parser = run_parser("cpjax train", TRAIN_DESCRIPTION)
  parser.add_argument(
    "--recipe",
    metavar="NAME",
    default=None,
    help="a shipped recipe (see cpjax/recipes) as the config; --config and "
    "keys after it override it",
  )
  state = parser.add_argument_group(
    "resumable runs", "continue a run saved with checkpointing.state_dir (--state-dir)"
  )
  state.add_argument(
    "--resume",
    metavar="DIR",
    default=None,
    help="continue the run saved in DIR up to --steps, saving there; its "
    "run.yaml is the config, under what this command line gives",
  )
  parser.add_argument(
    "--skip-memory-check",
    action="store_true",
    help="start even when the plan's closed-form estimate says the run does "
    "not fit this machine's memory (see cpjax plan)",
  )
  cluster = parser.add_argument_group(
    "cluster",
    "run as one process of a multi-process JAX cluster (every process runs the "
    "same command with its own --process-id)",
  )
  cluster.add_argument(
    "--coordinator-address",
    metavar="HOST:PORT",
    default=None,
    help="address of process 0's coordinator, e.g. 127.0.0.1:12355",
  )
  cluster.add_argument(
    "--num-processes",
    type=_positive,
    default=None,
    help="processes in the cluster (default 1: no cluster)",
  )
  cluster.add_argument(
    "--process-id", type=int, default=None, help="this process's index (default 0)"
  )
  cluster.add_argument(
    "--auto-cluster",
    action="store_true",
    help="let jax.distributed.initialize() detect the cluster (Cloud TPU "
    "slices, SLURM) instead of the three flags above; not together "
    "with them",
  )
  return parser


def build_parser() -> argparse.ArgumentParser:
  """Build the ``cpjax`` parser: ``--version`` and the subcommands' flags.

  ``train`` is only listed: its flags come from :func:`train_parser`.

  Returns:
    The parser.
  """
  from cpjax import __version__

  parser = _Parser(prog="cpjax", description="Context-parallel training for JAX.")
  parser.add_argument("--version", action="version", version=f"cpjax {__version__}")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

  # ``cpjax train`` has its own parser, built from the run config
  # (:func:`train_parser`); here it is only listed.
  sub.add_parser(
    "train", help="train Gemma 4 with context parallelism (cpjax train --help)", add_help=False
  )

  plan = sub.add_parser(
    "plan",
    help="per-device memory and FLOPs of a training step, before renting devices",
    description="Compile the Gemma 4 training step (AdamW, CP ring, FSDP/TP shardings) "
    "abstractly: no weights are materialised. Reports per-device parameters, "
    "optimizer state, activations and temporaries, FLOPs, and whether it fits "
    "--device-memory, beside a closed-form estimate (see cpjax.training.plan). "
    "By default it compiles with XLA:CPU for emulated CPU devices; --target v5e-8 "
    "(or h200-8, ...) compiles with that chip's own compiler and kernels, on any "
    "machine, and checks the fit against the chip's memory. The run comes from "
    "--model / --checkpoint and the flags, or from a run config as cpjax train "
    "takes it (--recipe NAME, --config FILE, and its dotted keys such as "
    "--dataset.seq_len 262144 or --parallel.mesh fsdp=2,cp=4; the flags "
    "below override them). "
    "Without --mesh, finds the fewest-device fsdp x cp mesh that the estimate "
    "fits into --device-memory.",
  )
  what = plan.add_mutually_exclusive_group()
  what.add_argument("--model", choices=MODEL_FLAGS, help="architecture preset (a4b is 26B-A4B)")
  what.add_argument(
    "--checkpoint",
    metavar="DIR",
    help="a Hugging Face Gemma 4 checkpoint directory: plans from its "
    "config.json without reading any weight",
  )
  what.add_argument(
    "--recipe",
    metavar="NAME",
    help="plan a shipped run recipe (cpjax train --recipe NAME): its model, "
    "length, mesh, batch, remat, dtype, LoRA and experts",
  )
  what.add_argument(
    "--config",
    metavar="FILE",
    help="plan a run config file (cpjax train --config FILE), as --recipe",
  )
  plan.add_argument(
    "--target",
    metavar="CHIPS",
    default=None,
    help="compile for these chips with their own compiler (no chip needed): "
    "Cloud TPU's v4-8, v5litepod-8 or v5e-8, v5p-16, v6e-8, ..., a topology "
    "such as v5e:2x4, or GPUs h100-8, h200-8, h200-2x8 (hosts x GPUs); "
    "a chip alone (v5e, v5p, v6e, h200, ...) searches its slices: the closed "
    "form's smallest is compiled, then smaller ones while they fit or larger "
    "ones until one does (minutes a compile at a published size). "
    "Needs pip install 'cpjax[tpu]' or 'cpjax[cuda-compiler]'. Exits 1 when the "
    "step does not fit the chip's memory",
  )
  plan.add_argument(
    "--seq-len",
    type=_positive,
    default=None,
    help="tokens per row (required without --recipe / --config)",
  )
  plan.add_argument(
    "--mesh",
    type=_mesh,
    default=None,
    metavar="AXIS=N,...",
    help="e.g. fsdp=8,cp=16 or fsdp=4,cp=4,tp=2 (default: the run config's; "
    "with --target, cp over all its chips; else search with "
    "--device-memory)",
  )
  plan.add_argument(
    "--remat",
    default=None,
    choices=("none", "full", "save_attention_out"),
    help="per-layer rematerialisation (default: the run config's, else none, as cpjax train)",
  )
  plan.add_argument(
    "--batch-size",
    type=_positive,
    default=None,
    help="rows per step (default: one per batch shard)",
  )
  plan.add_argument(
    "--audio-seconds",
    type=_positive_float,
    default=None,
    metavar="S",
    help="plan rows that each hold a clip of S seconds of audio (E2B, E4B, 12B; "
    "25 soft tokens a second among the row's): the tower's activations and the "
    "clips' features count",
  )
  plan.add_argument(
    "--video-frames",
    type=_positive,
    default=None,
    metavar="N",
    help="plan rows that each hold a video of N frames (every Gemma 4 with vision; "
    "--video-frame-tokens soft tokens a frame among the row's): the tower's "
    "activations and the frames' patches count",
  )
  plan.add_argument(
    "--video-frame-tokens",
    type=_positive,
    default=70,
    metavar="T",
    help="soft tokens a video frame: the video processor's max_soft_tokens (default: 70)",
  )
  plan.add_argument(
    "--device-memory",
    type=_memory,
    default=None,
    metavar="SIZE",
    help="memory of one device, e.g. 16GiB (v5e), 95GiB (v5p), 141GiB (H200)",
  )
  plan.add_argument(
    "--lora-rank",
    type=_positive,
    default=None,
    metavar="R",
    help="plan LoRA training: rank-R adapters on a frozen base",
  )
  plan.add_argument(
    "--base-dtype",
    choices=("float32", "bfloat16", "int8", "int4", "nf4", "float8_e4m3fn"),
    default=None,
    help="storage of the frozen LoRA base (default float32; int8, int4, nf4, float8_e4m3fn: "
    "quantized)",
  )
  plan.add_argument(
    "--group-size",
    type=_positive,
    default=None,
    metavar="N",
    help="a quantized base's input values a scale (default: one scale per output channel)",
  )
  plan.add_argument(
    "--expert-parallel",
    action="store_true",
    help="MoE: each searched mesh (--device-memory, or a bare chip's --target) "
    "folds the largest ep dividing the experts onto its token axes, and a "
    "sized slice's (--target v5p-8) onto its cp; give ep in --mesh otherwise",
  )
  plan.add_argument(
    "--capacity-factor",
    type=_positive_float,
    default=None,
    metavar="C",
    help="MoE with ep: the dispatch's capacity factor (default: never drop, "
    "buffers sized for the worst case)",
  )
  plan.add_argument(
    "--shard-state",
    choices=typing.get_args(ShardState),
    default=None,
    help="which axes split the parameters, gradients and optimizer state, as "
    "cpjax train --shard-state (default: fsdp+cp, every token axis)",
  )
  plan.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default=None,
    help="the compiled step's activation dtype (default: the run config's, "
    "else float32); the estimate prints both",
  )
  plan.add_argument(
    "--write-config",
    metavar="FILE",
    default=None,
    help="write the plan as a run config (its mesh, batch, remat, and the "
    "activation dtype that fits) that cpjax train --config FILE runs",
  )
  plan.add_argument(
    "--estimate-only", action="store_true", help="print the closed-form estimate without compiling"
  )

  prep = sub.add_parser(
    "prepare-data",
    help="tokenize a JSONL of texts or conversations into a training corpus",
    description='Read IN.jsonl (one {"text": ...} document or {"messages": [...]} '
    "conversation per line), tokenize it with the checkpoint's tokenizer.json and "
    "chat template (only the assistant turns of a conversation count in the "
    "loss; images, audio clips and videos in a conversation become the "
    "checkpoint's image patches, audio features and sampled frames), and write "
    "the ArrayRecord corpus OUT that "
    "cpjax train --data reads. "
    "Bad records are dropped and reported with their line number.",
  )
  prep.add_argument("source", metavar="IN.jsonl", help="the JSONL records")
  prep.add_argument("out", metavar="OUT", help="the corpus directory to write")
  prep.add_argument(
    "--checkpoint",
    metavar="DIR",
    required=True,
    help="the checkpoint directory holding tokenizer.json, "
    "tokenizer_config.json and the chat template",
  )
  prep.add_argument(
    "--seq-len",
    type=_positive,
    default=None,
    help="the training row length: longer documents are dropped (or cut, "
    "with --truncate); default: no limit",
  )
  prep.add_argument(
    "--truncate", action="store_true", help="keep the first --seq-len tokens of longer documents"
  )
  prep.add_argument(
    "--strict", action="store_true", help="stop at the first bad record instead of dropping it"
  )

  demo = sub.add_parser("demo", help="shard a packed multimodal batch and print each rank's part")
  demo.add_argument("--cp", type=_positive, default=8, help="context-parallel size (default 8)")
  demo.add_argument("--seq-len", type=_positive, default=22, help="tokens in the row (default 22)")
  return parser
