"""Host-memory bytes of a program, read from its jaxpr and its arguments.

A compiled program's `memory_analysis()` has host fields, but XLA's CPU
compiler lowers device<->host copies inside jit to nothing (on the CPU the
device memory is host memory), so on this backend they read 0 and the
offloaded values are counted as device temporaries. These functions give the
host bytes a GPU/TPU program would hold, from what the program asks for:

* `offloaded_bytes`: values the program copies to host memory
  (`device_put` to `MemorySpace.Host`, e.g. by a `jax.checkpoint` offload
  policy), summed over the jaxpr; a loop body is counted once, since its
  copies live for one iteration;
* `host_argument_bytes`: per-device bytes of arguments placed in memory kind
  'pinned_host';
* `argument_bytes_by_kind`: per-device bytes of arguments per memory kind,
  from their shardings (what a GPU/TPU program holds where, whatever the CPU
  compiler makes of it).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def _subjaxprs(params: dict):
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if hasattr(item, 'eqns'):
        yield item
      elif hasattr(item, 'jaxpr') and hasattr(item.jaxpr, 'eqns'):
        yield item.jaxpr


def _aval_bytes(aval) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def offloaded_bytes(jaxpr: Any, skip_outputs: bool = True) -> int:
  """Bytes copied to host memory inside `jaxpr` (a Jaxpr or ClosedJaxpr).

  Inside `shard_map` the shapes are per device, so for a train step this is
  the host memory each device uses for offloaded values. With
  `skip_outputs`, copies that are outputs of the program (state returned to
  host memory, e.g. SCAPE's offloaded residual) are left out: a donated
  step's outputs alias its inputs, already counted as host arguments.
  """
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  return _offloaded(jaxpr, [skip_outputs] * len(jaxpr.outvars))


_PASS_THROUGH = ('pjit', 'jit', 'shard_map', 'closed_call', 'core_call')


def _offloaded(jaxpr, is_output: list) -> int:
  """`offloaded_bytes` of a jaxpr whose outvars flagged in `is_output` are
  outputs of the whole program."""
  outputs = {id(v) for v, flag in zip(jaxpr.outvars, is_output) if flag}
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'device_put':
      for var, dest in zip(eqn.outvars, eqn.params['devices']):
        if dest == jax.memory.Space.Host and id(var) not in outputs:
          total += _aval_bytes(var.aval)
    through = eqn.primitive.name in _PASS_THROUGH
    for sub in _subjaxprs(eqn.params):
      flags = ([id(v) in outputs for v in eqn.outvars] if through else
               [False] * len(sub.outvars))
      total += _offloaded(sub, flags)
  return total


def host_argument_bytes(abstract_args: Any) -> int:
  """Per-device bytes of the arguments whose sharding is in 'pinned_host'."""
  return argument_bytes_by_kind(abstract_args).get('pinned_host', 0)


def argument_bytes_by_kind(abstract_args: Any) -> dict:
  """{memory kind: per-device bytes} of arrays with shardings.

  A leaf's bytes are those of its shard on one device; a sharding without a
  memory kind, or no sharding, counts as 'device'.
  """
  totals = {}
  for x in jax.tree.leaves(abstract_args):
    sharding = getattr(x, 'sharding', None)
    shape = tuple(x.shape)
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    kind = getattr(sharding, 'memory_kind', None) or 'device'
    totals[kind] = totals.get(kind, 0) + (
        math.prod(shape) * np.dtype(x.dtype).itemsize)
  return totals
