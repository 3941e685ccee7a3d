"""``cpjax prepare-data``: JSONL texts and conversations to an ArrayRecord corpus."""

from __future__ import annotations

import argparse
import os


def prepare_data(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """Run ``cpjax prepare-data``: write the corpus and print its summary.

  Args:
    parser: the command's parser (for usage errors).
    args: the parsed command line.

  Returns:
    The exit code, 0.
  """
  from cpjax.data.records import BadRecord, prepare_data

  if args.truncate and args.seq_len is None:
    parser.exit(2, "cpjax prepare-data: error: --truncate needs --seq-len\n")
  try:
    summary = prepare_data(
      args.source,
      args.out,
      checkpoint=args.checkpoint,
      seq_len=args.seq_len,
      truncate=args.truncate,
      strict=args.strict,
    )
  except (BadRecord, FileNotFoundError, ValueError) as e:
    parser.exit(2, f"cpjax prepare-data: error: {e}\n")
  print("\n".join(summary.lines()))
  print(f"wrote {os.path.join(args.out, 'documents.array_record')} and summary.json")
  return 0
