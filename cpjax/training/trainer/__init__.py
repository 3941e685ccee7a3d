"""The trainer: a run built for training, and its training loop.

:func:`build` turns a :class:`~cpjax.training.run_config.RunConfig` into a
:class:`Trainer` (the mesh, the model split for the step, the optimizer and
its :class:`TrainState`); :func:`fit` trains it (open the data, resume,
compile the step, run the loop with the :mod:`~cpjax.training.trainer.hooks`
after each step, save, report); :func:`train` is both (what ``cpjax train``
runs). Each is its own module:

* :mod:`~cpjax.training.trainer.state`: ``Trainer``, ``TrainState``;
* :mod:`~cpjax.training.trainer.builder`: ``build`` (mesh, model, LoRA, state);
* :mod:`~cpjax.training.trainer.data`: the run's rows and validation rows;
* :mod:`~cpjax.training.trainer.hooks`: the periodic work after each step;
* :mod:`~cpjax.training.trainer.export`: ``checkpointing.save``'s files;
* :mod:`~cpjax.training.trainer.loop`: ``fit`` and ``train``.

A tiny real-architecture Gemma 4 by default (``model`` picks a preset, or
``checkpoint`` fine-tunes a Hugging Face checkpoint), on synthetic packed
multimodal data or the user's own (a prepared corpus, or JSONL texts and
conversations tokenized with the checkpoint's tokenizer).

Example:
  >>> from cpjax.training.run_config import RunConfig, with_values
  >>> from cpjax.training.trainer import build
  >>> run = with_values(RunConfig(), {"parallel.cp": 2, "dataset.seq_len": 64,
  ...                                 "parity_check": False})
  >>> trainer = build(run)
  >>> trainer.state.step, dict(trainer.mesh.shape)
  (0, {'cp': 2})
"""

from cpjax import _deprecations
from cpjax.training.trainer.builder import build
from cpjax.training.trainer.data import (
  Data,
  check_vocabulary,
  corpus_path,
  eval_rows,
  open_data,
  step_batches,
)
from cpjax.training.trainer.hooks import Hook, external_write, make_hooks
from cpjax.training.trainer.loop import describe, fit, resume, train
from cpjax.training.trainer.state import Trainer, TrainState, host_value, run_identity

__all__ = [
  "Data",
  "Hook",
  "TrainState",
  "Trainer",
  "build",
  "check_vocabulary",
  "corpus_path",
  "describe",
  "eval_rows",
  "external_write",
  "fit",
  "host_value",
  "make_hooks",
  "open_data",
  "resume",
  "run_identity",
  "step_batches",
  "train",
]


def __getattr__(name: str):
  return _deprecations.moved_attribute(__name__, name)
