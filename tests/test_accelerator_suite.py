"""The prepared chip suite (``benchmarks/accelerator.py``) runs here as it will on a
lent GPU: every part tiny, the GPU kernels in Pallas' interpreter, its JSON
written part by part."""

import json

import pytest

from benchmarks import accelerator


def test_the_suite_runs_every_part_tiny(tmp_path):
  out = tmp_path / "accelerator.json"
  assert accelerator.main(["--smoke", "--sweep", "--chip", "h100", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  parts = result["parts"]
  assert list(parts) == ["check", "sweep", "hops", "step"]
  check = parts["check"]
  assert {r["D"] for r in check} == {128, 256, 512}
  assert {r["dtype"] for r in check} == {"float32", "bfloat16"}
  assert all(r["ok"] is True for r in check), check
  for r in check:  # the interpreted kernels against the float32 reference
    bound = 1e-5 if r["dtype"] == "float32" else 3e-2
    assert max(r[n] for n in ("out", "dq", "dk", "dv")) < bound, r
  assert parts["sweep"] and all(r["ms"] > 0 and "error" not in r for r in parts["sweep"])
  for r in parts["hops"]:
    assert r["pallas ms"] > 0 and r["xla ms"] > 0, r
    assert not [k for k in r if k.endswith("error")], r
  # jax.nn's attention has no document mask: no vendor cell there.
  docs = next(r for r in parts["hops"] if r["case"] == "8 documents")
  assert docs["vendor"].startswith("n/a") and "vendor ms" not in docs
  (step,) = parts["step"]
  assert "error" not in step, step
  assert (step["model"], step["S"], step["training"], step["figures of"]) == (
    "tiny, 2 layers",
    256,
    "LoRA r=4",
    "h100",
  )
  assert step["tokens/s"] == pytest.approx(256 / (step["step ms"] / 1e3))
  assert step["compiled GiB"] > 0 and step["plan ms"] > 0 and 0 < step["MFU"] < 1
  assert step["measured / plan"] == pytest.approx(step["step ms"] / step["plan ms"])


def test_a_kernel_miss_ends_the_run_after_the_check(tmp_path, monkeypatch, capsys):
  """Nothing is timed on kernels that give wrong values."""
  miss = {"case": "causal", "D": 128, "dtype": "float32", "out": 1.0, "dq": 1.0}
  monkeypatch.setattr(
    accelerator, "check_one", lambda *a, **k: {**miss, "dk": 1.0, "dv": 1.0, "ok": False}
  )
  out = tmp_path / "accelerator.json"
  assert accelerator.main(["--smoke", "--out", str(out)]) == 1
  assert list(json.loads(out.read_text())["parts"]) == ["check"]
  assert "the kernels differ from the dense reference" in capsys.readouterr().err


def test_without_an_accelerator_it_says_so_and_points_to_smoke(capsys):
  with pytest.raises(SystemExit) as exit_:
    accelerator.main([])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "no accelerator here (JAX's devices are 'cpu')" in err and "--smoke" in err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--parts", "check,speed"], "--parts takes check, sweep, hops, step, got speed"),
    (["--e2b-layers", "0"], "--repeats and --e2b-layers must be >= 1, got 5 and 0"),
  ],
)
def test_bad_settings_are_refused_before_anything_runs(argv, message, capsys):
  with pytest.raises(SystemExit):
    accelerator.main(["--smoke", *argv])
  assert message in capsys.readouterr().err
