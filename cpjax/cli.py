"""The ``cpjax`` command line: ``cpjax demo``."""

from __future__ import annotations

import argparse
import os
import sys


def _use_cpu_devices(n: int) -> None:
  """Emulate ``n`` CPU devices; must run before JAX initialises a backend."""
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
  return value


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="cpjax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="shard a packed multimodal batch and print each rank's part")
  demo.add_argument("--cp", type=_positive, default=8, help="context-parallel size (default 8)")
  demo.add_argument("--seq-len", type=_positive, default=22, help="tokens in the row (default 22)")
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "demo":
    if args.seq_len < 6:
      print("cpjax demo: error: --seq-len must be >= 6", file=sys.stderr)
      return 2
    _use_cpu_devices(max(args.cp, 8))
    from cpjax.demo import run_demo

    print(run_demo(args.cp, args.seq_len))
  return 0


if __name__ == "__main__":
  sys.exit(main())
