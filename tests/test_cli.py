"""The command line: flags, errors, and `cpjax train` end to end."""

import importlib.util
import os
import subprocess
import sys

import pytest

from cpjax import cli
from tests.helpers import fake_slice_compiler

CHAT_JSONL = os.path.join(
  os.path.dirname(__file__), "..", "cpjax", "examples", "chat", "train.jsonl"
)


def _run(*args, timeout=600):
  return subprocess.run(
    [sys.executable, "-m", "cpjax", *args], capture_output=True, text=True, timeout=timeout
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (["train", "--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
    (["train", "--layout", "zigzag"], "argument --layout: invalid choice: 'zigzag'"),
    (["train", "--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["train", "--steps", "two"], "argument --steps: expected an integer >= 1, got 'two'"),
    (["train", "--seq-len", "16"], "--seq-len must be >= 32, got 16"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--num-processes", "2"], "--num-processes > 1 needs --coordinator-address"),
    (
      ["train", "--num-processes", "2", "--coordinator-address", "h:1", "--process-id", "2"],
      "--process-id must be in [0, 2), got 2",
    ),
    (
      ["train", "--num-processes", "3", "--coordinator-address", "h:1"],
      "the mesh's 8 devices must be a multiple of --num-processes 3",
    ),
    (
      ["train", "--auto-cluster", "--process-id", "0"],
      "--auto-cluster detects the cluster itself; it cannot be combined with --process-id",
    ),
    (
      ["train", "--auto-cluster", "--coordinator-address", "h:1", "--num-processes", "2"],
      "cannot be combined with --coordinator-address, --num-processes",
    ),
    (["train", "--cp", "16"], "--cp 16 needs 16 devices, found 8 CPU devices"),
    (
      ["train", "--model", "tiny", "--checkpoint", "x"],
      "--model and --checkpoint exclude each other",
    ),
    (["train", "--checkpoint", "/nonexistent"], "--checkpoint /nonexistent has no config.json"),
    (
      ["train", "--data", "/nonexistent.array_record"],
      "--data /nonexistent.array_record does not exist",
    ),
    (["train", "--model", "7b"], "argument --model: invalid choice: '7b'"),
    (["train", "--resume", "/tmp", "--state-dir", "/tmp"], "--resume DIR saves into DIR"),
    (["train", "--save-every", "5"], "--save-every needs --state-dir (or --resume)"),
    (["train", "--resume", "/nonexistent"], "--resume /nonexistent is not a directory"),
    (["train", "--mesh", "fsdp=2,cp=4", "--cp", "2"], "--mesh sets the cp size; do not add --cp"),
    (["train", "--mesh", "pp=2"], "expected comma-separated AXIS=SIZE with AXIS in"),
    (["train", "--mesh", "fsdp=0"], "axis 'fsdp' needs a positive integer size, got '0'"),
    (["train", "--mesh", "dp=2,fsdp=2"], "--mesh splits the batch over dp or fsdp, not both"),
    (["train", "--mesh", "fsdp=4,cp=4"], "--mesh needs 16 devices, found 8 CPU devices"),
    (["train", "--microbatches", "3"], "--microbatches 3 must divide --batch-size 2"),
    (["train", "--eval-every", "5"], "--eval-every needs --eval-data"),
    (
      ["train", "--eval-data", "/nonexistent.jsonl"],
      "--eval-data /nonexistent.jsonl does not exist",
    ),
    (["train", "--tokenizer", "/nonexistent"], "--tokenizer /nonexistent has no tokenizer.json"),
    (["train", "--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["train", "--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
    (["train", "--max-grad-norm", "0"], "argument --max-grad-norm: expected a number > 0"),
    (["plan", "--model", "e2b", "--seq-len", "1024"], "give --mesh, or --device-memory"),
    (
      ["plan", "--model", "e2b", "--seq-len", "1024", "--device-memory", "lots"],
      "device memory must look like 16GiB",
    ),
    (
      ["plan", "--checkpoint", "/nonexistent", "--seq-len", "1024", "--device-memory", "16GiB"],
      "--checkpoint /nonexistent has no config.json",
    ),
    (
      ["plan", "--model", "e2b", "--checkpoint", "x", "--seq-len", "8"],
      "argument --checkpoint: not allowed with argument --model",
    ),
    (
      ["plan", "--model", "tiny"],
      "give --seq-len (or a run config: --recipe, --config, --dataset.seq_len)",
    ),
    (["plan", "--recipe", "e2b-lora-64k"], "--recipe: no recipe 'e2b-lora-64k'; the recipes are"),
    (["plan", "--config", "/nonexistent.yaml"], "--config: "),
    (
      ["plan", "--model", "tiny", "--seq-len", "64", "--target", "tpu-8"],
      "--target: unknown target 'tpu-8': give v4-N, v5e-N, v5p-N, v6e-N",
    ),
    (
      ["plan", "--model", "tiny", "--seq-len", "64", "--target", "v5e-8", "--mesh", "cp=4"],
      "--mesh cp=4 has 4 devices, --target v5e-8 has 8 (v5e:2x4)",
    ),
    (
      ["plan", "--model", "tiny", "--seq-len", "64", "--target", "v5e", "--mesh", "cp=4"],
      "--target v5e searches its slices and their meshes; with --mesh name the slice (v5e-N)",
    ),
    (
      ["plan", "--model", "tiny", "--seq-len", "64", "--target", "h200-8", "--estimate-only"],
      "--target compiles; it does not go with --estimate-only",
    ),
    (
      ["plan", "--model", "tiny", "--seq-len", "64", "--mesh", "cp=8", "--dtype", "bfloat16"],
      "--dtype sets the activations of a --target compile; XLA:CPU compiles float32",
    ),
    # Found by the run before any training compute: still one line, exit 2.
    (
      ["train", "--mesh", "fsdp=2,cp=4", "--batch-size", "3", "--no-parity-check"],
      "mesh axis 'fsdp' of size 2 does not divide the batch size 3",
    ),
    (
      ["train", "--mesh", "fsdp=2,cp=4", "--dtype", "bfloat16"],
      "--dtype bfloat16 with mesh axes ['fsdp'] does not compile on the CPU",
    ),
    (
      ["train", "--lr-schedule", "cosine", "--warmup-steps", "20"],
      "--warmup-steps 20 must be >= 0, and below --steps 20 for a cosine schedule",
    ),
    (
      ["train", "--data", CHAT_JSONL, "--cp", "2", "--seq-len", "64"],
      f"--data {CHAT_JSONL} is JSONL: tokenizing it needs the checkpoint's tokenizer",
    ),
    # A published size on this machine: refused up front with the plan's estimate.
    (
      ["train", "--model", "e2b"],
      "cpjax train: error: e2b at --seq-len 1024 on mesh cp=8: 8 emulated CPU devices need about",
    ),
    (["train", "--model", "e2b"], "GiB per device), more than the "),
  ],
)
def test_bad_flags_one_line_exit_two(args, message, capsys, monkeypatch):
  # JAX is already up with 8 CPU devices in this process: keep it as it is.
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  with pytest.raises(SystemExit) as exc:
    cli.main(args)
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert message in err
  assert len(err.strip().splitlines()) == 1, err


def test_errors_during_training_are_crashes_not_usage_errors(monkeypatch):
  """A ValueError raised while training propagates (traceback, exit status 1)."""
  import cpjax.training.trainer

  def broken(run):
    raise ValueError("something inside the step")

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(cpjax.training.trainer, "train", broken)
  with pytest.raises(ValueError, match="something inside the step"):
    cli.main(["train", "--cp", "2", "--seq-len", "64"])


def train_help(capsys) -> str:
  with pytest.raises(SystemExit) as exc:
    cli.main(["train", "--help"])
  assert exc.value.code == 0
  return " ".join(capsys.readouterr().out.split())


def test_skip_memory_check_starts_training(monkeypatch):
  """With --skip-memory-check the e2b run that is otherwise refused reaches training."""
  import cpjax.training.trainer

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  started = []
  monkeypatch.setattr(cpjax.training.trainer, "train", lambda run, **kw: started.append(run))
  assert cli.main(["train", "--model", "e2b", "--skip-memory-check"]) == 0
  assert started and started[0].model == "e2b"


def test_demo_prints_each_ranks_part(capsys, monkeypatch):
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  assert cli.main(["demo", "--cp", "2", "--seq-len", "12"]) == 0
  out = capsys.readouterr().out
  # Rank 1's global positions, hand-worked: contiguous [6, 12); load-balanced
  # chunks 1 and 2 of four 3-token chunks.
  assert "1  [6, 7, 8, 9, 10, 11]" in out and "1  [3, 4, 5, 6, 7, 8]" in out
  # document_balanced (chunks of 3; documents 1..3 of 7, 2 and 2 tokens, then a
  # pad): as packed, rank 0 holds work 1+2+3 + 1+2 = 9 and rank 1 22 + 3 = 25;
  # in the order [3, 2, 1, pad] each holds 17. Shown: each token's row index.
  assert "0  [9, 10, 7, 5, 6, 11]" in out and "1  [8, 0, 1, 2, 3, 4]" in out
  assert out.count("unshard_batch restores the batch bit-exactly: True") == 3


def test_version(capsys):
  import cpjax

  with pytest.raises(SystemExit) as exc:
    cli.main(["--version"])
  assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"cpjax {cpjax.__version__}"


def test_plan_from_a_checkpoint_directory_reads_no_weight(capsys, monkeypatch, tmp_path):
  """The published E2B config.json alone (no safetensors) plans as the e2b preset."""
  import os
  import shutil

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  shutil.copy(
    os.path.join(
      os.path.dirname(__file__), "fixtures", "gemma4", "published", "e2b", "config.json"
    ),
    tmp_path / "config.json",
  )
  rows = []
  for what in (["--checkpoint", str(tmp_path)], ["--model", "e2b"]):
    assert (
      cli.main(
        [
          "plan",
          *what,
          "--seq-len",
          "32768",
          "--mesh",
          "fsdp=2,cp=2",
          "--remat",
          "full",
          "--estimate-only",
          "--device-memory",
          "95GB",
        ]
      )
      == 0
    )
    rows.append(
      [
        line.split("S=32768", 1)[1]
        for line in capsys.readouterr().out.splitlines()
        if "S=32768 " in line
      ]
    )
  assert rows[0] == rows[1] and len(rows[0]) == 2
  assert all("fits 88.5 GiB" in row for row in rows[0])  # 50.0 / 54.5 GiB per device


def test_help_does_not_claim_cpu_is_the_default(capsys):
  text = train_help(capsys)
  assert "TPU or GPU chips when JAX finds them" in text
  assert "only when that backend is the CPU" in text


def test_help_documents_every_flag(capsys):
  text = train_help(capsys)
  for flag in (
    "--seq-len",
    "--cp",
    "--layout",
    "--steps",
    "--seed",
    "--dtype",
    "--model",
    "--checkpoint",
    "--data",
    "--remat",
    "--save",
    "--state-dir",
    "--save-every",
    "--resume",
    "--force-resume",
    "--mesh",
    "--microbatches",
    "--tokenizer",
    "--truncate",
    "--eval-data",
    "--eval-every",
    "--eval-rows",
    "--metrics",
    "--tensorboard",
    "--images-per-row",
    "--lr-schedule",
    "--warmup-steps",
    "--max-grad-norm",
  ):
    assert flag in text


def test_a_corpus_outside_the_vocabulary_is_refused_before_any_compute():
  """The fixture model's vocabulary is 256 and the shipped corpus uses ids up
  to 511: a ValueError naming the id, before the model runs."""
  import os

  from cpjax.training.run_config import RunConfig, with_values
  from cpjax.training.trainer import train

  here = os.path.dirname(__file__)
  corpus = os.path.join(here, "data", "tiny_corpus.array_record")
  # The fixture model's vocabulary is 256 and the corpus uses ids up to 511:
  # a crash (exit status 1 from the command), found before any compute.
  with pytest.raises(
    ValueError,
    match=r"holds token id 5\d\d, outside the model's vocabulary "
    r"of 256",
  ):
    train(
      with_values(
        RunConfig(),
        {
          "checkpoint": os.path.join(here, "fixtures", "gemma4", "ple_kv_sharing"),
          "dataset.path": corpus,
          "dataset.seq_len": 64,
          "optimizer.steps": 2,
          "parallel.cp": 2,
        },
      ),
      log=lambda *a: None,
    )


# `make soak`: every part of it runs in CI elsewhere (the corpus: test_checkpointing's
# resume; --remat --dtype bfloat16 with cp: test_lora_peft's README commands;
# --save then from_pretrained: test_docs' own-data commands; python -m
# cpjax: test_plan's), and the vocabulary check just above.
@pytest.mark.slow
def test_fine_tune_a_checkpoint_on_the_shipped_corpus_and_save_it(tmp_path):
  """``python -m cpjax train`` end to end: --checkpoint + --data + --remat +
  --dtype bfloat16 + --save; the saved model loads."""
  import os

  from cpjax.models import gemma4

  here = os.path.dirname(__file__)
  corpus = os.path.join(here, "data", "tiny_corpus.array_record")
  proc = _run(
    "train",
    "--model",
    "tiny",
    "--data",
    corpus,
    "--remat",
    "--save",
    str(tmp_path / "out"),
    "--seq-len",
    "64",
    "--steps",
    "2",
    "--cp",
    "2",
    "--dtype",
    "bfloat16",
  )
  assert proc.returncode == 0, proc.stderr
  assert "parity with the single-device model at step 1" in proc.stdout + proc.stderr
  assert "loss " in proc.stdout and "->" in proc.stdout
  saved = gemma4.Gemma4.from_pretrained(tmp_path / "out")
  assert saved.cfg == gemma4.Gemma4Config.preset("tiny")


def test_the_cpu_is_chosen_only_where_no_accelerator_is(monkeypatch):
  """With libtpu or the CUDA plugin installed on a machine without chips,
  cpjax's commands start JAX on the CPU (no plugin start-up errors); a TPU or
  GPU device node, or the user's own JAX_PLATFORMS, leaves the choice to JAX."""
  from cpjax.cli import machine
  from cpjax.training import targets

  for nodes, given, want in (
    ([], None, "cpu"),
    (["/dev/accel0"], None, None),
    (["/dev/nvidia0"], None, None),
    ([], "tpu", "tpu"),
  ):
    monkeypatch.setattr(
      targets.glob,
      "glob",
      lambda pattern, nodes=nodes: [
        n for n in nodes if n.startswith(pattern.split("*")[0].split("[")[0])
      ],
    )
    if given is None:
      monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
      monkeypatch.setenv("JAX_PLATFORMS", given)
    machine.cpu_unless_accelerators()
    assert os.environ.get("JAX_PLATFORMS") == want, (nodes, given)


@pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None
  and importlib.util.find_spec("jax_cuda12_plugin") is None,
  reason="without libtpu or the CUDA plugin there is no start-up noise to stop",
)
def test_a_command_prints_no_plugin_start_up_errors_on_a_machine_without_chips():
  """The command's modules import jax before it chooses the CPU: the choice
  must reach jax's flag, not only the environment (``make run`` printed the
  CUDA plugin's cuInit traceback and libtpu's warnings)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run(
    [sys.executable, "-c", "import sys; from cpjax.cli import main; sys.exit(main(sys.argv[1:]))"]
    + ["demo", "--cp", "2", "--seq-len", "8"],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  assert "document ids" in proc.stdout
  for noise in ("plugin configuration error", "cuInit", "TPU", "libtpu"):
    assert noise not in proc.stderr, proc.stderr


def test_plan_for_a_bare_chip_searches_its_slices_and_writes_the_smallest(
  capsys, monkeypatch, tmp_path
):
  """``--target v5e`` on a recipe: the target search (tests/test_plan.py)
  with a compiler replaced by a table, each compile printed; the recipe's
  mesh is replaced by the smallest slice's, and --write-config writes it
  with the compiler's figure beside the closed form's."""
  from cpjax.training import plan
  from cpjax.training.run_file import read_run_config

  totals = {"v5e-4": 17 * plan.GiB, "v5e-8": 12 * plan.GiB}

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  fake_slice_compiler(monkeypatch, totals)
  path = tmp_path / "plan.yaml"
  argv = ["plan", "--recipe", "e2b-lora-128k", "--target", "v5e", "--write-config", str(path)]
  assert cli.main(argv) in (0, None)
  out = capsys.readouterr().out
  assert "searching the slices of v5e (16 GiB a device)" in out, out
  lines = [line for line in out.splitlines() if " v5e-" in line and "params" in line]
  assert len(lines) == 2, out
  assert "cp=4" in lines[0] and "does NOT fit 16 GiB" in lines[0], out
  assert "cp=8" in lines[1] and "  fits 16 GiB" in lines[1], out
  assert "smallest: v5e-8 (2 compiled in" in out, out
  run = read_run_config(path)
  assert (run.parallel.mesh, run.dtype, run.lora.rank) == ("cp=8", "bfloat16", 16)
  assert "# compiled by v5e-8's compiler: 12 GiB per device, fits" in path.read_text()


def test_plan_prints_the_strategies_of_the_runs_layout(capsys, monkeypatch):
  """The rule's choice depends on the layout (E2B at S = 1024 on cp = 8, sliding
  layers: Ulysses on load-balanced stripes, the window's halo on contiguous
  chunks): cpjax plan prints the run's, as it plans with them (it printed
  load_balanced's for any run)."""
  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  for layout, sliding in (("load_balanced", "ulysses"), ("contiguous", "all_gather")):
    argv = "plan --model e2b --seq-len 1024 --mesh cp=8 --estimate-only --parallel.layout"
    assert cli.main([*argv.split(), layout]) == 0
    out = capsys.readouterr().out
    assert f"  cp strategy for sliding_attention: {sliding} (" in out, (layout, out)


def test_plan_for_a_sized_slice_with_expert_parallel_folds_ep_onto_its_cp(capsys, monkeypatch):
  """``--target v5e-4 --expert-parallel`` plans cp over the 4 chips with ep
  folded onto it, as the slice search folds it (it was refused, asking for
  the --mesh the user had not given); a cp that does not divide the experts
  is refused naming both."""
  from cpjax.training import plan

  meshes = []

  def compiled_plan(cfg, shape, *, target, model, device_memory=None, **settings):
    shape = plan.StepShape.take(shape, settings)
    meshes.append(shape.mesh)
    return plan.Plan(
      model, shape.seq_len, shape.mesh, shape.remat, shape.dtype, 0, 0, 1, 1, 0.0, target.name
    )

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(plan, "compiled_plan", compiled_plan)
  argv = "plan --model tiny-moe --seq-len 256 --expert-parallel --target".split()
  assert cli.main([*argv, "v5e-4"]) in (0, None)
  assert meshes == [{"cp": 4, "ep": 4}], meshes
  assert "cp=4,ep=4" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main([*argv, "v5e-8"])
  want = "--target v5e-8's cp=8, which does not divide the 4 experts; give --mesh with ep"
  assert want in capsys.readouterr().err


@pytest.mark.parametrize("target, platform", [("h200-8", "cuda"), ("v5e-8", "tpu")])
def test_plan_target_follows_the_gpu_compiler(target, platform, capsys, monkeypatch):
  """With --target the printed closed form is that compiler's: XLA:GPU's on
  H200s (more than XLA:TPU's), XLA:TPU's on a v5e. (The compile itself is
  tested in tests/test_plan.py; here it is replaced by the estimate.)"""
  from cpjax.models.gemma4 import Gemma4Config
  from cpjax.training import cp_strategy, plan

  monkeypatch.setattr(cli.machine, "use_cpu_devices", lambda *a, **k: None)
  monkeypatch.setattr(
    plan,
    "compiled_plan",
    lambda cfg, shape, *, target, **kw: plan.estimate(cfg, shape, **kw),
  )
  cli.main(["plan", "--model", "e2b", "--seq-len", "131072", "--target", target])
  out = capsys.readouterr().out
  # The rule's choice per layer kind (tests/test_cp_strategy.py), and why.
  want = "  cp strategy for full_attention: ulysses (8 query / 1 K/V heads of dim 512: the fewest"
  assert want in out, out
  assert "  cp strategy for sliding_attention: all_gather (window 512: a halo" in out, out
  cfg = Gemma4Config.preset("e2b")
  # The closed form of what it compiles: the rule's strategies, the loss's auto.
  choices = cp_strategy.choose(cfg.text, seq_len=131072, cp=8)
  auto = dict(strategy=cp_strategy.as_strategy(choices), loss_strategy="auto")
  shape = dict(model="e2b", seq_len=131072, mesh={"cp": 8}, **auto)
  for dtype in ("bfloat16", "float32"):
    want = {p: plan.estimate(cfg, **shape, dtype=dtype, platform=p) for p in plan.PLATFORMS}
    assert want["cuda"].total > want["tpu"].total
    assert f"  {want[platform].row()} [{dtype} activations]" in out, out
