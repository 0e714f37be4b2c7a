"""Bytes on the wire, read from the compiled program.

Compiles a jitted function, reads the optimized (post-SPMD-partitioning) HLO
text and lists every collective with its dtype, per-device element count,
replica-group size N and the number of times it executes per call. The bytes
each device sends are then derived from the standard ring algorithms:

  all-reduce          2 (N-1)/N * S   (S = the reduced buffer)
  all-gather            (N-1)/N * S   (S = the gathered output buffer)
  reduce-scatter        (N-1)/N * S   (S = the input buffer)
  all-to-all            (N-1)/N * S
  collective-permute            S

Collectives inside `while` bodies are multiplied by the trip count XLA
recorded (`known_trip_count`), through nested loops. When that is missing, or
a collective sits in a `conditional` branch, its count is `None`: it is listed
with a note, left out of the totals, and `format_table` says the total is
incomplete. So is a collective of a kind not priced here (`UNPRICED`, e.g.
`send`): nothing is guessed. The one branch counted is the train step's
update: a conditional traced directly under the name scope `TAKEN_SCOPE`
(`train.step`), which runs unless the step is skipped; its branches count
once, so the bytes are an applied step's (a conditional nested inside it
stays unknown).

A collective the compiler widened is priced at the width the program asked
for: XLA:CPU moves a bf16 collective as f32, with converts around it (and,
for a reduction, its reduction computation renamed `*_promoted`), where a
GPU or TPU sends the bf16 values. Such a row keeps the narrow dtype and
says so in its note.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable

import jax
import numpy as np

from scape_jax.analysis import cost

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
         'collective-permute')

_DTYPE_BYTES = {
    'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'bf16': 2, 'f16': 2,
    's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
    'c128': 16, 's4': 0.5, 'u4': 0.5, 'f4e2m1fn': 0.5, 's2': 0.25, 'u2': 0.25,
}

# Collective opcodes listed with an unknown count (left out of the totals).
UNPRICED = ('collective-broadcast', 'ragged-all-to-all', 'send', 'recv')

NOTE_TRIP_UNKNOWN = 'trip count unknown'
NOTE_IN_BRANCH = 'in conditional branch'
# The `jax.named_scope` of the train step's update branch (module doc).
TAKEN_SCOPE = 'apply_if_finite'
NOTE_UNREACHABLE = 'not reachable from ENTRY'
NOTE_UNPRICED = 'collective kind not priced'
NOTE_WIDENED = 'widened to {wide} by the compiler, priced as sent'


def dtype_bytes(dtype: str) -> float:
  """Bytes per element of an HLO primitive type ('f32', 'bf16', ...)."""
  if dtype in _DTYPE_BYTES:
    return _DTYPE_BYTES[dtype]
  if dtype.startswith('f8'):
    return 1
  raise ValueError(f'unknown HLO dtype {dtype!r}')


# Bytes one device sends for one execution, by kind, from (S bytes, N).
_RING = {
    'all-reduce': cost.ring_all_reduce_bytes,
    'all-gather': cost.ring_all_gather_bytes,
    'reduce-scatter': cost.ring_reduce_scatter_bytes,
    'all-to-all': cost.ring_reduce_scatter_bytes,  # Same (N-1)/N * S volume.
    'collective-permute': lambda s, n: 0.0 if n <= 1 else float(s),
}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program (per-device view)."""
  kind: str  # One of KINDS (or UNPRICED, with count None).
  dtype: str  # HLO dtype, e.g. 'f32', 'bf16'.
  elements: int  # Per-device element count of the buffer S (see module doc).
  group_size: int  # N, devices per replica group.
  count: int | None  # Executions per call; None = could not be determined.
  name: str  # HLO instruction name.
  note: str = ''
  # The device ids of each replica group (ids index the program's devices,
  # i.e. the mesh in row-major order; a collective-permute's (source,
  # target) pairs); None when the HLO does not say.
  groups: tuple[tuple[int, ...], ...] | None = None
  op_name: str = ''  # JAX's metadata op_name (its transformation path).

  @property
  def bytes(self) -> int:
    """Size of the buffer S in bytes."""
    return int(math.ceil(self.elements * dtype_bytes(self.dtype)))

  @property
  def bytes_sent(self) -> float:
    """Bytes each device sends per call (0 if the count is unknown)."""
    if self.count is None:
      return 0.0
    return _RING[self.kind](self.bytes, self.group_size) * self.count


def bytes_sent(cols: list[Collective]) -> float:
  """Total bytes sent per device per call, over rows with a known count.

  Rows with `count=None` are excluded; check `any(c.count is None ...)` (or use
  `format_table`) to know whether the total is complete.
  """
  return float(sum(c.bytes_sent for c in cols if c.count is not None))


_COMMENT_RE = re.compile(r'/\*.*?\*/')
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_HEADER_RE = re.compile(
    r'^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$')
_INSTR_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_OPCODE_RE = re.compile(r'\s*([\w\-]+)\(')
_LEAF_RE = re.compile(r'\b([a-z][a-z0-9]*)\[([^\]]*)\]')
_TRIP_RE = re.compile(r'known_trip_count\W+n\W+(\d+)')
_CALL_RE = re.compile(
    r'\b(calls|to_apply|body|condition|branch_computations|true_computation|'
    r'false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)')
_IOTA_RE = re.compile(r'\[([\d,\s]+)\]<=\[[\d,\s]+\](?:T\([\d,\s]+\))?')
_PAIR_RE = re.compile(r'\{\s*(\d+)\s*,\s*(\d+)\s*\}')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]  # Raw operand texts ('%x' or 'f32[8] %x').
  attrs: str  # Attribute text with quoted strings blanked out.
  trip: int | None  # known_trip_count (while only).
  op_name: str = ''  # metadata op_name, if any.
  root: bool = False  # the ROOT of its computation


def _close(s: str, i: int) -> int:
  """Index just past the bracket group opening at s[i]."""
  closing = {'(': ')', '{': '}', '[': ']'}
  stack = []
  for j in range(i, len(s)):
    if s[j] in closing:
      stack.append(closing[s[j]])
    elif stack and s[j] == stack[-1]:
      stack.pop()
      if not stack:
        return j + 1
  return len(s)


def _split_top(s: str) -> list[str]:
  """Splits `s` at commas outside brackets."""
  out, depth, start = [], 0, 0
  for j, ch in enumerate(s):
    if ch in '({[':
      depth += 1
    elif ch in ')}]':
      depth -= 1
    elif ch == ',' and depth == 0:
      out.append(s[start:j])
      start = j + 1
  out.append(s[start:])
  return [p.strip() for p in out if p.strip()]


def _leaves(shape: str) -> list[tuple[str, int]]:
  """(dtype, elements) of every array in an HLO shape string."""
  return [(dtype, math.prod(int(d.strip().lstrip('<=')) for d in
                            dims.split(',') if d.strip()))
          for dtype, dims in _LEAF_RE.findall(shape)]


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR_RE.match(line)
  if not m:
    return None
  trip = _TRIP_RE.search(line)
  rest = _STRING_RE.sub('""', _COMMENT_RE.sub('', m.group(2)))
  if rest.startswith('('):
    end = _close(rest, 0)
  else:
    end = len(rest.split(None, 1)[0]) if rest.strip() else 0
  shape, rest = rest[:end], rest[end:]
  op = _OPCODE_RE.match(rest)
  if not op:
    return None
  open_paren = op.end() - 1
  end = _close(rest, open_paren)
  op_name = _OP_NAME_RE.search(m.group(2))
  return _Instr(m.group(1), shape, op.group(1),
                _split_top(rest[open_paren + 1:end - 1]), rest[end:],
                int(trip.group(1)) if trip else None,
                op_name.group(1) if op_name else '',
                line.lstrip().startswith('ROOT'))


def _operand_name(text: str) -> str:
  """The instruction an operand text names ('%x' or 'f32[8] %x': 'x')."""
  return text.rsplit(None, 1)[-1].lstrip('%')


def _attr_value(attrs: str, key: str) -> str | None:
  """Raw value of `key=` in an attribute string (bracket-balanced)."""
  m = re.search(r'\b' + re.escape(key) + r'=', attrs)
  if not m:
    return None
  i = m.end()
  if i < len(attrs) and attrs[i] in '{[(':
    end = _close(attrs, i)
    if attrs[i] == '[':  # Iota form: [2,4]<=[8]T(1,0).
      im = _IOTA_RE.match(attrs, i)
      end = im.end() if im else end
    return attrs[i:end]
  if attrs.startswith('mesh', i) or attrs.startswith('maximal_mesh', i):
    brace = attrs.find('{', i)
    return attrs[i:_close(attrs, brace)] if brace >= 0 else attrs[i:]
  return attrs[i:].split(',', 1)[0]


def _mesh_group_size(value: str) -> int:
  """Group size of `mesh['a'=2,'b'=4] {'b'}` (sub-axes: 'a':(1)2)."""
  if value.startswith('maximal_mesh'):
    return 1
  sizes = dict(re.findall(r"'?([^'=,\s\[\]]+)'?\s*=\s*(\d+)",
                          value[value.find('[') + 1:value.find(']')]))
  axes = value[value.rfind('{') + 1:value.rfind('}')]
  n = 1
  for ax in _split_top(axes):
    sub = re.match(r"'?([^':]+)'?\s*:\s*\(\d+\)(\d+)", ax)
    n *= int(sub.group(2)) if sub else int(sizes[ax.strip("' ")])
  return n


def _group_size(ins: _Instr, base: str, num_devices: int) -> tuple[int, str]:
  """(N, note) for a collective instruction."""
  if base == 'collective-permute':
    pairs = _PAIR_RE.findall(
        _attr_value(ins.attrs, 'source_target_pairs') or '')
    devices = {d for a, b in pairs if a != b for d in (a, b)}
    return max(len(devices), 1), ''  # Self-pairs only: nothing moves.
  value = _attr_value(ins.attrs, 'replica_groups')
  if value is None or re.fullmatch(r'\{\s*\}', value):
    return num_devices, ''
  if value.startswith('['):
    return [int(d) for d in _IOTA_RE.match(value).group(1).split(',')][-1], ''
  if value.startswith(('mesh', 'maximal_mesh')):
    return _mesh_group_size(value), ''
  sizes = [len([x for x in g.split(',') if x.strip()])
           for g in re.findall(r'\{([\d,\s]*)\}', value[1:-1])]
  if not sizes:
    return num_devices, ''
  note = '' if len(set(sizes)) == 1 else 'non-uniform groups, max size used'
  return max(sizes), note


def _permute_pairs(ins: _Instr) -> tuple[tuple[int, int], ...]:
  """A collective-permute's (source, target) pairs that move data."""
  return tuple((int(a), int(b)) for a, b in _PAIR_RE.findall(
      _attr_value(ins.attrs, 'source_target_pairs') or '') if a != b)


def _iota_groups(value: str) -> tuple[tuple[int, ...], ...]:
  """`[G,N]<=[d0,d1,...]T(p0,p1,...)`: iota(d).transpose(p).reshape(G, N)."""
  m = re.match(r'\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?',
               value)
  out, dims = ([int(d) for d in g.split(',')] for g in m.group(1, 2))
  perm = [int(d) for d in m.group(3).split(',')] if m.group(3) else None
  ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm)
  return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, out[-1]))


def _mesh_groups(value: str) -> tuple[tuple[int, ...], ...] | None:
  """Groups of `mesh['a'=2,'b'=4] {'b'}`: devices varying over the listed
  axes (row-major device ids); None for sub-axes and maximal meshes."""
  if value.startswith('maximal_mesh') or ':(' in value:
    return None
  sizes = [(k, int(v)) for k, v in re.findall(
      r"'?([^'=,\s\[\]]+)'?\s*=\s*(\d+)",
      value[value.find('[') + 1:value.find(']')])]
  listed = {a.strip("' ") for a in _split_top(
      value[value.rfind('{') + 1:value.rfind('}')])}
  names = [k for k, _ in sizes]
  strides = {k: math.prod(v for _, v in sizes[i + 1:])
             for i, (k, _) in enumerate(sizes)}
  groups = {}
  for flat in range(math.prod(v for _, v in sizes)):
    key = tuple((flat // strides[k]) % dict(sizes)[k] for k in names
                if k not in listed)
    groups.setdefault(key, []).append(flat)
  return tuple(tuple(g) for g in groups.values())


def replica_groups(ins_attrs: str, num_devices: int
                   ) -> tuple[tuple[int, ...], ...] | None:
  """The replica groups of a collective's attribute text, as device ids."""
  value = _attr_value(ins_attrs, 'replica_groups')
  if value is None or re.fullmatch(r'\{\s*\}', value):
    return (tuple(range(num_devices)),)
  if value.startswith('['):
    return _iota_groups(value)
  if value.startswith(('mesh', 'maximal_mesh')):
    return _mesh_groups(value)
  return tuple(tuple(int(x) for x in g.split(',') if x.strip())
               for g in re.findall(r'\{([\d,\s]*)\}', value[1:-1]))


class _Module:
  """Computations, instructions and the call graph of an HLO module."""

  def __init__(self, hlo_text: str):
    self.comps: dict[str, list[_Instr]] = {}
    self.entry: str | None = None
    current = None
    for line in hlo_text.splitlines():
      h = _HEADER_RE.match(line)
      if h and not line.lstrip().startswith('HloModule'):
        current = h.group(2)
        self.comps[current] = []
        if h.group(1):
          self.entry = current
        continue
      ins = _parse_instr(line)
      if ins is not None:
        if current is None:  # Bare instruction list: one implicit ENTRY.
          current = self.entry = '__entry__'
          self.comps[current] = []
        self.comps[current].append(ins)
    self.shapes = {i.name: i.shape for c in self.comps.values() for i in c}
    self.instrs = {i.name: i for c in self.comps.values() for i in c}
    self.users = collections.defaultdict(list)  # name -> instructions
    for c in self.comps.values():
      for i in c:
        for text in i.operands:
          self.users[_operand_name(text)].append(i)
    self._counts: dict[str, tuple[int | None, frozenset[str]]] = {}
    # callee -> [(caller, edge kind, trip count)]
    self.callers = collections.defaultdict(list)
    for comp, instrs in self.comps.items():
      for ins in instrs:
        if ins.opcode in ('async-update', 'async-done'):
          continue  # The computation is counted once, at async-start.
        for key, val in _CALL_RE.findall(ins.attrs):
          for callee in re.findall(r'%?([\w.\-]+)', val):
            if key == 'body':
              edge = ('loop', ins.trip)
            elif key == 'condition':
              edge = ('loop', None if ins.trip is None else ins.trip + 1)
            elif key in ('branch_computations', 'true_computation',
                         'false_computation'):
              taken = ins.op_name.split('/')[-2:-1] == [TAKEN_SCOPE]
              edge = ('call', 1) if taken else ('branch', None)
            else:
              edge = ('call', 1)
            self.callers[callee].append((comp,) + edge)

  def count(self, comp: str) -> tuple[int | None, frozenset[str]]:
    """Executions of `comp` per program call, and why it may be unknown."""
    if comp == self.entry:
      return 1, frozenset()
    if comp in self._counts:
      return self._counts[comp]
    if not self.callers.get(comp):
      if self.entry is None:  # No ENTRY marker: treat roots as entries.
        return 1, frozenset()
      return None, frozenset({NOTE_UNREACHABLE})
    total, notes = 0, set()
    for caller, kind, trip in self.callers[comp]:
      c, n = self.count(caller)
      notes |= n
      if kind == 'branch':
        c = None
        notes.add(NOTE_IN_BRANCH)
      elif kind == 'loop':
        if trip is None:
          c = None
          notes.add(NOTE_TRIP_UNKNOWN)
        elif c is not None:
          c *= trip
      total = None if total is None or c is None else total + c
    self._counts[comp] = total, frozenset(notes)
    return self._counts[comp]

  def operand_leaves(self, ins: _Instr) -> list[tuple[str, int]] | None:
    """Leaves of all operands, or None if any operand's shape is unknown."""
    out = []
    for text in ins.operands:
      parts = text.rsplit(None, 1)
      shape = parts[0] if len(parts) == 2 else self.shapes.get(
          parts[-1].lstrip('%'))
      if shape is None:
        return None
      out.extend(_leaves(shape))
    return out


def _buffer(base: str, is_start: bool, mod: _Module, ins: _Instr,
            n: int) -> list[tuple[str, int]]:
  """(dtype, elements) of the buffer S the ring formula refers to."""
  ops = mod.operand_leaves(ins)
  if ops is not None:
    if base == 'collective-permute' and 'slice_sizes=' in ins.attrs:
      ops = mod.operand_leaves(dataclasses.replace(
          ins, operands=ins.operands[:1])) or ops  # In-place: input only.
    return [(d, e * n if base == 'all-gather' else e) for d, e in ops]
  res = _leaves(ins.shape)
  if is_start and base == 'all-gather':  # (operands, outputs).
    return res[len(res) // 2:]
  if is_start and base == 'collective-permute':  # (in, out, ctx...).
    return res[:1]
  return [(d, e * n if base == 'reduce-scatter' else e) for d, e in res]


def _called(mod: _Module, ins: _Instr) -> list[_Instr]:
  """The body of a fusion's computation ([] for any other instruction)."""
  callee = re.search(r'calls=%?([\w.\-]+)', ins.attrs)
  return mod.comps.get(callee.group(1), []) if (
      ins.opcode == 'fusion' and callee) else []


def _dtype_of(mod: _Module, operand: str) -> str | None:
  leaves = _leaves(mod.shapes.get(_operand_name(operand), operand))
  return leaves[0][0] if len(leaves) == 1 else None


# Instructions that move values without changing them.
_MOVES = ('copy', 'bitcast', 'reshape', 'transpose')


def _converted_from(mod: _Module, ins: _Instr | None) -> str | None:
  """The dtype that `ins` (or a fusion's root) converts from, through
  instructions that only move the values; None if it is no convert."""
  if ins is not None and ins.opcode == 'fusion':
    body = {i.name: i for i in _called(mod, ins)}
    ins = next((i for i in body.values() if i.root), None)
    while ins is not None and ins.opcode in _MOVES and ins.operands:
      ins = body.get(_operand_name(ins.operands[0]))
  if ins is None or ins.opcode != 'convert' or len(ins.operands) != 1:
    return None
  return _dtype_of(mod, ins.operands[0])


# What XLA's all-reduce promotion widens each type to, inverted: the type a
# `*_promoted` reduction of this type was widened from.
_PROMOTED_FROM = {'f32': 'bf16', 's32': 's16', 'u32': 'u16'}


def _widened_from(mod: _Module, ins: _Instr, base: str, dtype: str
                  ) -> list[str | None]:
  """Per operand of a collective, the dtype the compiler widened it from to
  `dtype`, or None.

  XLA:CPU moves bf16 collectives as f32. A reduction (all-reduce,
  reduce-scatter) then reduces with a computation renamed `*_promoted`: its
  operands are priced at the narrow type (the one each was converted from,
  else `_PROMOTED_FROM`); a program that reduces in f32 on purpose has no
  such computation. Another kind is taken as widened when its one operand
  is a convert from a narrower float: the compiled program no longer tells
  that from a program that converts to f32 itself before it gathers (none
  here does), and such a program is priced at the narrow type too.
  """
  before = [_converted_from(mod, mod.instrs.get(_operand_name(t)))
            for t in ins.operands]
  if base in ('all-reduce', 'reduce-scatter'):
    if not (_attr_value(ins.attrs, 'to_apply') or '').endswith('_promoted'):
      return [None] * len(ins.operands)
    return [b if b is not None and dtype_bytes(b) < dtype_bytes(dtype)
            else _PROMOTED_FROM.get(dtype) for b in before]
  narrow = before[0] if len(before) == 1 else None
  if (narrow is None or not narrow.startswith(('bf', 'f')) or
      dtype_bytes(narrow) >= dtype_bytes(dtype)):
    return [None] * len(ins.operands)
  return [narrow]


def _header_num_devices(hlo_text: str) -> int:
  head = hlo_text.split('\n', 1)[0]
  return math.prod(int(v) for v in re.findall(
      r'\b(?:num_partitions|replica_count)=(\d+)', head))


def collectives_from_hlo(hlo_text: str,
                         num_devices: int | None = None) -> list[Collective]:
  """Lists the collectives of an (optimized, per-device) HLO module text.

  Args:
    hlo_text: HLO text, e.g. `jitted.lower(...).compile().as_text()`.
    num_devices: devices of the program, the group size for empty
      `replica_groups={}`; read from the module header when None.

  Returns:
    One row per collective instruction (per dtype, for a combined op whose
    operands have different dtypes), in program text order. `-done` halves of
    async pairs are skipped; `-start` halves are counted.
  """
  if num_devices is None:
    num_devices = _header_num_devices(hlo_text)
  mod = _Module(hlo_text)
  rows = []
  for comp, instrs in mod.comps.items():
    for ins in instrs:
      is_start = ins.opcode.endswith('-start')
      base = ins.opcode[:-len('-start')] if is_start else ins.opcode
      if base in UNPRICED:  # listed with its first array, count unknown
        arrays = [(d, e) for d, e in (mod.operand_leaves(ins) or
                                      _leaves(ins.shape))
                  if d in _DTYPE_BYTES or d.startswith('f8')] or [('u8', 0)]
        rows.append(Collective(base, *arrays[0], num_devices, None, ins.name,
                               NOTE_UNPRICED, None, ins.op_name))
        continue
      if base not in KINDS:
        continue
      n, group_note = _group_size(ins, base, num_devices)
      groups = (_permute_pairs(ins) if base == 'collective-permute' else
                replica_groups(ins.attrs, num_devices))
      count, count_notes = mod.count(comp)
      notes = sorted(count_notes) + ([group_note] if group_note else [])
      buffer = _buffer(base, is_start, mod, ins, n)
      narrow = (_widened_from(mod, ins, base, buffer[0][0])
                if len(buffer) == len(ins.operands) and not is_start and
                len({d for d, _ in buffer}) == 1 else [None] * len(buffer))
      if any(narrow):
        notes.append(NOTE_WIDENED.format(wide=buffer[0][0]))
      per_dtype: dict[str, int] = {}
      for (dtype, elements), was in zip(buffer, narrow):
        dtype = was or dtype
        per_dtype[dtype] = per_dtype.get(dtype, 0) + elements
      note = '; '.join(notes)
      for dtype, elements in per_dtype.items():
        rows.append(Collective(base, dtype, elements, n, count, ins.name,
                               note, groups, ins.op_name))
  return rows


def collectives(fn: Callable[..., Any], *args, **kwargs) -> list[Collective]:
  """Compiles `fn` for `args` (arrays or `jax.ShapeDtypeStruct`s) and lists
  its collectives. `fn` may be jitted already; otherwise it is jitted."""
  jitted = fn if hasattr(fn, 'lower') else jax.jit(fn)
  text = jitted.lower(*args, **kwargs).compile().as_text()
  return collectives_from_hlo(text, _header_num_devices(text))


def format_table(cols: list[Collective]) -> str:
  """Aligned text table (MB = 1e6 bytes) with a total line."""
  head = ('kind', 'dtype', 'elements', 'N', 'count', 'MB', 'MB sent', 'name',
          'note')
  body = [(c.kind, c.dtype, str(c.elements), str(c.group_size),
           '?' if c.count is None else str(c.count), f'{c.bytes / 1e6:.6f}',
           '?' if c.count is None else f'{c.bytes_sent / 1e6:.6f}', c.name,
           c.note) for c in cols]
  widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
  numeric = {2, 3, 4, 5, 6}

  def fmt(row):
    return '  '.join(v.rjust(w) if i in numeric else v.ljust(w)
                     for i, (v, w) in enumerate(zip(row, widths))).rstrip()

  lines = [fmt(head), fmt(['-' * w for w in widths])] + [fmt(r) for r in body]
  unknown = sum(c.count is None for c in cols)
  total = (f'total sent per device per call: {bytes_sent(cols) / 1e6:.6f} MB '
           f'({len(cols)} collectives)' + (
               f'  INCOMPLETE: {unknown} collective(s) with unknown count '
               'excluded' if unknown else ''))
  return '\n'.join(lines + [total])
