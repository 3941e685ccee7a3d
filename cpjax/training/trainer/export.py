"""``checkpointing.save``: the trained model as a Hugging Face checkpoint
(with the files that make it load as the original did), or the LoRA adapter
as PEFT's files, or merged into the base."""

from __future__ import annotations

import os
import shutil

import jax
from flax import nnx

from cpjax.training import lora
from cpjax.training.run_file import write_run_config
from cpjax.training.trainer.state import Trainer

__all__ = ["BESIDE_WEIGHTS", "TOKENIZER_FILES", "save_model"]

# The files of a checkpoint directory besides its config and weights.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "tokenizer.model",
  "special_tokens_map.json",
  "chat_template.jinja",
)
BESIDE_WEIGHTS = (
  "generation_config.json",
  *TOKENIZER_FILES,
  "processor_config.json",
  "preprocessor_config.json",
)


def save_model(trainer: Trainer) -> list[str] | None:
  """Save the trained model to ``checkpointing.save`` (nothing without it).

  A full fine-tune, or a LoRA run with ``lora.merge``, writes a Hugging Face
  checkpoint, and keeps beside it the tokenizer and template it was trained
  with (``dataset.tokenizer``'s, else the checkpoint's) and the checkpoint's
  processor and generation settings; a LoRA run writes PEFT's adapter files.
  Either way the run's ``run.yaml`` goes beside them.

  Args:
    trainer: the :class:`Trainer`, at the step to save.

  Returns:
    The weight files written, or None without ``checkpointing.save``.
  """
  run, out = trainer.run, trainer.run.checkpointing.save
  if not out:
    return None
  state = jax.device_get((trainer.state.params, trainer.frozen))
  trained = nnx.merge(trainer.graphdef, *state)
  if run.lora.rank is not None and not run.lora.merge:
    files = lora.save_adapter(trained, out, base_model_name_or_path=run.checkpoint)
    write_run_config(run, out)
    trainer.log(
      f"saved the LoRA adapter to {out} (PEFT's adapter_config.json, "
      f"adapter_model.safetensors, and the run's run.yaml)"
    )
    return files
  if run.lora.rank is not None:
    trained = lora.merge_lora(trained)
  files = trained.save_pretrained(out)
  kept = []
  for name in BESIDE_WEIGHTS:
    source = (
      run.dataset.tokenizer if run.dataset.tokenizer and name in TOKENIZER_FILES else run.checkpoint
    )
    path = os.path.join(source, name) if source else None
    if path and os.path.isfile(path):
      target = os.path.join(out, name)
      if not (os.path.exists(target) and os.path.samefile(path, target)):
        shutil.copyfile(path, target)
      kept.append(name)
  write_run_config(run, out)
  kept.append("run.yaml")
  merged = " with the LoRA adapter merged in" if run.lora.rank is not None else ""
  trainer.log(
    f"saved a Hugging Face checkpoint{merged} to {out} ({len(files)} safetensors "
    f"file(s), and {', '.join(kept)})"
  )
  return files
