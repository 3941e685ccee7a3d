"""Generate the small shipped corpus: tests/data/tiny_corpus.array_record.

    python tests/data/make_corpus.py

1000 documents of 8 to 400 tokens (vocabulary 1..511, so the tiny Gemma 4
preset can train on it). Each document is an arithmetic sequence of ids with
its own start and stride: a signal a model can learn.
"""

import os

import numpy as np

from cpjax.data.corpus import write_documents


def documents(n: int = 1000, seed: int = 0, vocab: int = 512):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    length = int(rng.integers(8, 401))
    start, stride = rng.integers(1, vocab), rng.integers(1, 4)
    yield 1 + (start + stride * np.arange(length)) % (vocab - 1)


if __name__ == "__main__":
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_corpus.array_record")
  print(out, write_documents(out, documents()), "documents")
