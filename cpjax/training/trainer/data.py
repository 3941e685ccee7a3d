"""The run's rows: the corpus (``--data``, a prepared corpus or JSONL texts
and conversations tokenized on the way) or synthetic packed multimodal rows;
the fixed validation rows (``--eval-data``); a step's microbatches, sharded."""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from collections.abc import Callable

import numpy as np

from cpjax.batch.layout import ShardLayout
from cpjax.data.corpus import flatten_image_slots, packed_batches, packed_rows
from cpjax.data.records import prepare_data
from cpjax.models import gemma4
from cpjax.training.run_config import RunConfig, RunError
from cpjax.training.trainer.state import Log, Trainer

__all__ = ["Data", "check_vocabulary", "corpus_path", "eval_rows", "open_data", "step_batches"]


@dataclasses.dataclass
class Data:
  """A batch source: ``next_batch()`` gives one microbatch of rows; ``state``
  / ``set_state`` save and restore where it is, for resume."""

  next_batch: Callable[[], dict]
  state: Callable[[], dict]
  set_state: Callable[[dict], None]


def open_data(run: RunConfig, cfg: gemma4.Gemma4Config, rows: int, log: Log) -> Data:
  """Open the corpus (``--data``) or synthetic packed multimodal rows.

  Args:
    run: the :class:`RunConfig`.
    cfg: the model's :class:`Gemma4Config`.
    rows: rows of one microbatch.
    log: prints a line.

  Returns:
    The :class:`Data`.
  """
  if run.dataset.path:
    # Every process feeds the same global batch (the sharder places each
    # process's part), so every process reads the whole corpus here.
    path = corpus_path(run, run.dataset.path, "--data", log)
    stream = iter(
      packed_batches(
        path,
        batch_size=rows,
        seq_len=run.dataset.seq_len,
        seed=run.seed,
        process_index=0,
        process_count=1,
        images_per_row=run.dataset.images_per_row,
        audio_clips_per_row=run.dataset.audio_clips_per_row,
        videos_per_row=run.dataset.videos_per_row,
      )
    )

    def next_batch() -> dict:
      return check_vocabulary(next(stream), cfg, f"--data {run.dataset.path}")

    return Data(
      next_batch,
      state=lambda: {"grain": stream.get_state()},
      set_state=lambda state: stream.set_state(state["grain"]),
    )

  rng = np.random.default_rng(run.seed)

  def set_state(state: dict) -> None:
    rng.bit_generator.state = state["numpy_bit_generator"]

  return Data(
    lambda: gemma4.synthetic_batch(
      rng, cfg, batch_size=rows, seq_len=run.dataset.seq_len, max_docs=6
    ),
    state=lambda: {"numpy_bit_generator": rng.bit_generator.state},
    set_state=set_state,
  )


def corpus_path(run: RunConfig, path: str, flag: str, log: Log) -> str:
  """Return a corpus to read: ``path`` itself, or a JSONL file tokenized into one.

  A JSONL file is tokenized (with the tokenizer and chat template of
  ``--tokenizer`` or ``--checkpoint``) in a fresh temporary directory.

  Args:
    run: the :class:`RunConfig`.
    path: a corpus, or a JSONL file.
    flag: the flag that gave ``path``, for errors.
    log: prints a line.

  Returns:
    The corpus's path.

  Raises:
    RunError: a JSONL file without a tokenizer, or one that does not tokenize.
  """
  if not path.endswith(".jsonl"):
    return path
  source = run.dataset.tokenizer or run.checkpoint
  if source is None:
    raise RunError(
      f"{flag} {path} is JSONL: tokenizing it needs the checkpoint's tokenizer "
      f"(--checkpoint DIR or --tokenizer DIR)"
    )
  out = tempfile.mkdtemp(prefix="cpjax-corpus-")
  atexit.register(shutil.rmtree, out, ignore_errors=True)  # read lazily during the run
  try:
    summary = prepare_data(
      path,
      out,
      checkpoint=source,
      seq_len=run.dataset.seq_len,
      truncate=run.dataset.truncate,
      progress=False,
    )
  except (ValueError, FileNotFoundError) as e:
    raise RunError(f"{flag} {path}: {e}") from None
  for line in summary.lines(show=5):
    log(line)
  return out


def check_vocabulary(batch: dict, cfg: gemma4.Gemma4Config, where: str) -> dict:
  """Check that a batch's token ids are inside the model's vocabulary.

  Args:
    batch: the batch, with ``input_ids`` int[B, S].
    cfg: the :class:`Gemma4Config`.
    where: the batch's source, for the error (e.g. ``"--data PATH"``).

  Returns:
    ``batch``, unchanged.

  Raises:
    ValueError: a token id is ``>= cfg.text.vocab_size``.
  """
  top = int(batch["input_ids"].max())
  if top >= cfg.text.vocab_size:
    raise ValueError(
      f"{where} holds token id {top}, outside the model's vocabulary of {cfg.text.vocab_size}"
    )
  return batch


def eval_rows(run: RunConfig, cfg: gemma4.Gemma4Config, rows: int, log: Log) -> list[dict]:
  """Read the fixed validation rows.

  They are the first ``eval.rows`` packed rows of the validation data (in
  file order, one pass), in batches of ``rows``; the last batch is filled up
  with empty rows (they count no token).

  Args:
    run: the :class:`RunConfig` (with ``eval.data``).
    cfg: the model's :class:`Gemma4Config`.
    rows: rows of one batch (the step's microbatch).
    log: prints a line.

  Returns:
    The batches of validation rows.
  """
  if run.eval.data is None:
    raise ValueError("eval_rows needs a run with eval.data, got eval.data None")
  path = corpus_path(run, run.eval.data, "--eval-data", log)
  found = []
  for row in packed_rows(
    path,
    seq_len=run.dataset.seq_len,
    shuffle=False,
    num_epochs=1,
    process_index=0,
    process_count=1,
    images_per_row=run.dataset.images_per_row,
    audio_clips_per_row=run.dataset.audio_clips_per_row,
    videos_per_row=run.dataset.videos_per_row,
  ):
    found.append(check_vocabulary(row, cfg, f"--eval-data {run.eval.data}"))
    if len(found) == run.eval.rows:
      break
  # An empty row: no token, no label, and image, clip and video slots that are
  # all padding (its video slots keep their frame counts).
  fill = {"labels": -100, "image_position_ids": -1, "video_position_ids": -1}
  empty = {
    key: value if key == "num_frames_per_video" else np.full_like(value, fill.get(key, 0))
    for key, value in found[0].items()
  }
  found += [empty] * (-len(found) % rows)
  return [
    flatten_image_slots({key: np.stack([r[key] for r in found[i : i + rows]]) for key in found[0]})
    for i in range(0, len(found), rows)
  ]


def step_batches(trainer: Trainer, data: Data) -> tuple[list[dict], dict | list[dict], ShardLayout]:
  """Fetch the step's rows (as microbatches) and shard them.

  Args:
    trainer: the :class:`Trainer`.
    data: the :class:`Data`.

  Returns:
    ``(rows, sharded, layout)``: the step's host rows (one dict per
    microbatch), their sharded form (a list of them with microbatches, else
    the one batch) and its layout.
  """
  parts = [data.next_batch() for _ in range(trainer.run.dataset.microbatches)]
  placed = [trainer.shard(b) for b in parts]
  layouts = {lay for _, lay in placed}
  assert len(layouts) == 1, "every batch has the same padded shape"
  sharded = placed[0][0] if len(parts) == 1 else [b for b, _ in placed]
  return parts, sharded, placed[0][1]
