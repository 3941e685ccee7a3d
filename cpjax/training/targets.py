"""Chips to compile for without having them: TPU slices and NVIDIA GPUs by name.

A :class:`Target` names an accelerator as a user rents it (Cloud TPU's
accelerator types ``v4-8``, ``v5litepod-8`` / ``v5e-8``, ``v5p-16``,
``v6e-8``, or an explicit topology ``v5e:2x4``; GPUs ``h100-8``, ``h200-8``,
``h200-2x8`` for hosts x GPUs) and makes its compile-only devices
(:func:`Target.devices`): XLA:TPU with Mosaic (libtpu) or XLA:GPU with
ptxas (jax's CUDA plugin) compile for them on any machine, CPU-only ones
included. No array can live on such a device: programs are compiled from
``jax.ShapeDtypeStruct`` s, and ``memory_analysis()`` is the real
compiler's per-device memory.

Cloud TPU's names count TensorCores on v4 and v5p (two a chip, one JAX
device: ``v4-8`` is 4 chips) and chips on v5e and v6e (``v5e-8`` is 8).

>>> t = parse_target("v5litepod-8")
>>> t.chip.name, t.topology, t.num_devices, t.chip.memory // 2**30
('v5e', 'v5e:2x4', 8, 16)
>>> parse_target("v5p-16").topology, parse_target("h200-2x8").topology
('v5p:2x2x2', '1x2x8')
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import re

__all__ = [
  "ALIASES",
  "CHIPS",
  "Chip",
  "Target",
  "collective_bytes",
  "has_device_nodes",
  "parse_target",
]

GiB = 2**30

# What libtpu reads of the host it is loaded on. Off a TPU VM it finds none of
# it: it logs that it could not tell the accelerator type or the workers'
# hostnames, and it takes /tmp/libtpu_lockfile, meant to keep two processes off
# the same chips, so a second process compiling for a TPU at the same time fails
# ("Internal error when accessing libtpu multi-process lockfile"). Compiling for
# a topology touches no chip: a host without TPU device nodes says so.
_NO_TPU_HOST = {
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  "TPU_HOST_BOUNDS": "1,1,1",
  "TPU_WORKER_HOSTNAMES": "localhost",
}


# The device nodes of the chips JAX's plugins drive: TPU VMs (/dev/accel*, or
# VFIO groups on v5e and later) and NVIDIA GPUs.
_DEVICE_NODES = {
  "tpu": ("/dev/accel*", "/dev/vfio/[0-9]*"),
  "cuda": ("/dev/nvidia[0-9]*",),
}


def has_device_nodes(platform: str | None = None) -> bool:
  """Tell whether this host has device nodes of a ``platform``'s chips (any chip's when None).

  >>> has_device_nodes("tpu") in (True, False)
  True
  """
  platforms = _DEVICE_NODES if platform is None else (platform,)
  return any(glob.glob(p) for name in platforms for p in _DEVICE_NODES[name])


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip as its compiler sees it.

  Attributes:
    name: the short name (``"v5e"``, ``"h200"``).
    platform: ``"tpu"`` or ``"cuda"``.
    memory: bytes of memory of one JAX device (the chip's HBM).
    kind: the ``device_kind`` its compile-only devices report.
    cores_per_chip: TensorCores a chip counts for in Cloud TPU's accelerator
      name (``v4-8``: 8 cores, 4 chips); 1 where the name counts chips.
    mesh_dims: 2 (v5e, v6e: a 2-D torus) or 3 (v4, v5p); 0 for GPUs.
    chip_config: libtpu's chip configuration (``"megacore"``: one device a chip).
    host: chips one host holds along each topology dimension, in a slice of
      more than one host.
    single_host: the most chips a slice of one host holds (v5e-8 and v6e-8
      are one host of 2 x 4 chips; their larger slices are hosts of 2 x 2).
    gpu: for GPUs, ``(SMs, compute capability major, minor, shared memory per
      block opt-in, per SM)``: what XLA:GPU and ptxas need of the chip.
    first_slices: the devices of the smallest slices it is rented in; from
      the last one on every power of two is (v4 and v5p slices start at 4
      chips; v5e and v6e are rented as 1 chip or 4 and up, never 2).
    peak_flops: bfloat16 dense FLOP/s of one device (None: not known).
    hbm_bandwidth: its HBM's bytes/s.
    link_bandwidth: its interconnect's bytes/s, both directions (TPUs' ICI,
      GPUs' NVLink).
    figures: where the three figures come from.
  """

  name: str
  platform: str
  memory: int
  kind: str
  cores_per_chip: int = 1
  mesh_dims: int = 0
  chip_config: str = "default"
  host: tuple[int, ...] = ()
  single_host: int = 0
  gpu: tuple[int, ...] = ()
  first_slices: tuple[int, ...] = (1, 2)
  peak_flops: float | None = None
  hbm_bandwidth: float | None = None
  link_bandwidth: float | None = None
  figures: str = ""

  def missing_figures(self) -> list[str]:
    """Return the names of the speed figures this chip lacks.

    >>> CHIPS["v5e"].missing_figures(), CHIPS["v4"].missing_figures()
    ([], ['link_bandwidth'])
    """
    return [
      name
      for name in ("peak_flops", "hbm_bandwidth", "link_bandwidth")
      if getattr(self, name) is None
    ]

  def slices(self, max_devices: int = 4096) -> list[Target]:
    """Return the slices of this chip one can rent, fewest devices first.

    :attr:`first_slices`, then powers of two: a TPU's as Cloud TPU
    names them (``v5p-8`` is 4 chips), a GPU's as one host of up to 8 and
    then hosts of 8 (``h200-2x8``).

    Args:
      max_devices: the most devices a slice may have.

    Returns:
      The :class:`Target` of each slice.

    >>> [t.name for t in CHIPS["v5e"].slices(16)]
    ['v5e-1', 'v5e-4', 'v5e-8', 'v5e-16']
    >>> [t.name for t in CHIPS["v5p"].slices(8)], [t.name for t in CHIPS["h200"].slices(16)]
    (['v5p-8', 'v5p-16'], ['h200-1', 'h200-2', 'h200-4', 'h200-8', 'h200-2x8'])
    """
    counts = list(self.first_slices)
    while counts[-1] * 2 <= max_devices:
      counts.append(counts[-1] * 2)
    if self.platform == "cuda":
      names = [f"{self.name}-{n}" if n <= 8 else f"{self.name}-{n // 8}x8" for n in counts]
    else:
      names = [f"{self.name}-{n * self.cores_per_chip}" for n in counts]
    return [parse_target(name) for n, name in zip(counts, names) if n <= max_devices]

  def target_config(self) -> str:
    """Return XLA's ``GpuTargetConfigProto`` of this GPU, in protobuf text format."""
    sms, major, minor, smem_optin, smem_sm = self.gpu
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {smem_optin}
  shared_memory_per_core: {smem_sm}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  device_memory_size: {self.memory}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
    feature_extension: ACCELERATED_FEATURES
  }}
  device_vendor: "NVIDIA Corporation"
  device_address_bits: 64
  name: "{self.kind}"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
}}
device_description_str: "{self.kind}"
"""


# Memory per device: Cloud TPU's HBM per chip (v4 and v5p as one megacore
# device), and the GPUs' device memory as their drivers report it. Speed
# figures (bfloat16 dense peak, HBM and interconnect bandwidth a chip) from
# the vendors' pages: Cloud TPU's system architecture pages, NVIDIA's H100
# and H200 data sheets (SXM; 989 TFLOP/s without sparsity, NVLink 900 GB/s).
# v4's interconnect has no figure here: its step time is refused, naming it.
_TPU_PAGES = "Cloud TPU system architecture pages"
_NVIDIA = "NVIDIA's data sheet (SXM)"
CHIPS = {
  "v4": Chip(
    "v4",
    "tpu",
    32 * GiB,
    "TPU v4",
    cores_per_chip=2,
    mesh_dims=3,
    chip_config="megacore",
    host=(2, 2, 1),
    first_slices=(4,),
    peak_flops=275e12,
    hbm_bandwidth=1200e9,
    figures=_TPU_PAGES,
  ),
  "v5e": Chip(
    "v5e",
    "tpu",
    16 * GiB,
    "TPU v5 lite",
    mesh_dims=2,
    host=(2, 2, 1),
    single_host=8,
    first_slices=(1, 4),
    peak_flops=197e12,
    hbm_bandwidth=819e9,
    link_bandwidth=400e9,
    figures=_TPU_PAGES,
  ),
  "v5p": Chip(
    "v5p",
    "tpu",
    95 * GiB,
    "TPU v5",
    cores_per_chip=2,
    mesh_dims=3,
    host=(2, 2, 1),
    first_slices=(4,),
    peak_flops=459e12,
    hbm_bandwidth=2765e9,
    link_bandwidth=1200e9,
    figures=_TPU_PAGES,
  ),
  "v6e": Chip(
    "v6e",
    "tpu",
    32 * GiB,
    "TPU v6 lite",
    mesh_dims=2,
    host=(2, 2, 1),
    single_host=8,
    first_slices=(1, 4),
    peak_flops=918e12,
    hbm_bandwidth=1638e9,
    link_bandwidth=800e9,
    figures=_TPU_PAGES,
  ),
  "h100": Chip(
    "h100",
    "cuda",
    84942979072,
    "NVIDIA H100 80GB HBM3",
    gpu=(132, 9, 0, 232448, 233472),
    peak_flops=989e12,
    hbm_bandwidth=3.35e12,
    link_bandwidth=900e9,
    figures=_NVIDIA,
  ),
  "h200": Chip(
    "h200",
    "cuda",
    151397597184,
    "NVIDIA H200 141GB HBM3e",
    gpu=(132, 9, 0, 232448, 233472),
    peak_flops=989e12,
    hbm_bandwidth=4.8e12,
    link_bandwidth=900e9,
    figures=_NVIDIA,
  ),
}
#: Other names of chips (Cloud TPU calls the v5e "v5litepod").
ALIASES = {"v5litepod": "v5e"}
#: The module each platform's compiler comes in, and the extras that install it.
_EXTRAS = {
  "tpu": ("libtpu", "'cpjax[tpu]'"),
  "cuda": ("jax_cuda12_plugin", "'cpjax[cuda]' (or 'cpjax[cuda-compiler]' to compile only)"),
}


def _torus(chips: int, dims: int) -> tuple[int, ...]:
  """The most nearly cubic power-of-two shape of ``chips``, small sides first
  (8 chips: 2x4 on a 2-D torus, 2x2x2 on a 3-D one; 4 on 3-D: 2x2x1)."""
  shape = [1] * dims
  for _ in range(int(math.log2(chips))):
    i = min(range(dims), key=lambda d: (shape[d], d))
    shape[i] *= 2
  shape = sorted(shape)
  return tuple(shape[1:] + shape[:1]) if dims == 3 and shape[0] == 1 else tuple(shape)


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice of ``chip`` s: ``topology`` is libtpu's (``"v5e:2x4"``) or the
  CUDA plugin's (``"1x1x8"``: slices x hosts x GPUs)."""

  name: str
  chip: Chip
  topology: str
  num_devices: int

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(int(n) for n in self.topology.split(":")[-1].split("x"))

  @property
  def host_bounds(self) -> tuple[int, ...]:
    """The chips one host of this TPU slice holds along each topology dimension.

    >>> parse_target("v5e-8").host_bounds, parse_target("v5e-16").host_bounds
    ((2, 4, 1), (2, 2, 1))
    >>> parse_target("v5p-16").host_bounds
    (2, 2, 1)
    """
    shape = self.shape + (1,) * (3 - len(self.shape))
    if self.num_devices <= self.chip.single_host:
      return shape
    return tuple(min(h, s) for h, s in zip(self.chip.host, shape))

  def devices(self) -> list:
    """Return the target's compile-only JAX devices (libtpu or the CUDA plugin needed)."""
    module, extra = _EXTRAS[self.chip.platform]
    if importlib.util.find_spec(module) is None:
      raise ImportError(
        f"compiling for {self.name} needs {module}: pip install {extra}, which installs it "
        "at jax's version"
      )
    from jax.experimental import topologies

    if self.chip.platform == "tpu":
      if not has_device_nodes("tpu"):
        for key, value in _NO_TPU_HOST.items():
          os.environ.setdefault(key, value)
      topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=self.topology,
        chip_config_name=self.chip.chip_config,
        chips_per_host_bounds=self.host_bounds,
        num_slices=1,
      )
    else:
      topo = topologies.get_topology_desc(
        platform="cuda", topology=self.topology, target_config=self.chip.target_config()
      )
    devices = list(topo.devices)
    if len(devices) != self.num_devices:  # (libtpu's own count, should it differ)
      raise ValueError(
        f"{self.name}: the {self.topology} topology has {len(devices)} devices, "
        f"expected {self.num_devices}"
      )
    return devices


def known_targets() -> str:
  """Describe the names :func:`parse_target` takes, for error messages and ``--help``."""
  tpus = ", ".join(f"{c.name}-N" for c in CHIPS.values() if c.platform == "tpu")
  gpus = ", ".join(f"{c.name}-N or {c.name}-HxN" for c in CHIPS.values() if c.platform == "cuda")
  return (
    f"{tpus} (Cloud TPU's accelerator types; v5litepod-N too), a topology such as "
    f"v5e:2x4 or v5p:2x2x2, or {gpus} (H hosts of N GPUs)"
  )


def parse_target(text: str) -> Target:
  """Parse the :class:`Target` that ``text`` names (see the module docstring).

  Args:
    text: the target's name.

  Returns:
    The :class:`Target`.

  >>> parse_target("v4-8").num_devices, parse_target("v5e:4x4").num_devices
  (4, 16)
  >>> parse_target("tpu-8")
  Traceback (most recent call last):
  ...
  ValueError: unknown target 'tpu-8': give v4-N, v5e-N, v5p-N, v6e-N (...), ...
  """
  if not isinstance(text, str):
    raise TypeError(f"target must be a str such as 'v5e-8', got {type(text).__name__}")
  name = text.strip().lower()
  match = re.fullmatch(r"([a-z0-9]+)(?::((?:\d+x)*\d+)|-(?:(\d+)x)?(\d+))", name)
  chip = CHIPS.get(ALIASES.get(match.group(1), match.group(1))) if match else None
  if match is None or chip is None:
    raise ValueError(f"unknown target {text!r}: give {known_targets()}")
  topology, hosts, count = match.group(2), match.group(3), match.group(4)
  if chip.platform == "cuda":
    if topology is not None:
      raise ValueError(
        f"target {text!r}: a GPU target is {chip.name}-N or {chip.name}-HxN "
        f"(H hosts of N GPUs), not a topology"
      )
    hosts, gpus = int(hosts or 1), int(count)
    if hosts < 1 or gpus < 1:
      raise ValueError(f"target {text!r} needs at least one host of one GPU")
    return Target(text, chip, f"1x{hosts}x{gpus}", hosts * gpus)
  if topology is not None:
    shape = tuple(int(n) for n in topology.split("x"))
    if len(shape) != chip.mesh_dims or min(shape) < 1:
      raise ValueError(
        f"target {text!r}: a {chip.name} topology has {chip.mesh_dims} "
        f"positive sides (such as {chip.name}:{'x'.join(['2'] * chip.mesh_dims)})"
        f", got {topology!r}"
      )
    return Target(text, chip, f"{chip.name}:{topology}", math.prod(shape))
  if hosts is not None:
    raise ValueError(f"target {text!r}: a TPU slice is {chip.name}-N, not hosts x chips")
  cores = int(count)
  chips, rest = divmod(cores, chip.cores_per_chip)
  if rest or chips < 1 or chips & (chips - 1):
    per = "TensorCores (two a chip)" if chip.cores_per_chip == 2 else "chips"
    raise ValueError(
      f"target {text!r}: {chip.name}-N counts {per}; N must give a power of two "
      f"of chips, got {cores}"
    )
  shape = _torus(chips, chip.mesh_dims)
  return Target(text, chip, f"{chip.name}:{'x'.join(map(str, shape))}", chips)


# ------------------------------------------- what a compiled program moves
_COLLECTIVE = re.compile(
  r"= (\(?[a-z0-9]+\[[^=]*?) (all-gather|reduce-scatter|all-reduce|"
  r"collective-permute|all-to-all)(?:-start)?\("
)
_SHAPE = re.compile(r"(pred|s8|u8|s32|u32|f32|bf16|f16|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "bf16": 2,
  "f16": 2,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}


def collective_bytes(hlo: str) -> dict[str, int]:
  """Count the output bytes of the collectives in a compiled program's text.

  Per device; a loop body counted once.

  Args:
    hlo: the compiled program's text.

  Returns:
    {kind: output bytes}.

  >>> collective_bytes("%x = f32[4,8]{1,0} all-gather(f32[1,8] %y), dimensions={0}")
  {'all-gather': 128}
  """
  out: dict[str, int] = {}
  for shapes, kind in _COLLECTIVE.findall(hlo):
    for dtype, dims in _SHAPE.findall(shapes):
      size = math.prod(int(d) for d in dims.split(",") if d)
      out[kind] = out.get(kind, 0) + size * _BYTES[dtype]
  return out
