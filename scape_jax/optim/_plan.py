"""Which leaves of a tree SCAPE compresses, and their chunk layouts."""

import dataclasses
from typing import Any, Optional, Sequence

import jax
import numpy as np

from scape_jax.comm import masks
from scape_jax.optim._common import MaskOrFn


@dataclasses.dataclass(frozen=True)
class CompressionPlan:
  """Which leaves are compressed, and their static chunk layouts.

  `layouts[j]` is the `LeafLayout` of leaf j, or None for a dense leaf.
  """
  treedef: Any
  shapes: tuple
  layouts: tuple
  num_workers: int

  @classmethod
  def create(cls, params, compress: MaskOrFn,
             num_workers: int) -> 'CompressionPlan':
    leaves, treedef = jax.tree.flatten(params)
    if compress is None:
      flags = [p.ndim >= 2 and p.size > 0 for p in leaves]
    else:
      tree = compress(params) if callable(compress) else compress
      try:
        flags = treedef.flatten_up_to(tree)
      except (ValueError, TypeError) as e:
        raise ValueError(
            'scape: the compress tree does not match the params: expected a '
            f'tree of bools with structure {treedef}, got '
            f'{jax.tree.structure(tree)}.') from e
    layouts = []
    for p, flag in zip(leaves, flags):
      if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(
            f'scape: compress entries must be bools, got {flag!r}.')
      if bool(flag) and p.ndim == 0:
        raise ValueError('scape: a scalar leaf cannot be compressed; mark it '
                         'False in compress.')
      if bool(flag) and p.size == 0:
        raise ValueError(f'scape: a leaf of shape {p.shape} has no elements '
                         'to compress; mark it False in compress.')
      layouts.append(masks.LeafLayout.create(p.size, num_workers, p.shape)
                     if bool(flag) else None)
    return cls(treedef, tuple(p.shape for p in leaves), tuple(layouts),
               num_workers)

  def k_per_level(self, j: int, levels: Sequence[float]) -> tuple:
    """Entries per chunk of leaf j at each density level."""
    return tuple(masks.chunk_k(d, self.layouts[j].chunk_size) for d in levels)

  def is_sparse(self, j: int, k: Optional[int]) -> bool:
    """Whether leaf j sends a compacted payload at k entries per chunk."""
    layout = self.layouts[j]
    return layout is not None and k < layout.chunk_size
