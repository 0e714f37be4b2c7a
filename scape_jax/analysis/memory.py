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
  'pinned_host'.
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


def offloaded_bytes(jaxpr: Any) -> int:
  """Bytes copied to host memory inside `jaxpr` (a Jaxpr or ClosedJaxpr).

  Inside `shard_map` the shapes are per device, so for a train step this is
  the host memory each device uses for offloaded values.
  """
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'device_put':
      for var, dest in zip(eqn.outvars, eqn.params['devices']):
        if dest == jax.memory.Space.Host:
          total += _aval_bytes(var.aval)
    for sub in _subjaxprs(eqn.params):
      total += offloaded_bytes(sub)
  return total


def host_argument_bytes(abstract_args: Any) -> int:
  """Per-device bytes of the arguments whose sharding is in 'pinned_host'."""
  total = 0
  for x in jax.tree.leaves(abstract_args):
    sharding = getattr(x, 'sharding', None)
    if sharding is not None and sharding.memory_kind == 'pinned_host':
      shard = sharding.shard_shape(tuple(x.shape))
      total += math.prod(shard) * np.dtype(x.dtype).itemsize
  return total
