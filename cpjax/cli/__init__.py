"""The ``cpjax`` command line.

    cpjax train [--recipe NAME | --config FILE] [--section.key VALUE ...]
                [--model NAME | --checkpoint DIR] [--remat] [--save DIR]
                [--data PATH [--tokenizer DIR] [--eval-data PATH --eval-every N] [--metrics F]]
                [--lr X --lr-schedule KIND --warmup-steps N --max-grad-norm X]
                [--state-dir DIR --save-every N | --resume DIR [--force-resume]]
                [--seq-len N] [--cp N] [--layout KIND] [--steps N] [--seed N] [--dtype T]
                [--coordinator-address HOST:PORT --num-processes N --process-id I]
    cpjax prepare-data IN.jsonl OUT --checkpoint DIR [--seq-len N] [--truncate] [--strict]
    cpjax plan  (--model NAME | --checkpoint DIR | --recipe NAME | --config FILE)
                [--section.key VALUE ...] [--seq-len N] [--mesh AXIS=N,...]
                [--target CHIPS] [--device-memory SIZE] [--write-config FILE]
                [--estimate-only]
    cpjax demo  [--cp N] [--seq-len N]
    cpjax --version

The command line on top of every layer: :mod:`~cpjax.cli.parser` declares
the flags (``cpjax train``'s come from the run config,
:class:`~cpjax.training.run_config.RunConfig`, through jsonargparse), and
each command's module (:mod:`~cpjax.cli.train`,
:mod:`~cpjax.cli.plan`, :mod:`~cpjax.cli.prepare_data`) checks them and
calls the library; :mod:`~cpjax.cli.demo` is ``cpjax demo``.
"""

from __future__ import annotations

import sys

from cpjax.cli import machine
from cpjax.cli.parser import build_parser, train_parser
from cpjax.cli.plan import plan as _plan
from cpjax.cli.prepare_data import prepare_data as _prepare_data
from cpjax.cli.train import train as _train

__all__ = ["build_parser", "main", "train_parser"]


def main(argv: list[str] | None = None) -> int:
  """Run the ``cpjax`` command line.

  Args:
    argv: the arguments after the program's name (default: ``sys.argv[1:]``).

  Returns:
    The exit code.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  machine.cpu_unless_accelerators()
  if argv[:1] == ["train"]:
    return _train(train_parser(), argv[1:])
  parser = build_parser()
  # cpjax plan also takes a run's dotted keys (--dataset.seq_len N), as cpjax
  # train does: they are checked against the run config in cpjax.cli.plan.
  args, extra = parser.parse_known_args(argv)
  if extra and args.command != "plan":
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  args.run_keys = extra
  if args.command == "demo":
    if args.seq_len < 6:
      parser.exit(2, "cpjax demo: error: --seq-len must be >= 6\n")
    machine.use_cpu_devices(max(args.cp, 8))
    from cpjax.cli.demo import run_demo

    print(run_demo(args.cp, args.seq_len))
    return 0

  if args.command == "plan":
    return _plan(parser, args)
  if args.command == "prepare-data":
    return _prepare_data(parser, args)
  return 2  # argparse's subcommands are exhaustive


if __name__ == "__main__":
  sys.exit(main())
