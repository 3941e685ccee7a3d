"""The packing data pipeline's throughput against what training consumes.

Reads the shipped corpus (tests/data/tiny_corpus.array_record) with
``cpjax.data.corpus.packed_batches`` at the demo size (B=2, S=1024), repeating
epochs, and counts real tokens per second. In the same run it trains the
demo (what ``cpjax train --data`` runs: tiny Gemma 4, cp=8) for a few steps and
reads its real tokens per second. Target: the loader is at least 10x faster.

    python benchmarks/data_pipeline.py [--batches 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_corpus.array_record"


def loader_tokens_per_s(batches: int, batch_size: int, seq_len: int) -> tuple[float, float]:
  from cpjax.data.corpus import packed_batches

  it = iter(
    packed_batches(
      CORPUS, batch_size=batch_size, seq_len=seq_len, seed=0, process_index=0, process_count=1
    )
  )
  next(it)  # open the file, build the first bins
  start, tokens = time.perf_counter(), 0
  for _ in range(batches):
    tokens += int(next(it)["attention_mask"].sum())
  seconds = time.perf_counter() - start
  return tokens / seconds, tokens / (batches * batch_size * seq_len)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=2000)
  parser.add_argument("--train-steps", type=int, default=10)
  args = parser.parse_args(argv)
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  from cpjax.training.run_config import RunConfig, with_values
  from cpjax.training.trainer import train

  loader, fill = loader_tokens_per_s(args.batches, 2, 1024)
  summary = train(
    with_values(
      RunConfig(),
      {
        "dataset.seq_len": 1024,
        "dataset.batch_size": 2,
        "optimizer.steps": args.train_steps,
        "dataset.path": str(CORPUS),
        "parity_check": False,
      },
    ),
    log=lambda *_: None,
  )
  train = summary["tokens_per_s"]
  row = {
    "loader_tokens_per_s": loader,
    "row_fill": fill,
    "train_tokens_per_s": train,
    "loader_over_train": loader / train,
  }
  print(
    f"\ndata pipeline: packed_batches B=2 S=1024 on the shipped corpus, {os.cpu_count()} "
    f"cores; training: tiny Gemma 4, cp=8 on 8 emulated CPU devices"
  )
  common.print_table([row], list(row))
  print("wrote", common.write_json("data_pipeline", {"config": vars(args), "result": row}))


if __name__ == "__main__":
  main()
