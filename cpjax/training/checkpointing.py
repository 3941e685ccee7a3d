"""Resumable training state with orbax.

One checkpoint per saved step holds the parameters, the optimizer state, the
data stream's state (a grain iterator's state, or the synthetic generator's
bit-generator state) and the run's description (the model's config, batch
size, sequence length, ...). Saving is asynchronous: the arrays are copied
off the devices, the step continues, and orbax writes in the background. A
step's directory becomes visible only once it is complete (orbax writes to a
temporary directory and renames it), so a process killed while saving leaves
the previous checkpoint as the latest.

Example:
  >>> import tempfile, numpy as np
  >>> ckpt = TrainCheckpointer(tempfile.mkdtemp(), save_every=2)
  >>> params = {"w": np.ones(3, np.float32)}
  >>> [ckpt.maybe_save(s, params=params, opt_state=(), data_state={"seen": s},
  ...                  run={"seq_len": 8}) for s in (1, 2)]
  [False, True]
  >>> ckpt.wait()
  >>> step, state = ckpt.restore(params_like=params, opt_state_like=())
  >>> step, state["data_state"], state["params"]["w"].tolist()
  (2, {'seen': 2}, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["TrainCheckpointer", "check_run_matches"]


def check_run_matches(
  saved: Mapping[str, Any], current: Mapping[str, Any], *, force: bool = False
) -> None:
  """Raise ``ValueError`` when a resumed run differs from the saved one.

  The model's config and what is trained (every weight, or LoRA adapters
  of one rank, alpha, targets and base dtype) must always match. ``batch_size``, ``seq_len`` and
  ``microbatches`` must match unless ``force`` (the data stream then
  continues with the new shapes). The mesh may differ: the state is
  restored onto the current one.
  """
  if saved.get("model_config") != current.get("model_config"):
    raise ValueError(
      "the checkpoint was saved by a different model config; resume with the "
      "model it was trained with"
    )
  if saved.get("lora") != current.get("lora"):  # what the saved parameters are

    def what(run):
      lora = run.get("lora")
      return (
        "every weight" if lora is None else "LoRA " + ", ".join(f"{k}={v}" for k, v in lora.items())
      )

    raise ValueError(
      f"the checkpoint trained {what(saved)}, this run trains {what(current)}; "
      f"resume with the same LoRA settings"
    )
  for key in ("batch_size", "seq_len", "microbatches"):
    if key not in saved:  # saved before the key existed
      continue
    if saved.get(key) != current.get(key) and not force:
      raise ValueError(
        f"the checkpoint was saved with {key}={saved.get(key)}, this run has "
        f"{key}={current.get(key)}; pass --force-resume to continue anyway"
      )


class TrainCheckpointer:
  """Orbax ``CheckpointManager`` for cpjax's train state.

  Args:
    directory: where the step directories live.
    save_every: save when ``step % save_every == 0`` (0: only when asked
      with ``force=True``).
    max_to_keep: newest checkpoints kept.
    async_save: write in the background.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    save_every: int = 0,
    max_to_keep: int | None = 3,
    async_save: bool = True,
  ):
    import orbax.checkpoint as ocp

    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 0:
      raise ValueError(f"save_every must be an int >= 0, got {save_every!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    self._ocp = ocp
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, save_interval_steps=1
      ),
    )

  def latest_step(self) -> int | None:
    """Return the step of the latest complete checkpoint.

    Returns:
      The step, or None when there is none.
    """
    return self._manager.latest_step()

  def maybe_save(
    self,
    step: int,
    *,
    params: Any,
    opt_state: Any,
    data_state: Mapping[str, Any],
    run: Mapping[str, Any],
    force: bool = False,
  ) -> bool:
    """Save the state after ``step`` steps when it is due; returns whether it saved."""
    due = force or (self.save_every > 0 and step % self.save_every == 0)
    if not due:
      return False
    ocp = self._ocp
    args = ocp.args.Composite(
      state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
      data_state=ocp.args.JsonSave(dict(data_state)),
      run=ocp.args.JsonSave(dict(run)),
    )
    return self._manager.save(step, args=args, force=True)

  def saved_run(self, step: int | None = None) -> dict:
    """Read the run description saved with ``step``, without restoring any array.

    Check it before restoring.

    Args:
      step: the checkpoint's step (default: the latest).

    Returns:
      The run description.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    ocp = self._ocp
    # orbax types restore's result `Any | Mapping`; Composite args give a Composite.
    out: Any = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))
    return dict(out.run)

  def restore(
    self, step: int | None = None, *, params_like: Any, opt_state_like: Any
  ) -> tuple[int, dict]:
    """Restore the checkpoint of ``step`` (default: the latest complete one).

    The arrays take the shardings of ``params_like`` / ``opt_state_like``
    (arrays or ``ShapeDtypeStruct``).

    Args:
      step: the checkpoint's step (default: the latest complete one).
      params_like: the parameters' arrays or ``ShapeDtypeStruct``.
      opt_state_like: the optimizer state's arrays or ``ShapeDtypeStruct``.

    Returns:
      ``(step, {"params", "opt_state", "data_state", "run"})`` of ``step``.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    ocp = self._ocp
    abstract = jax.tree.map(
      ocp.utils.to_shape_dtype_struct, {"params": params_like, "opt_state": opt_state_like}
    )
    # orbax types restore's result `Any | Mapping`; Composite args give a Composite.
    out: Any = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data_state=ocp.args.JsonRestore(),
        run=ocp.args.JsonRestore(),
      ),
    )
    return step, {
      "params": out.state["params"],
      "opt_state": out.state["opt_state"],
      "data_state": out.data_state,
      "run": out.run,
    }

  def wait(self) -> None:
    """Block until every pending save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Close the orbax ``CheckpointManager``."""
    self._manager.close()
