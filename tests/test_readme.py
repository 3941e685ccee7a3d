"""The README's own-model example runs as written, and trains with CP."""

import re
from pathlib import Path

import numpy as np

import cpjax

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title: str) -> str:
  text = README.read_text()
  section = text.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
  return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


def test_own_model_example_runs_and_is_short():
  code = section_code("Your own model")
  assert len(code.strip().splitlines()) < 30
  rng = np.random.default_rng(0)
  docs = np.repeat([[1] * 40 + [2] * 20 + [0] * 4], 2, axis=0).astype(np.int32)
  ids = np.where(docs > 0, rng.integers(1, 1000, docs.shape), 0).astype(np.int32)
  batch = {"input_ids": ids, "_packed_seq_ids": docs, "padding_mask": docs == 0,
           "labels": np.asarray(cpjax.next_token_labels(ids, docs))}
  scope = {"batch": batch}
  exec(compile(code, str(README), "exec"), scope)  # noqa: S102
  metrics = scope["metrics"]
  assert np.isfinite(float(metrics["loss"])) and float(metrics["tokens"]) == 2 * (39 + 19)  # next-token labels per document
