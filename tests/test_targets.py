"""Target names: Cloud TPU's accelerator types and GPU slices, as a user rents them."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from cpjax.training import targets
from cpjax.training.targets import CHIPS, parse_target


@pytest.mark.parametrize(
  "name, chip, topology, devices",
  [
    # v4 and v5p count TensorCores (two a chip, one megacore device).
    ("v4-8", "v4", "v4:2x2x1", 4),
    ("v4-16", "v4", "v4:2x2x2", 8),
    ("v5p-8", "v5p", "v5p:2x2x1", 4),
    ("v5p-16", "v5p", "v5p:2x2x2", 8),
    ("v5p-128", "v5p", "v5p:4x4x4", 64),
    # v5e and v6e count chips.
    ("v5litepod-1", "v5e", "v5e:1x1", 1),
    ("v5e-4", "v5e", "v5e:2x2", 4),
    ("V5E-8", "v5e", "v5e:2x4", 8),
    ("v5e-256", "v5e", "v5e:16x16", 256),
    ("v6e-8", "v6e", "v6e:2x4", 8),
    ("v6e-32", "v6e", "v6e:4x8", 32),
    ("v5e:4x8", "v5e", "v5e:4x8", 32),
    ("v5p:2x2x4", "v5p", "v5p:2x2x4", 16),
    # GPUs: slices x hosts x GPUs per host.
    ("h100-8", "h100", "1x1x8", 8),
    ("h200-8", "h200", "1x1x8", 8),
    ("h200-2x8", "h200", "1x2x8", 16),
  ],
)
def test_accelerator_names_give_their_topology(name, chip, topology, devices):
  target = parse_target(name)
  assert (target.chip.name, target.topology, target.num_devices) == (chip, topology, devices)
  assert target.name == name


def test_chip_memory_is_the_devices_own():
  """The fit is judged against these: Cloud TPU's HBM per chip, the GPUs' driver-reported
  device memory (H100 80 GB is 79.1 GiB, H200 141 GiB)."""
  gib = {name: chip.memory / 2**30 for name, chip in CHIPS.items()}
  assert gib["v4"] == 32 and gib["v5e"] == 16 and gib["v5p"] == 95 and gib["v6e"] == 32
  assert gib["h100"] == pytest.approx(79.1, abs=0.05)
  assert gib["h200"] == pytest.approx(141.0, abs=0.05)


@pytest.mark.parametrize(
  "name, match",
  [
    ("tpu-8", r"unknown target 'tpu-8': give v4-N, v5e-N, v5p-N, v6e-N .* h200-HxN"),
    ("v5e", r"unknown target 'v5e'"),
    ("v5e-6", r"v5e-N counts chips; N must give a power of two of chips, got 6"),
    ("v4-6", r"v4-N counts TensorCores \(two a chip\); .* got 6"),
    ("v5p-3", r"counts TensorCores"),
    ("v5e:2x2x2", r"a v5e topology has 2 positive sides \(such as v5e:2x2\), got '2x2x2'"),
    ("v5p:2x4", r"a v5p topology has 3 positive sides"),
    ("v5e-2x4", r"a TPU slice is v5e-N, not hosts x chips"),
    ("h200:2x4", r"a GPU target is h200-N or h200-HxN"),
    ("h100-0", r"at least one host of one GPU"),
  ],
)
def test_unknown_or_malformed_targets_are_value_errors(name, match):
  with pytest.raises(ValueError, match=match):
    parse_target(name)


def test_a_target_must_be_a_string():
  with pytest.raises(TypeError, match="target must be a str such as 'v5e-8', got int"):
    parse_target(8)


@pytest.mark.parametrize(
  "name, module, extra",
  [("v5e-8", "libtpu", "'cpjax[tpu]'"), ("h200-8", "jax_cuda12_plugin", "'cpjax[cuda-compiler]'")],
)
def test_a_target_without_its_compiler_names_the_extra_that_installs_it(
  monkeypatch, name, module, extra
):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda m, *a: None if m == module else find_spec(m, *a)
  )
  with pytest.raises(ImportError, match=f"{name} needs {module}: pip install .*{re.escape(extra)}"):
    parse_target(name).devices()


# Hosts a slice is rented as (Cloud TPU's TPU VM pages): v5e and v6e slices
# of up to 8 chips are one host (ct5lp-hightpu-8t, ct6e-standard-8t), larger
# ones hosts of 4 chips; v5p hosts hold 4 chips (v5p-8 is 4 chips, one host).
HOSTS = {
  "v5e-4": 1,
  "v5e-8": 1,
  "v5e-16": 4,
  "v5e-64": 16,
  "v6e-8": 1,
  "v6e-32": 8,
  "v5p-8": 1,
  "v5p-16": 2,
  "v5p-64": 8,
}


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_a_slice_is_the_hosts_cloud_tpu_rents(name):
  target = parse_target(name)
  chips_a_host = math.prod(target.host_bounds)
  assert target.num_devices // chips_a_host == HOSTS[name]
  if importlib.util.find_spec("libtpu") is not None:  # libtpu lays its processes out so too
    assert len({d.process_index for d in target.devices()}) == HOSTS[name]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_two_processes_compile_for_tpus_at_once_without_libtpu_start_up_noise():
  """Off a TPU VM, libtpu's lock on the chips (a second loader failed with
  "Internal error when accessing libtpu multi-process lockfile") and its
  warnings about the host it cannot find do not reach a target's devices."""
  env = {k: v for k, v in os.environ.items() if k not in targets._NO_TPU_HOST}
  env["JAX_PLATFORMS"] = "cpu"
  holder = subprocess.Popen(
    [sys.executable, "-c", _HOLD_LIBTPU], stdout=subprocess.PIPE, text=True, env=env
  )
  try:
    assert holder.stdout.readline().strip() == "loaded"  # libtpu loaded the plain way
    proc = subprocess.run(
      [
        sys.executable,
        "-c",
        "from cpjax.training import targets as t\nprint(len(t.parse_target('v5e-4').devices()))",
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
    )
  finally:
    holder.kill()
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split()[-1] == "4"
  for noise in ("lockfile", "accelerator type", "TPU_WORKER_HOSTNAMES", "E0000"):
    assert noise not in proc.stderr, proc.stderr


_COMPILE_FOR_H200 = """
import jax, jax.numpy as jnp
from cpjax.training import targets
mesh = jax.sharding.Mesh(targets.parse_target("h200-8").devices(), ("x",))
x = jax.ShapeDtypeStruct((64, 128), jnp.float32,
                         sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
print(jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile().memory_analysis() is not None)
"""


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None, reason="needs cuda")
def test_compiling_for_gpus_prints_no_cuda_start_up_noise():
  """Without CUDA's runtime library the plugin's stub said "Could not find
  cuda drivers on your machine" at each load: `cuda-compiler` brings the
  runtime (10 MB) so that a GPU target's compile is quiet."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", _COMPILE_FOR_H200], capture_output=True, text=True, env=env, timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split()[-1] == "True"
  for noise in ("cuda drivers", "cudart", "cuInit", "E0000"):
    assert noise not in proc.stderr, proc.stderr


_HOLD_LIBTPU = """
import time
from jax.experimental import topologies
topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                             chip_config_name="default", chips_per_host_bounds=(1, 1, 1),
                             num_slices=1)
print("loaded", flush=True)
time.sleep(300)
"""
