"""SCAPE's wire: the phases every SCAPE transformation shares.

Algorithm 1 (`_scape`), Algorithm 2 (`_scape_dist`) and the per-worker-Adam
mode (`_scape_local_adam`) exchange the same way: each worker chooses the
top-k mask of its own chunk of every compressed leaf, the masks travel in one
all-gather (bitmaps or offsets, `comm.masks`), and the values at the masks in
one all-reduce. They differ in what they send and in what they compute from
the mean. This module holds the shared phases and settings; it imports none
of the transformations, which import it.
"""

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.comm import masks
from scape_jax.comm import payload as payload_lib
from scape_jax.comm import topk
from scape_jax.comm.collectives import all_gather_invariant
from scape_jax.optim import _common
from scape_jax.optim import _memory
from scape_jax.optim._density import DensitySchedule
from scape_jax.optim._plan import CompressionPlan


@dataclasses.dataclass(frozen=True)
class Hyper:
  """The static settings of one SCAPE transformation."""
  b1: float
  b2: float
  eps: float
  clip_norm: Optional[float]
  axis_name: Optional[str]
  encoding: str
  levels: tuple
  select: str
  payload_dtype: str = 'float32'
  offset_bits: Union[str, int] = 32


def configure(where: str, density, density_warmup_steps: int, *, b1, b2,
              eps, clip_norm, axis_name, mask_encoding, select,
              payload_dtype='float32', offset_bits='32') -> tuple:
  """Checks a SCAPE transformation's arguments; (its DensitySchedule, its
  `Hyper`)."""
  _common.check_moments(f'scale_by_{where}', b1, b2, eps, clip_norm)
  payload_lib.check_payload_dtype(payload_dtype)
  topk.check_select(select, where)
  schedule = density
  if not isinstance(density, DensitySchedule):
    schedule = DensitySchedule(density, density_warmup_steps)
  elif density_warmup_steps:
    raise ValueError(f'{where}: density is a DensitySchedule; give its '
                     'warmup there, not density_warmup_steps='
                     f'{density_warmup_steps!r}.')
  return schedule, Hyper(
      b1=b1, b2=b2, eps=eps, clip_norm=clip_norm, axis_name=axis_name,
      encoding=mask_encoding, levels=schedule.levels, select=select,
      payload_dtype=payload_dtype,
      offset_bits=masks.check_wire_request(mask_encoding, offset_bits))


def at_level(update_at_level, updates, state, plan: CompressionPlan, hyper,
             schedule: DensitySchedule, density_level,
             next_dense: bool = False) -> tuple:
  """`update_at_level` at the static `density_level`, else at the state's
  level through a `lax.switch`, with offloaded state leaves on the device in
  between. It gets `next_level`, the level of the next update: traced from
  the state's count, or 0 (static) where `next_dense` says the next update
  is at density 1, so that no mask search is compiled for it."""
  if next_dense and (density_level is None or isinstance(density_level, tuple)
                     or schedule.levels[density_level] != 1.0):
    raise ValueError(
        f'next_dense=True with density_level={density_level!r}: the next '
        'update can be dense only after a dense one (level 0).')
  next_level = 0 if next_dense else schedule.level(state.count + 1)
  step = functools.partial(update_at_level, updates,
                           _memory.to_device(state), plan=plan,
                           hyper=hyper, schedule=schedule,
                           next_level=next_level)
  direction, new_state = _common.at_density_level(
      step, density_level, schedule.levels, schedule.level(state.count))
  return direction, _memory.like(new_state, state)


def k_per_level(plan: CompressionPlan, hyper: Hyper) -> list:
  """Per leaf: the k of each density level (None on dense leaves)."""
  return [None if layout is None else plan.k_per_level(j, hyper.levels)
          for j, layout in enumerate(plan.layouts)]


def live_k(k_levels, live) -> Optional[list]:
  """Per leaf, the k of the traced level `live` (None: no range, or a dense
  leaf)."""
  if live is None:
    return None
  return [None if ks is None else jnp.asarray(ks, jnp.int32)[live]
          for ks in k_levels]


def density_at(hyper: Hyper, level: int, live=None) -> jax.Array:
  """The density in force: of `level`, or of the traced `live` level."""
  if live is None:
    return jnp.asarray(hyper.levels[level], jnp.float32)
  return jnp.asarray(hyper.levels, jnp.float32)[live]


class GlobalMask(NamedTuple):
  """One sparse leaf's mask in force, as gathered from every worker."""
  offsets: jax.Array  # int32[N, k], ascending within each chunk
  words: jax.Array  # uint32[N, ceil(c/32)], the same as chunk bitmaps


def exchange_masks(own_masks, plan, k_now, hyper, shift=None,
                   k_live=None) -> list:
  """The mask all-gather: every worker's chunk mask -> `GlobalMask`.

  One uint32 buffer carries every sparse leaf's contribution (bitmap or
  offsets, `LeafLayout.encoding`). Dense leaves get None. With `shift`
  (`next_own_masks`'), worker n's contribution is chunk (n + shift) % N's.
  The bitmaps are decoded by `masks.words_to_offsets_many`, the leaves of
  one shape together, as are the offsets made bitmaps. `k_live` (per leaf,
  traced): the masks' own k where the buffers are sized for the larger
  `k_now`; the offsets past it repeat the last (`masks.repeat_last`).
  """
  sparse = [j for j in range(len(own_masks)) if plan.is_sparse(j, k_now[j])]
  enc = {j: plan.layouts[j].encoding(k_now[j], hyper.encoding,
                                     hyper.offset_bits) for j in sparse}
  wire = masks.masks_to_wire_many([own_masks[j][0] for j in sparse],
                                  [plan.layouts[j] for j in sparse],
                                  [k_now[j] for j in sparse],
                                  [enc[j] for j in sparse],
                                  None if k_live is None else
                                  [k_live[j] for j in sparse])
  global_masks = [None] * len(own_masks)
  if not wire:
    return global_masks
  buf = jnp.concatenate(wire)
  gathered = (buf[None] if hyper.axis_name is None else
              all_gather_invariant(buf, hyper.axis_name))
  if shift is not None:  # row c: chunk c's mask
    gathered = jnp.roll(gathered, shift, axis=0)
  parts = dict(zip(sparse, split(gathered, [x.shape[0] for x in wire])))
  bitmaps = [j for j in sparse if enc[j] == 'bitmap']
  decoded = masks.words_to_offsets_many([parts[j] for j in bitmaps],
                                        [k_now[j] for j in bitmaps])
  for j, offsets in zip(bitmaps, decoded):
    if k_live is not None:
      offsets = masks.repeat_last(offsets, k_live[j])
    global_masks[j] = GlobalMask(offsets, parts[j])
  index = [j for j in sparse if enc[j] != 'bitmap']
  offsets = [masks.offsets_from_wire(parts[j], plan.layouts[j], k_now[j],
                                     enc[j]) for j in index]
  distinct = offsets  # the repeated offsets past k_live set no bit
  if k_live is not None:
    distinct = [_past_live_out(o, k_live[j], plan.layouts[j].chunk_size)
                for o, j in zip(offsets, index)]
  words = masks.offsets_to_words_many(
      distinct, [plan.layouts[j].chunk_size for j in index])
  for j, o, w in zip(index, offsets, words):
    global_masks[j] = GlobalMask(o, w)
  return global_masks


def _past_live_out(offsets, k, chunk: int):
  """The offsets with those past slot k at the first word past the chunk's
  bitmap, which `masks.offsets_to_words` drops."""
  slot = jnp.arange(offsets.shape[-1], dtype=jnp.int32)
  return jnp.where(slot < k, offsets, 32 * -(-chunk // 32))


def exchange_payload(values, plan, global_masks, axis_name) -> list:
  """The payload all-reduce: `values` at M, plus the dense leaves whole.

  Returns the mean over workers split per leaf (compacted for sparse leaves).
  """
  return mean(payload(values, plan, global_masks), global_masks, axis_name)


def payload(values, plan, global_masks) -> list:
  """This worker's payload per leaf: `values` at M, compacted, on sparse
  leaves; flat on dense ones."""
  return [x.reshape(-1) if g is None else
          masks.gather_at(x, layout, g.offsets)
          for x, layout, g in zip(values, plan.layouts, global_masks)]


def mean(parts, global_masks, axis_name) -> list:
  """The mean over workers of each leaf's payload, in one all-reduce.

  In a step where every leaf is dense (no `global_masks`) the leaves are
  averaged as they are, as `pmean_gradients` averages AdamW's: XLA combines
  them into as few all-reduces as its combine threshold allows, and with no
  buffer to slice at each leaf's offset, leaves of one shape share their
  kernels (the compile of a run's first, dense program:
  `bench/first_step.py`).
  """
  if all(g is None for g in global_masks):
    return list(parts if axis_name is None else
                jax.lax.pmean(list(parts), axis_name))
  flat = jnp.concatenate(parts)
  out = flat if axis_name is None else jax.lax.pmean(flat, axis_name)
  return split(out, [x.size for x in parts])


def next_own_masks(scores, plan, k_levels, level, next_level, hyper,
                   shift=None) -> list:
  """This worker's next chunk mask per compressed leaf, the top-k of
  |`scores`| in chunk n for worker n, or in chunk (n + shift) % N."""
  worker = (0 if hyper.axis_name is None else
            jax.lax.axis_index(hyper.axis_name))
  if shift is not None:
    worker = (worker + shift) % plan.num_workers
  return _common.next_chunk_masks(
      lambda j: own_chunk(scores[j], plan.layouts[j], worker), plan.layouts,
      k_levels, level, next_level, hyper.select)


def own_chunk(x: jax.Array, layout: masks.LeafLayout, worker):
  """(chunk `worker` of the leaf, its number of real entries)."""
  chunk = layout.chunk_size
  flat = x.reshape(-1)
  if layout.padded > layout.size:
    flat = jnp.pad(flat, (0, layout.padded - layout.size))
  return (jax.lax.dynamic_slice_in_dim(flat, worker * chunk, chunk),
          layout.num_valid(worker))


def split(flat: jax.Array, sizes: Sequence[int]) -> list:
  """Consecutive slices of `flat` along its last axis."""
  bounds = np.cumsum([0] + list(sizes))
  return [flat[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]
