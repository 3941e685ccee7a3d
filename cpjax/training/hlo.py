"""A compiled program's text, read: how often each part runs, what it computes and
moves, and which collectives overlap which work.

``compiled.cost_analysis()`` counts a loop's body once: a ring of 8 hops
(a ``fori_loop``), the loss's chunk scan and the experts' tile loop all show a
fraction of their work there. This module reads the compiled (scheduled)
program's text instead: every computation, how many times it runs in one
execution of the program (:meth:`Program.executions`, a ``while`` body times
its trip count), and from those the matmul FLOPs (``dot``, ``convolution``,
cuBLAS calls), the Pallas kernels' own cost estimates (what
:mod:`cpjax.attention.ring.kernels` passes XLA), the collectives' bytes, and each
asynchronous collective's start/done pair with what the schedule runs between
them (:meth:`Program.async_collectives`).

A loop whose trip count the text does not show counts once (its condition is
not ``counter < constant``); :attr:`Program.unknown_trips` names them.

>>> text = '''
... %body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
...   %p = (s32[], f32[8,8]) parameter(0)
...   %x = f32[8,8] get-tuple-element(%p), index=1
...   %d = f32[8,8] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   %i = s32[] get-tuple-element(%p), index=0
...   ROOT %t = (s32[], f32[8,8]) tuple(%i, %d)
... }
... %cond (p: (s32[], f32[8,8])) -> pred[] {
...   %p = (s32[], f32[8,8]) parameter(0)
...   %i = s32[] get-tuple-element(%p), index=0
...   %n = s32[] constant(5)
...   ROOT %lt = pred[] compare(%i, %n), direction=LT
... }
... ENTRY %main (a: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
...   %a = (s32[], f32[8,8]) parameter(0)
...   ROOT %w = (s32[], f32[8,8]) while(%a), condition=%cond, body=%body
... }
... '''
>>> program = Program.parse(text)
>>> program.executions()["body"], program.matmul_flops()   # 5 trips of 2 * 8**3
(5, 5120.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

__all__ = ["AsyncCollective", "Instruction", "Program", "shape_bytes", "COLLECTIVES"]

#: The collectives whose bytes and overlap a program is read for.
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-_]*)\((.*)$")
_CALLED = re.compile(
  r"\b(calls|body|condition|to_apply|branch_computations|called_computations)="
  r"(\{[^}]*\}|%?[\w.\-]+)"
)
_ARRAY = re.compile(
  r"(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64)\[([0-9,]*)\]"
)
# Custom calls that are work: Pallas' Mosaic and Triton kernels, cuBLAS and cuDNN.
_KERNEL = re.compile(r"tpu_custom_call|triton|cublas|cudnn")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "bf16": 16}
_BITS.update({"f16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64})


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split(",") if d)


def shape_bytes(type_text: str) -> int:
  """Bytes of every array in an HLO type (a tuple's elements summed).

  >>> shape_bytes("(bf16[2,4]{1,0}, f32[3]{0}, u32[])")
  32
  """
  bits = 0
  for dtype, dims in _ARRAY.findall(type_text):
    bits += math.prod(_dims(dims)) * _BITS.get(dtype, 8)
  return bits // 8


def _split_top(text: str) -> list[str]:
  """``text`` split at the commas outside any brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``name = type opcode(operands), attributes``."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str

  @classmethod
  def parse(cls, line: str) -> Instruction | None:
    """Read one line of a computation (None for a line that is no instruction)."""
    match = _INSTRUCTION.match(line)
    if match is None:
      return None
    name, type_text, opcode, rest = match.groups()
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        end = i
        break
    operands = tuple(
      re.findall(r"%([\w.\-]+)$", part)[0] if re.search(r"%[\w.\-]+$", part) else part
      for part in _split_top(rest[:end])
    )
    return cls(name, type_text, opcode, operands, rest[end + 1 :])

  def called(self) -> list[tuple[str, str]]:
    """Return (role, computation) of each computation this instruction calls."""
    out = []
    for role, names in _CALLED.findall(self.attributes):
      out += [(role, n.strip().lstrip("%")) for n in names.strip("{}").split(",") if n.strip()]
    return out

  @property
  def target(self) -> str:
    """A custom call's target ("" for other instructions)."""
    match = re.search(r'custom_call_target="([^"]+)"', self.attributes)
    return match.group(1) if match else ""

  def cost_estimate(self) -> dict[str, float]:
    """Return a Pallas call's own estimate ({} where it passed none)."""
    match = re.search(r'cost_estimate\\?":(\{[^}]*\})', self.attributes)
    if match is None:
      return {}
    fields = json.loads(match.group(1).replace('\\"', '"'))
    return {k: float(v) for k, v in fields.items()}


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
  """One collective's start/done pair and what the schedule runs between them.

  Attributes:
    kind: the collective (``"collective-permute"``, ...).
    computation: where it runs; ``executions`` how often a step.
    start, done: the two instructions' names.
    between: the work scheduled between them (:meth:`Program.works`: kernels,
      matmuls and the fusions that hold them).
    independent: the names of the work of the same computation that neither
      feeds the start nor depends on the done: what the pair could have held
      (found only when asked: :meth:`Program.async_collectives`).
    bytes: the collective's output bytes, once.
  """

  kind: str
  computation: str
  executions: int
  start: str
  done: str
  between: tuple[Instruction, ...]
  independent: tuple[str, ...]
  bytes: int


@dataclasses.dataclass
class Program:
  """A compiled program's computations, instructions in schedule order."""

  computations: dict[str, list[Instruction]]
  parameters: dict[str, dict[str, str]]  # computation -> {parameter: type}
  entry: str
  unknown_trips: list[str] = dataclasses.field(default_factory=list)
  _executions: dict[str, int] | None = dataclasses.field(default=None, repr=False)
  _work: dict[str, bool] = dataclasses.field(default_factory=dict, repr=False)
  _types: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def parse(cls, text: str) -> Program:
    """Read ``compiled.as_text()``."""
    computations: dict[str, list[Instruction]] = {}
    parameters: dict[str, dict[str, str]] = {}
    entry, current = "", None
    for line in text.splitlines():
      header = _HEADER.match(line)
      if header is not None:
        current = header.group(2)
        computations[current] = []
        parameters[current] = {}
        for part in _split_top(header.group(3)):
          name, _, type_text = part.partition(":")
          parameters[current][name.strip().lstrip("%")] = type_text.strip()
        if header.group(1):
          entry = current
        continue
      if current is not None:
        instruction = Instruction.parse(line)
        if instruction is not None:
          computations[current].append(instruction)
    if not entry:
      raise ValueError("the program text has no ENTRY computation")
    return cls(computations, parameters, entry)

  def types(self, computation: str) -> dict[str, str]:
    """Return {value name: type} of one computation's parameters and instructions."""
    if computation not in self._types:
      out = dict(self.parameters[computation])
      out.update((i.name, i.type) for i in self.computations[computation])
      self._types[computation] = out
    return self._types[computation]

  def trips(self, loop: Instruction) -> int | None:
    """Return a ``while``'s trip count: its known count, or ``counter < constant``."""
    known = re.search(r'known_trip_count\\?":\{\\?"n\\?":\\?"(\d+)', loop.attributes)
    if known:
      return int(known.group(1))
    condition = dict(loop.called()).get("condition")
    body = self.computations.get(condition, []) if condition is not None else []
    constants = {
      i.name: int(i.operands[0]) for i in body if i.opcode == "constant" and i.operands[0].isdigit()
    }
    root = body[-1] if body else None
    if root is not None and root.opcode == "compare" and "direction=LT" in root.attributes:
      return constants.get(root.operands[1])
    return None

  def executions(self) -> dict[str, int]:
    """Return {computation: times it runs in one execution of the entry}."""
    if self._executions is not None:
      return self._executions
    counts: dict[str, int] = {}

    def visit(name: str, times: int):
      counts[name] = counts.get(name, 0) + times
      for instruction in self.computations.get(name, []):
        called = instruction.called()
        trips = 1
        if instruction.opcode == "while":
          trips = self.trips(instruction)
          if trips is None:
            self.unknown_trips.append(instruction.name)
            trips = 1
        for role, callee in called:
          if callee in self.computations:
            visit(callee, times * (trips if role == "body" else 1))

    visit(self.entry, 1)
    self._executions = counts
    return counts

  def works(self, i: Instruction) -> bool:
    """Tell whether ``i`` is real work: a kernel or a matmul, or a fusion, loop or
    call that holds one."""
    if i.opcode in ("convolution", "dot") or (
      i.opcode == "custom-call" and _KERNEL.search(i.target)
    ):
      return True
    return any(self._holds_work(callee) for role, callee in i.called() if role != "condition")

  def _holds_work(self, computation: str) -> bool:
    if computation not in self._work:
      self._work[computation] = False  # (a computation is no call of its own)
      self._work[computation] = any(self.works(i) for i in self.computations.get(computation, []))
    return self._work[computation]

  def instructions(self) -> Iterator[tuple[str, int, Instruction]]:
    """Yield (computation, executions, instruction) of every instruction that runs."""
    for name, times in self.executions().items():
      for instruction in self.computations[name]:
        yield name, times, instruction

  def _matmul(self, computation: str, i: Instruction) -> float:
    """FLOPs of one matmul-like instruction (0 for others)."""
    is_gemm = i.opcode == "custom-call" and "cublas" in i.target
    out = _ARRAY.search(i.type) if i.opcode in ("dot", "convolution") or is_gemm else None
    if out is None:
      return 0.0
    out_size = math.prod(_dims(out.group(2)))
    types = self.types(computation)
    if i.opcode == "dot":
      lhs = _ARRAY.search(types.get(i.operands[0], ""))
      dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", i.attributes)
      if lhs is None or dims is None:
        return 0.0
      shape = _dims(lhs.group(2))
      return 2.0 * out_size * math.prod(shape[d] for d in _dims(dims.group(1)))
    if i.opcode == "convolution":
      rhs = _ARRAY.search(types.get(i.operands[1], ""))
      labels = re.search(r"dim_labels=\w+_(\w+)->", i.attributes)
      if rhs is None or labels is None:
        return 0.0
      shape = _dims(rhs.group(2))
      features_out = shape[labels.group(1).index("o")]
      return 2.0 * out_size * math.prod(shape) / features_out
    if is_gemm:
      lhs = _ARRAY.search(types.get(i.operands[0], ""))
      dims = re.search(r'lhs_contracting_dimensions\\?":\[([^\]]*)\]', i.attributes)
      if lhs is None or dims is None:
        return 0.0
      shape = _dims(lhs.group(2))
      contract = [int(d.strip('"\\ ')) for d in dims.group(1).split(",") if d.strip('"\\ ')]
      return 2.0 * out_size * math.prod(shape[d] for d in contract)
    return 0.0

  def matmul_flops(self) -> float:
    """Count the FLOPs of every matmul (``dot``, ``convolution``, cuBLAS) as often as it runs."""
    return sum(times * self._matmul(c, i) for c, times, i in self.instructions())

  def kernel_costs(self) -> dict[str, float]:
    """Sum the Pallas kernels' cost estimates, each as often as it runs:
    {"flops", "transcendentals", "bytes_accessed", "calls"}."""
    out = {"flops": 0.0, "transcendentals": 0.0, "bytes_accessed": 0.0, "calls": 0.0}
    for _, times, i in self.instructions():
      estimate = i.cost_estimate() if i.opcode == "custom-call" else {}
      if estimate:
        out["calls"] += times
        for key in ("flops", "transcendentals", "bytes_accessed"):
          out[key] += times * estimate.get(key, 0.0)
    return out

  def collective_bytes(self) -> dict[str, int]:
    """Count {kind: output bytes} of the collectives, as often as each runs (a
    start/done pair counted at its start)."""
    out: dict[str, int] = {}
    for _, times, i in self.instructions():
      kind = i.opcode.removesuffix("-start")
      if kind in COLLECTIVES and not i.opcode.endswith("-done"):
        size = _async_output(i) if i.opcode.endswith("-start") else shape_bytes(i.type)
        out[kind] = out.get(kind, 0) + times * size
    return out

  def async_collectives(self, *, independent: bool = False) -> list[AsyncCollective]:
    """List every collective, with what runs while it is in flight: between its
    start and done, or nothing (a synchronous one: ``start == done``).

    ``independent``: also find the work each could have held (a walk of the
    computation's dataflow per collective: seconds on a whole model's step);
    otherwise ``AsyncCollective.independent`` is left empty.
    """
    times = self.executions()
    found = []
    for name, body in self.computations.items():
      if name not in times:
        continue
      position = {i.name: n for n, i in enumerate(body)}
      users: dict[str, list[str]] = {}
      for i in body:
        for operand in i.operands:
          users.setdefault(operand, []).append(i.name)
      by_name = {i.name: i for i in body}
      for n, start in enumerate(body):
        kind = start.opcode.removesuffix("-start")
        if kind not in COLLECTIVES:
          continue
        done = start  # a synchronous collective: nothing can run beside it
        if start.opcode.endswith("-start"):
          done = next(
            (by_name[u] for u in users.get(start.name, []) if by_name[u].opcode == f"{kind}-done"),
            None,
          )
        if done is None:
          continue
        between = tuple(i for i in body[n + 1 : position[done.name]] if self.works(i))
        free: tuple[str, ...] = ()
        if independent:
          tied = _reach(start.name, by_name, lambda i: i.operands) | _reach(
            done.name, by_name, lambda i: users.get(i.name, [])
          )
          free = tuple(i.name for i in body if i.name not in tied and self.works(i))
        size = _async_output(start) if done is not start else shape_bytes(start.type)
        found.append(
          AsyncCollective(kind, name, times[name], start.name, done.name, between, free, size)
        )
    return found


def _reach(name: str, by_name: dict[str, Instruction], step) -> set[str]:
  """Names reachable from ``name`` (itself included) along ``step``."""
  seen, todo = {name}, [name]
  while todo:
    current = by_name.get(todo.pop())
    if current is None:
      continue
    for nxt in step(current):
      if nxt in by_name and nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def _async_output(start: Instruction) -> int:
  """Bytes an async collective's start delivers: its result, the tuple's
  second element for a (operands, results, ...) tuple type."""
  parts = _split_top(start.type[1:-1]) if start.type.startswith("(") else [start.type]
  return shape_bytes(parts[1] if len(parts) > 1 else parts[0])
