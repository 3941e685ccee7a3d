"""The README and the docs: their commands and snippets run as written (at a
small size), and the pages made from the code say what the code does."""

import os

import numpy as np

import cpjax
from tests.helpers import ROOT, code_blocks, doc


def section_code(page: str, title: str) -> str:
  return "\n".join(code_blocks(doc(page, title), "python"))


def test_own_model_example_runs_and_is_short():
  """The snippet builds its own packed rows (two documents and padding) and
  trains one step on cp = 8: every next-token label within a document counts."""
  code = section_code("guides/own-model.md", "Your own model")
  assert len(code.strip().splitlines()) < 40
  scope = {}
  exec(compile(code, "docs/guides/own-model.md", "exec"), scope)  # noqa: S102
  metrics = scope["metrics"]
  assert np.isfinite(float(metrics["loss"]))
  assert float(metrics["tokens"]) == 2 * (39 + 19)  # next-token labels per document


def test_planning_a_run_from_python_is_the_plan_of_the_run(capsys):
  """The Planning section's snippet prints the closed form's row of the run
  it builds: the same as the shape derived from that run, with its remat."""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import plan
  from cpjax.training.run_config import RunConfig, with_values

  exec(compile(section_code("guides/planning.md", "Planning a run"), "planning.md", "exec"), {})  # noqa: S102
  printed = capsys.readouterr().out.strip()
  run = with_values(RunConfig(), {"dataset.seq_len": 4096, "parallel.cp": 2, "remat": "full"})
  want = plan.estimate(Gemma4Config.preset("tiny"), plan.StepShape.of(run), model="tiny")
  assert printed == want.row()
  assert want.remat == "full" and want.mesh == {"cp": 2}


def test_generated_reference_pages_cover_the_code():
  """`make docs`'s reference pages: every command's --help, every run-config
  key with its docstring, every recipe with its notes."""
  import importlib.util

  from cpjax import recipes
  from cpjax.training.run_config import settings

  spec = importlib.util.spec_from_file_location(
    "docs_hooks", os.path.join(ROOT, "tools", "docs_hooks.py")
  )
  hooks = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hooks)
  cli_page = hooks.cli_page()
  for command in ("cpjax train", "cpjax plan", "cpjax prepare-data", "cpjax demo"):
    assert f"## `{command}`" in cli_page and f"usage: {command}" in cli_page, command
  keys = hooks.run_config_page()
  for setting in settings():
    assert f"| `{setting.key}` |" in keys, setting.key
  assert (
    "| `dataset.seq_len` | `--seq-len` | `int` | `1024` | tokens per row before padding |" in keys
  )
  page = hooks.recipes_page()
  for name in recipes.RECIPES:
    assert f"| [`{name}`](#{name}) |" in page and f"## {name}\n" in page, name
  assert "* compiled by XLA:TPU" in page.split("## a4b-lora-128k-v5e\n")[1].split("\n## ")[0]


def run_page(page: str, replace: dict[str, str] | None = None) -> dict:
  """Run a docs page's python blocks top to bottom in one namespace, as a
  reader pastes them (``replace``: a checkpoint's name by a local one)."""
  scope = {}
  for i, code in enumerate(code_blocks(doc(page), "python")):
    for name, local in (replace or {}).items():
      code = code.replace(name, local)
    exec(compile(code, f"docs/{page}, block {i}", "exec"), scope)  # noqa: S102
  return scope


def test_the_batches_page_runs_and_its_layouts_invert():
  scope = run_page("concepts/batches.md")
  np.testing.assert_array_equal(
    np.asarray(scope["restored"]["labels"]), np.asarray(scope["batch"]["labels"])
  )
  ranks, cp = scope["ranks"], 8  # load-balanced: chunk c of 2 cp on rank min(c, 2 cp - 1 - c)
  chunk = np.arange(ranks.shape[1]) // (ranks.shape[1] // (2 * cp))
  np.testing.assert_array_equal(
    ranks, np.broadcast_to(np.minimum(chunk, 2 * cp - 1 - chunk), ranks.shape)
  )
  layout, source = scope["layout"], scope["source"]
  assert layout.kind == "document_balanced"
  back = cpjax.from_rank_order(scope["q_r"], layout, source_index=source)  # padded
  np.testing.assert_array_equal(np.asarray(back)[:, : layout.original_seq_len], scope["q"])


def test_the_attention_page_runs_and_equals_dense_attention():
  scope = run_page("concepts/attention.md")
  q, k, v, docs = scope["q"], scope["k"], scope["v"], scope["docs"]
  want = cpjax.reference_attention(q, k, v, document_ids=docs, sliding_window=128)
  np.testing.assert_allclose(np.asarray(scope["out"]), np.asarray(want), atol=2e-6)
  rule = "AllOf(LocalWindow(left=127, right=0), SameDocument(), KeyNotPadding())"
  made = cpjax.AttentionMask.create(sliding_window=128, document_ids=docs, padding_mask=docs == 0)
  assert repr(made.rule) == rule and f"mask.rule  # {rule}" in doc("concepts/attention.md")


def test_the_meshes_page_trains_a_step_on_fsdp_cp_tp():
  """The step on a 3-D mesh runs, and "same shardings out" (its parity with
  one device: test_parallel.py's test_mesh_step_equals_single_device_step)."""
  import jax

  line = "params, opt_state, metrics = step(params, opt_state, sharded)"
  scope = run_page("concepts/meshes.md", {line: "given = params\n" + line})
  assert np.isfinite(float(scope["metrics"]["loss"]))
  assert dict(scope["mesh"].shape) == {"fsdp": 2, "cp": 2, "tp": 2}
  before, after = (jax.tree.leaves(scope[k]) for k in ("given", "params"))
  assert [x.sharding for x in after] == [x.sharding for x in before]
  assert any(x.sharding.spec != jax.P() for x in after)  # split, not replicated


def test_the_gemma4_page_runs_on_a_checkpoint_transformers_saved(
  tmp_path, monkeypatch, hf_checkpoint
):
  """Loading, one device, cp = 8 and saving, on an E2B-like checkpoint; the
  cp logits equal one device's in float32, and the step is built."""
  base = hf_checkpoint("dense")
  monkeypatch.chdir(tmp_path)
  scope = run_page("concepts/gemma4.md", {'"gemma-4-E2B-it/"': repr(base)})
  logits, split = np.asarray(scope["logits"]), np.asarray(scope["split"])
  np.testing.assert_allclose(split, logits, atol=1e-4 * np.abs(logits).max())
  assert (tmp_path / "out" / "model.safetensors").is_file()
  assert callable(scope["step"])


def test_the_readme_python_example_is_dense_attention():
  (code,) = code_blocks(doc("README.md", "In Python"), "python")
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
  q, k, v = scope["q"], scope["k"], scope["v"]
  want = cpjax.reference_attention(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(scope["out"]), np.asarray(want), atol=2e-6)


def test_the_one_gpu_recipe_command_runs_at_a_small_size(tmp_path, monkeypatch, hf_checkpoint):
  """The one-GPU guide's command, on an E2B-like checkpoint transformers saved
  and the shipped chat data, small (S = 256, one step; groups of 8 for the
  tiny widths): the recipe's one device, its int4 base and its adapter, which
  PEFT's config reads."""
  import json
  import shlex

  from cpjax import cli

  (command,) = code_blocks(doc("guides/one-gpu.md", "The recipes"), "bash")
  args = shlex.split(command.strip())
  assert args[:2] == ["cpjax", "train"]
  base = hf_checkpoint("dense")
  chat = os.path.join(ROOT, "cpjax", "examples", "chat", "train.jsonl")
  text = " ".join(args[2:])
  for big, little in (
    ("--checkpoint gemma-4-E2B-it", f"--checkpoint {base}"),
    ("chat-corpus", chat),
  ):
    assert big in text, big
    text = text.replace(big, little)
  monkeypatch.chdir(tmp_path)
  small = ["--seq-len", "256", "--steps", "1", "--warmup-steps", "0", "--lora.group_size", "8"]
  assert cli.main(["train", *shlex.split(text), *small, "--state-dir", "state"]) == 0
  config = json.loads((tmp_path / "my-adapter" / "adapter_config.json").read_text())
  assert config["r"] == 16
  run = (tmp_path / "state" / "run.yaml").read_text()
  assert "base_dtype: int4" in run and "mesh: cp=1" in run


def test_every_plan_command_of_the_docs_plans_as_written(tmp_path, monkeypatch, capsys):
  """Each `cpjax plan` command of the docs, as written: its flags, recipe,
  dotted keys, checkpoint (the published E4B config.json) and written config
  are taken, and the closed form is computed; the compile itself is replaced
  by a stand-in that fits (the real compilers: tests/test_compile_targets.py
  in CI, each recipe at full size in `make soak`)."""
  import dataclasses
  import glob
  import shlex

  from cpjax import cli
  from cpjax.training import plan

  compiled = []

  def fake(cfg, shape, *, model, target=None, mesh=None, device_memory=None, **_):
    shape = plan.StepShape.take(shape, {"mesh": mesh} if mesh else {})
    compiled.append((model, shape.seq_len, getattr(target, "name", None)))
    est = plan.estimate(cfg, shape, model=model)
    return dataclasses.replace(est, source=target.name if target else "XLA:CPU")

  monkeypatch.setattr(plan, "compiled_plan", fake)
  monkeypatch.setattr(plan.search, "compiled_plan", fake)
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.chdir(tmp_path)
  published = os.path.join(ROOT, "tests", "fixtures", "gemma4", "published", "e4b")
  (tmp_path / "gemma-4-E4B-it").symlink_to(published)
  commands = []
  for page in sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)):
    for block in code_blocks(open(page).read(), "bash"):
      for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["cpjax", "plan"]:
          commands.append(words[2:])
  assert len(commands) >= 10, commands
  for args in commands:
    assert cli.main(["plan", *args]) == 0, args  # (each fits what it names)
    out = capsys.readouterr().out
    assert out.startswith("cpjax plan: Gemma 4 "), (args, out)
    if "--write-config" in args:
      assert (tmp_path / args[args.index("--write-config") + 1]).is_file(), (args, out)
  assert compiled, "the commands that compile reach the compiler"


def test_the_resuming_guides_commands_run_at_a_small_size(tmp_path, monkeypatch):
  """guides/resuming.md's two commands, small (2 then 4 steps, saving every
  step, S = 64 on cp = 2): the second continues the first from its last
  save, with the settings its run.yaml kept."""
  import json
  import shlex

  from cpjax import cli

  (block,) = code_blocks(doc("guides/resuming.md"), "bash")
  first, second = (shlex.split(line, comments=True) for line in block.strip().splitlines())
  assert first[:2] == second[:2] == ["cpjax", "train"]
  small = {"1000": "2", "2000": "4", "100": "1"}
  first, second = ([small.get(w, w) for w in words[2:]] for words in (first, second))
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", *first, "--seq-len", "64", "--cp", "2", "--no-parity-check"]) == 0
  assert cli.main(["train", *second]) == 0  # no other flag: run.yaml has them
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(x)["step"] for x in lines]
  assert steps == [1, 2, 3, 4]


def test_the_run_configs_guides_commands_read_as_it_says(tmp_path, monkeypatch):
  """guides/run-configs.md's three commands, read by cpjax train (training
  itself replaced: the runs are tested elsewhere): a file under overrides, a
  recipe whose model gives way to --checkpoint, and --resume reading the
  run.yaml a run wrote into its state directory."""
  import shlex

  import cpjax.training.trainer
  from cpjax import cli, recipes
  from cpjax.training.run_config import with_values
  from cpjax.training.run_file import read_run_config, write_run_config

  (block,) = code_blocks(doc("guides/run-configs.md", "Run configs and recipes"), "bash")
  lines = [shlex.split(line, comments=True) for line in block.strip().splitlines()]
  started = []
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(cpjax.training.trainer, "train", lambda run, **k: started.append(run))
  monkeypatch.chdir(tmp_path)
  tiny = read_run_config(recipes.path("tiny"))
  write_run_config(tiny, tmp_path)  # run.yaml
  published = os.path.join(ROOT, "tests", "fixtures", "gemma4", "published", "e2b")
  (tmp_path / "gemma-4-E2B-it").symlink_to(published)
  (tmp_path / "chat.jsonl").write_text('{"text": "hello"}\n')
  recipe = read_run_config(recipes.path("e2b-lora-128k"))
  write_run_config(recipe, tmp_path / "runs" / "e2b-lora-128k")
  for words in lines:
    assert words[:2] == ["cpjax", "train"]
    assert cli.main([*words[1:], "--skip-memory-check"]) == 0, words
  file_run, recipe_run, resumed = started
  assert file_run == with_values(tiny, {"optimizer.lr": 1e-4, "optimizer.steps": 500})
  assert recipe_run.model is None and recipe_run.checkpoint == "gemma-4-E2B-it"
  assert recipe_run.lora == recipe.lora and recipe_run.dataset.path == "chat.jsonl"
  assert resumed.checkpointing.resume and resumed.optimizer.steps == 1000
  assert resumed.lora == recipe.lora and resumed.parallel.mesh == recipe.parallel.mesh
