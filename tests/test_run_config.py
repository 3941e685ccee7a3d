"""Run configs: the nested settings, YAML files with dotted overrides, the short
flags as aliases, run.yaml written with every run, and the shipped recipes."""

import json
import os
import re

import pytest

from cpjax import cli, recipes
from cpjax.cli.parser import train_parser
from cpjax.training import plan, targets
from cpjax.training.lora import DEFAULT_LORA_PARAMETERS, DEFAULT_LORA_TARGETS
from cpjax.training.run_config import (
  DatasetConfig,
  OptimizerConfig,
  RunConfig,
  RunError,
  check,
  devices_needed,
  settings,
  with_values,
)
from cpjax.training.run_file import (
  alias_flag,
  read_run_config,
  run_from_namespace,
  to_yaml,
  write_run_config,
)
from tests.helpers import code_blocks, doc

PARSER = train_parser()


def parse(*argv) -> RunConfig:
  return run_from_namespace(PARSER.parse_args(list(argv)))


def test_every_recipe_round_trips_through_yaml(tmp_path):
  for name in recipes.RECIPES:
    run = read_run_config(recipes.path(name))
    again = read_run_config(write_run_config(run, tmp_path / name))
    assert again == run, name
    check(run, files=False)
  # Every file here is listed, and every listed recipe has its file.
  files = {f[:-5] for f in os.listdir(os.path.dirname(recipes.__file__)) if f.endswith(".yaml")}
  assert files == set(recipes.RECIPES)
  # The README's grid names each published-size recipe once, and no other,
  # with the chips it was planned for.
  grid = re.findall(r"`([a-z0-9-]+)` \(([^)]*)\)", doc("README.md", "Which recipe"))
  assert sorted(name for name, _ in grid) == sorted(
    n for n, r in recipes.RECIPES.items() if r.devices
  )
  for name, chips in grid:
    assert chips == recipes.RECIPES[name].target, name


@pytest.mark.parametrize("name", [n for n, r in recipes.RECIPES.items() if r.devices])
def test_each_published_size_recipe_fits_its_device(name):
  """The closed form (cpjax plan's for the chip's compiler, with the run's
  CP strategies) of each recipe, as written, fits the device it names, on
  the number of devices it names."""
  from cpjax.models.gemma4 import Gemma4Config

  run, target = read_run_config(recipes.path(name)), recipes.RECIPES[name]
  assert devices_needed(run) == target.devices
  # The chips it names are those devices.
  chips = targets.parse_target(target.target)
  assert chips.num_devices == target.devices
  assert abs(chips.chip.memory - plan.parse_bytes(target.device_memory)) < 2**30
  cfg = Gemma4Config.preset(run.model)
  est = plan.estimate(
    cfg,
    run,
    model=run.model,
    platform=chips.chip.platform,
    device_memory=chips.chip.memory,
    audio_seconds=target.audio_seconds,
  )
  memory = plan.parse_bytes(target.device_memory)
  assert est.fits(memory), est.row()
  # Long rows over a slice; on one chip, the longest row its compiler fits.
  assert run.dataset.seq_len >= (131072 if target.devices > 1 else 32768)
  assert not run.parity_check
  # The file's note of its plan is the closed form's answer today.
  note = (
    f"# planned by cpjax plan: {' '.join(est.row().split())} [{run.dtype} activations] "
    f"fits ({plan.format_bytes(memory)} per device)"
  )
  with open(recipes.path(name)) as f:
    assert note in f.read().splitlines(), note


def test_overrides_beat_the_file_and_short_flags_beat_both(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("optimizer:\n  lr: 0.5\n  steps: 7\ndataset:\n  seq_len: 96\n")
  assert parse("--config", str(path)).optimizer == OptimizerConfig(lr=0.5, steps=7)
  assert parse("--config", str(path), "--optimizer.lr", "0.25").optimizer.lr == 0.25
  # A short flag beats both.
  run = parse("--lr", "0.125", "--config", str(path), "--optimizer.lr", "0.25")
  assert run.optimizer.lr == 0.125 and run.dataset.seq_len == 96 and run.optimizer.steps == 7


def test_cpjax_train_reads_files_first_so_every_key_beats_them(monkeypatch, tmp_path):
  """On `cpjax train`'s command line a key beats every file, wherever it
  stands (files apply first, in their order)."""
  import cpjax.training.trainer

  path = tmp_path / "run.yaml"
  path.write_text("optimizer:\n  lr: 0.5\n")
  started = []
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(cpjax.training.trainer, "train", lambda run, **k: started.append(run))
  for argv in (
    ["--optimizer.lr", "0.25", "--recipe", "tiny", "--config", str(path)],
    ["--recipe=tiny", "--optimizer.lr=0.25", f"--config={path}"],
  ):
    assert cli.main(["train", *argv, "--skip-memory-check", "--seq-len", "64"]) == 0
    assert started[-1].optimizer.lr == 0.25
  assert (
    cli.main(
      [
        "train",
        "--optimizer.steps",
        "3",
        "--config",
        str(path),
        "--recipe",
        "tiny",
        "--skip-memory-check",
      ]
    )
    == 0
  )
  assert (
    started[-1].optimizer.lr == 0.003 and started[-1].optimizer.steps == 3
  )  # the recipe's, read last


# A value for each short flag, and what it sets (its dotted key's value).
ALIAS_VALUES = {
  "--data": "x.jsonl",
  "--tokenizer": "tok",
  "--seq-len": "96",
  "--batch-size": "4",
  "--microbatches": "2",
  "--images-per-row": "3",
  "--audio-clips-per-row": "2",
  "--videos-per-row": "2",
  "--lr": "0.5",
  "--lr-schedule": "cosine",
  "--warmup-steps": "3",
  "--max-grad-norm": "1.5",
  "--steps": "9",
  "--mesh": "fsdp=2,cp=4",
  "--cp": "4",
  "--layout": "document_balanced",
  "--shard-state": "fsdp",
  "--lora-rank": "4",
  "--lora-alpha": "16",
  "--lora-targets": ".*q_proj",
  "--base-dtype": "bfloat16",
  "--capacity-factor": "1.25",
  "--eval-data": "e.jsonl",
  "--eval-every": "5",
  "--eval-rows": "8",
  "--metrics": "m.jsonl",
  "--tensorboard": "tb",
  "--state-dir": "s",
  "--save-every": "2",
  "--save": "out",
}


def test_every_short_flag_sets_its_dotted_key():
  seen = set()
  for s in settings():
    flag = alias_flag(s)
    if flag is None or flag == "--" + s.key:  # no alias, or the key itself (--model)
      continue
    seen.add(flag)
    if flag in ALIAS_VALUES:
      value = ALIAS_VALUES[flag]
      assert parse(flag, value) == parse("--" + s.key, value), flag
      assert parse(flag, value) != RunConfig(), flag
    else:  # a switch: --truncate, --no-parity-check
      want = "false" if flag.startswith("--no-") else "true"
      assert parse(flag) == parse("--" + s.key, want) != RunConfig(), flag
  assert seen >= set(ALIAS_VALUES) | {
    "--truncate",
    "--no-parity-check",
    "--merge-lora",
    "--force-resume",
  }


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--optimizer.lrr", "1"], "unrecognized arguments: --optimizer.lrr"),
    (["--optimizer.lr", "fast"], "--optimizer.lr: expected float, got 'fast'"),
    (
      ["--parallel.layout", "zz"],
      "--parallel.layout: expected ['contiguous', 'load_balanced', 'document_balanced'], got 'zz'",
    ),
    (["--dataset.seq_len", "8"], "--dataset.seq_len must be >= 32, got 8"),
    (["--optimizer.steps", "0"], "--optimizer.steps must be > 0, got 0"),
    (["--recipe", "nope"], "--recipe: no recipe 'nope'; the recipes are ["),
    (["--config", "FILE:lrr: 1\n"], "Option 'lrr' is not accepted"),
    (["--config", "FILE:optimizer:\n  lrr: 1\n"], "Group 'optimizer' does not accept option 'lrr'"),
    (["--config", "FILE:optimizer:\n  lr: fast\n"], "--optimizer.lr: expected float, got 'fast'"),
    (
      ["--recipe", "tiny", "--parallel.mesh", "fsdp=2", "--cp", "2"],
      "--parallel.mesh sets the cp size; do not add --cp",
    ),
    (
      ["--recipe", "tiny-moe-ep", "--cp", "4"],
      "--cp 4 would replace the run's mesh fsdp=2,cp=2,ep=4 and drop its fsdp=2,ep=4; give "
      "the whole mesh instead, e.g. --mesh fsdp=2,cp=4,ep=4",
    ),
    # A value from a file is named by its dotted key; a null where a value must be.
    (
      ["--config", "FILE:dataset:\n  seq_len: 16\n"],
      "error: dataset.seq_len must be >= 32, got 16",
    ),
    (["--config", "FILE:dataset:\n  seq_len: null\n"], "dataset.seq_len must be int, got None"),
    (["--config", "FILE:parity_check: null\n"], "parity_check must be bool, got None"),
    (["--checkpointing.resume", "true"], "--checkpointing.resume: use --resume DIR"),
    (["--optimizer.l", "1"], "unrecognized arguments: --optimizer.l 1"),
    (
      ["--parallel.strategy", "a2a"],
      "error: --parallel.strategy: strategy must be one of ('ring', 'all_gather', 'ulysses', "
      "'hybrid') "
      "or a mapping of layer kinds to them, got 'a2a'",
    ),
    (
      ["--model", "tiny", "--cp", "8", "--parallel.strategy", "full_attention=ulysses"],
      "error: --parallel.strategy 'full_attention=ulysses' splits tiny's 4 query heads a tp "
      "rank over cp = 8, which does not divide them; use ring or all_gather, or a cp size "
      "dividing 4",
    ),
    (
      ["--model", "tiny-moe", "--cp", "4", "--parallel.strategy", "hybrid"],
      "error: --parallel.strategy 'hybrid' runs Ulysses over a factor of cp = 4 that splits "
      "the K/V heads of tiny-moe's full_attention layers (1 a tp rank), and none does; use "
      "ring, all_gather or ulysses, or a cp size sharing a factor with them",
    ),
    (
      ["--model", "tiny", "--parallel.strategy", "global=all_gather"],
      "error: --parallel.strategy names layer kind 'global', which tiny lacks: its layer "
      "kinds are ['full_attention', 'sliding_attention']",
    ),
  ],
)
def test_unknown_keys_and_wrong_types_are_one_line_exit_two(
  argv, message, capsys, tmp_path, monkeypatch
):
  if argv[0] == "--config":
    path = tmp_path / "bad.yaml"
    path.write_text(argv[1].split(":", 1)[1])
    argv = ["--config", str(path)]
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  with pytest.raises(SystemExit) as exc:
    cli.main(["train", *argv])
  err = capsys.readouterr().err
  assert exc.value.code == 2 and message in err, err
  assert len(err.strip().splitlines()) == 1, err


def test_the_command_line_replaces_what_a_file_trains_and_its_mesh(monkeypatch):
  """`cpjax train --recipe NAME --checkpoint DIR` trains the checkpoint with
  the recipe's other settings (the file's model gives way), and --cp replaces
  the file's mesh."""
  import cpjax.training.trainer

  here = os.path.dirname(__file__)
  ckpt = os.path.join(here, "fixtures", "gemma4", "ple_kv_sharing")
  started = []
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(cpjax.training.trainer, "train", lambda run, **k: started.append(run))
  assert (
    cli.main(
      [
        "train",
        "--recipe",
        "e2b-lora-128k",
        "--checkpoint",
        ckpt,
        "--seq-len",
        "64",
        "--skip-memory-check",
      ]
    )
    == 0
  )
  run = started[0]
  assert run.model is None and run.checkpoint == ckpt and run.dataset.seq_len == 64
  assert run.lora == read_run_config(recipes.path("e2b-lora-128k")).lora
  assert run.parallel.mesh == "cp=8" and run.dtype == "bfloat16"
  assert cli.main(["train", "--recipe", "tiny", "--cp", "2", "--skip-memory-check"]) == 0
  assert started[1].parallel.mesh is None and started[1].parallel.cp == 2
  # A mesh with more than cp (expert parallelism here) is not dropped by --cp.
  assert cli.main(["train", "--recipe", "tiny-moe-ep", "--mesh", "cp=4,ep=4"]) == 0
  assert started[2].parallel.mesh == "cp=4,ep=4" and started[2].model == "tiny-moe"


def _losses(directory) -> list[float]:
  with open(os.path.join(directory, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


def test_run_yaml_reruns_bit_for_bit_and_resume_reads_it(tmp_path, monkeypatch):
  """A run writes run.yaml (every value, and cpjax's version); passed back
  with --config it gives the same losses bit for bit; --resume DIR alone
  continues the run with the settings it was saved with."""
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  a, b = tmp_path / "a", tmp_path / "b"
  assert (
    cli.main(
      [
        "train",
        "--recipe",
        "tiny",
        "--seq-len",
        "64",
        "--cp",
        "2",
        "--steps",
        "2",
        "--lr",
        "1e-3",
        "--optimizer.schedule",
        "linear",
        "--state-dir",
        str(a),
        "--no-parity-check",
        "--seed",
        "3",
      ]
    )
    == 0
  )
  text = (a / "run.yaml").read_text()
  assert (
    text.startswith("# cpjax ") and "  seq_len: 64\n" in text and "  schedule: linear\n" in text
  )
  saved = read_run_config(a / "run.yaml")
  assert saved.seed == 3 and saved.optimizer.lr == 1e-3 and saved.parallel.cp == 2
  assert (
    cli.main(
      ["train", "--config", str(a / "run.yaml"), "--state-dir", str(b), "--save", str(b / "model")]
    )
    == 0
  )
  assert _losses(b) == _losses(a) and len(_losses(a)) == 2
  # Beside --save's files too, as the run it was.
  assert read_run_config(b / "model" / "run.yaml") == read_run_config(b / "run.yaml")
  assert read_run_config(b / "run.yaml").checkpointing.save == str(b / "model")
  # --resume reads the run's own settings: seq_len 64 (not the default 1024), cp 2, seed 3.
  assert cli.main(["train", "--resume", str(a), "--steps", "3"]) == 0
  resumed = read_run_config(a / "run.yaml")
  assert resumed.optimizer.steps == 3 and resumed.dataset.seq_len == 64 and len(_losses(a)) == 3
  # How a command started is not part of the run: the next --resume asks again.
  assert not resumed.checkpointing.resume and not resumed.checkpointing.force_resume


def _plan(argv: str, path=None):
  """Run ``cpjax plan ARGV --estimate-only`` (``--write-config path``); return what it wrote."""
  write = ["--write-config", str(path)] if path else []
  assert cli.main(["plan", *argv.split(), "--estimate-only", *write]) == 0
  return read_run_config(path) if path else None


def test_plan_writes_a_config_that_fits(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  path = tmp_path / "plan.yaml"
  run = _plan(
    "--model e2b --seq-len 131072 --lora-rank 16 --base-dtype bfloat16 --remat full"
    " --device-memory 16GiB",
    path,
  )
  # The plan's mesh and batch (the closed form's fewest devices: 10.7 GiB
  # on cp=4, 21.1 on cp=2), bfloat16 activations (float32 does not fit 16 GiB),
  # and no single-device parity step (one device cannot hold it).
  assert (run.model, run.parallel.mesh, run.dataset.batch_size) == ("e2b", "cp=4", 1)
  assert (run.dtype, run.remat, run.lora.rank, run.parity_check) == ("bfloat16", "full", 16, False)
  assert "fits (16 GiB per device)" in path.read_text()
  # Where float32 activations fit too, the plan keeps them; one 141 GiB
  # device holds this step too (with the MLP in tiles), so the parity check stays.
  run = _plan("--model e2b --seq-len 131072 --mesh cp=8 --remat full --device-memory 141GiB", path)
  assert (run.parallel.mesh, run.dtype, run.lora.rank) == ("cp=8", "float32", None)
  assert run.parity_check
  # Where one device holds the step too, the first step's parity check stays on.
  run = _plan("--model tiny --seq-len 1024 --mesh fsdp=2,cp=4 --device-memory 16GiB", path)
  assert (run.parity_check, run.dtype, run.dataset.batch_size) == (True, "float32", 2)


def test_plan_takes_a_runs_dotted_keys_and_writes_its_other_settings(tmp_path, capsys, monkeypatch):
  """cpjax plan reads --recipe / --config and dotted keys as cpjax train does;
  --write-config keeps every setting the plan does not choose (the recipe's
  steps, a dotted key's learning rate), and a microbatched batch stays whole."""
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  path = tmp_path / "plan.yaml"
  run = _plan(
    "--recipe tiny --dataset.seq_len 512 --optimizer.lr 0.01 --mesh fsdp=2,cp=4"
    " --dataset.batch_size=4 --dataset.microbatches=2",
    path,
  )
  assert "cpjax plan: Gemma 4 tiny, S=512" in capsys.readouterr().out
  assert (run.dataset.seq_len, run.optimizer.lr, run.optimizer.steps) == (512, 0.01, 20)
  assert (run.parallel.mesh, run.parallel.cp, run.remat) == ("fsdp=2,cp=4", None, "none")
  # A batch of 4 in 2 microbatches plans a step of 2 rows; written back whole.
  assert (run.dataset.batch_size, run.dataset.microbatches) == (4, 2)
  # Dotted keys alone name only what they set, the rest at the run config's
  # defaults (remat none, as cpjax train); the plan's own flags beat them.
  _plan("--model e2b --dataset.seq_len 65536 --parallel.mesh cp=8")
  assert "Gemma 4 e2b, S=65536, remat none, full training, 8 devices" in capsys.readouterr().out
  _plan("--dataset.seq_len 65536 --seq-len 4096 --mesh cp=2")
  assert "Gemma 4 tiny, S=4096" in capsys.readouterr().out
  for argv, message in (
    (["--dataset.seq_len", "long"], "dataset.seq_len"),
    (["--dataset.seqlen", "64"], "dataset.seqlen"),
    (["--bogus", "3"], "unrecognized arguments: --bogus"),
    (
      ["--dataset.batch_size", "3", "--mesh", "fsdp=2,cp=1"],
      "must be a multiple of the mesh's fsdp x dp = 2",
    ),
  ):
    with pytest.raises(SystemExit) as e:
      cli.main(["plan", "--mesh", "cp=2", "--seq-len", "64", "--estimate-only", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.parametrize("kind, mesh", [("dense", "fsdp=2,cp=4"), ("moe", "fsdp=2,cp=4,ep=4")])
def test_plan_takes_dotted_keys_with_a_transformers_checkpoint(
  kind, mesh, hf_checkpoint, capsys, monkeypatch
):
  """A checkpoint saved by transformers (dense, and MoE with its experts over
  cp): cpjax plan reads the model from its config.json and the length and
  mesh from the dotted keys, as cpjax train would, and prints the closed form
  of that config with the strategies cpjax train would take."""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.parallel import parse_mesh
  from cpjax.training import cp_strategy

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  checkpoint = hf_checkpoint(kind)
  argv = ["plan", "--checkpoint", checkpoint, "--dataset.seq_len", "512"]
  assert cli.main([*argv, "--parallel.mesh", mesh, "--estimate-only"]) == 0
  out = capsys.readouterr().out
  cfg = Gemma4Config.from_hf(checkpoint)
  choices = cp_strategy.choose(cfg.text, seq_len=512, cp=4)
  want = plan.estimate(
    cfg,
    model=os.path.basename(os.path.normpath(checkpoint)),
    seq_len=512,
    mesh=parse_mesh(mesh),
    dtype="bfloat16",
    strategy=cp_strategy.as_strategy(choices),
    loss_strategy="auto",
  )
  assert f"  {want.row()} [bfloat16 activations]" in out, out
  assert "S=512, remat none, full training, 8 devices" in out, out


def test_python_users_get_dotted_keys():
  with pytest.raises(
    RunError, match=r"^dataset\.microbatches 3 must divide dataset\.batch_size 4$"
  ):
    check(RunConfig(dataset=DatasetConfig(batch_size=4, microbatches=3)))
  with pytest.raises(RunError, match=r"^optimizer\.schedule must be one of"):
    check(RunConfig(optimizer=OptimizerConfig(schedule="step")))
  run = with_values(
    RunConfig(),
    {
      "dataset.seq_len": 64,
      "optimizer.lr": 0.1,
      "lora.rank": 4,
      "parallel.mesh": "fsdp=2,cp=4",
      "remat": "full",
    },
  )
  assert (run.dataset.seq_len, run.optimizer.lr, run.lora.rank, run.remat) == (64, 0.1, 4, "full")
  assert run.model is None and devices_needed(run) == 8
  with pytest.raises(KeyError, match=r"unknown run settings \['dataset\.seqlen'\]"):
    with_values(run, {"dataset.seqlen": 64})
  assert to_yaml(run).count("\n") > len(settings())  # every value written
  mixed = with_values(run, {"parallel.strategy": "full_attention=all_gather"})
  check(mixed)
  assert "  strategy: full_attention=all_gather\n" in to_yaml(mixed)
  forced = with_values(run, {"checkpointing.resume": True, "checkpointing.force_resume": True})
  assert "  resume: false\n  force_resume: false\n" in to_yaml(forced)


def test_lora_targets_may_be_module_names_in_yaml(tmp_path):
  """lora.targets and lora.target_parameters are PEFT's target_modules and
  target_parameters: a regex or a list of names; a list round-trips through
  run.yaml as a list, each entry must be a name, and one of the two must
  name something."""
  run = with_values(
    RunConfig(),
    {
      "lora.rank": 4,
      "lora.targets": ("q_proj", "v_proj"),
      "lora.target_parameters": ("experts.down_proj",),
    },
  )
  check(run, files=False)
  text = to_yaml(run)
  assert "  targets:\n  - q_proj\n  - v_proj\n" in text
  assert "  target_parameters:\n  - experts.down_proj\n" in text
  assert read_run_config(write_run_config(run, tmp_path)) == run
  check(with_values(run, {"lora.targets": ()}), files=False)  # the experts alone
  with pytest.raises(
    RunError,
    match=r"^lora\.targets and lora\.target_parameters are both empty: nothing to adapt$",
  ):
    check(with_values(run, {"lora.targets": (), "lora.target_parameters": ()}), files=False)
  with pytest.raises(
    RunError,
    match=r"^lora\.target_parameters must be a regex string or a tuple of names "
    r"\(\(\): none\), got \('experts\.down_proj', ''\)$",
  ):
    check(with_values(run, {"lora.target_parameters": ("experts.down_proj", "")}), files=False)
  with pytest.raises(RunError, match=r"^lora\.targets '\(' is not a regular expression"):
    check(with_values(run, {"lora.targets": "("}), files=False)


@pytest.mark.parametrize(
  "flags,targets,tensors",
  [
    (["--lora.target_parameters", "[]"], DEFAULT_LORA_TARGETS, ()),  # the experts frozen
    (["--lora.targets", "[]"], (), DEFAULT_LORA_PARAMETERS),  # the experts alone
    (
      ["--lora.target_parameters", "[experts.down_proj]"],
      DEFAULT_LORA_TARGETS,
      ("experts.down_proj",),
    ),
    (
      ["--lora.target_parameters", r".*experts\.down_proj"],
      DEFAULT_LORA_TARGETS,
      r".*experts\.down_proj",
    ),
  ],
)
def test_the_readme_lora_target_flags_read_as_peft_would(flags, targets, tensors):
  """The README's `--lora.target_parameters '[]'` and `--lora.targets '[]'`:
  an empty list is no target (not a regex), a list is names, a string a regex."""
  from cpjax.training.run_file import run_from_namespace, run_parser

  run = run_from_namespace(run_parser().parse_args(["--lora.rank", "4", *flags]))
  assert (run.lora.targets, run.lora.target_parameters) == (targets, tensors)
  check(run, files=False)


def test_a_bad_file_read_in_python_is_a_run_error(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("dataset:\n  seq_len: long\n")
  with pytest.raises(RunError, match=r"bad\.yaml: --dataset\.seq_len: expected int, got 'long'"):
    read_run_config(path)


def test_the_tiny_moe_recipe_is_the_readme_expert_parallel_command():
  """The docs' expert-parallel command (concepts/meshes.md) trains in CI on a checkpoint
  transformers saved, and as written in `make soak`
  (tests/test_experts.py::test_readme_ep_command_runs_and_reports_the_routing,
  its first step checked against the single-device model); the recipe is
  that run, setting for setting."""
  import shlex

  section = doc("concepts/meshes.md").split("**Expert parallelism** (Gemma 4's MoE)", 1)[1]
  command = code_blocks(section, "bash")[0].strip()
  assert parse(*shlex.split(command)[2:]) == read_run_config(recipes.path("tiny-moe-ep"))


def test_the_readme_python_example_runs(tmp_path, monkeypatch):

  import cpjax.training.trainer

  code = "\n".join(code_blocks(doc("guides/run-configs.md"), "python"))
  started = []  # training itself is tested above; here, what the example hands it
  monkeypatch.setattr(cpjax.training.trainer, "train", lambda run: started.append(run))
  monkeypatch.chdir(tmp_path)
  exec(compile(code, "run-configs.md", "exec"), {})  # noqa: S102
  assert started[0].dataset.seq_len == 64 and started[0].parallel.cp == 2
  assert (tmp_path / "runs" / "mine" / "run.yaml").is_file()
