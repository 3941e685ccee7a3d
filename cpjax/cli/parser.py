"""The command line's flags: one parser, its subcommands and their argument types.

Bad flags are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse

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
