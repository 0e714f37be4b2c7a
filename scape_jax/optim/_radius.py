"""Radius: top-k sparsified all-reduce with masks shared by every worker.

Radius (Algorithms 1 and 2 of the paper) sends, on most steps, only the
gradient entries at a per-leaf top-k mask that every worker holds
identically: the mask is chosen from the AdamW update direction after a dense
all-reduce, so no index is ever sent. Each step is one of three kinds:

* dense: steps before the first resample (t < threshold, then up to the first
  multiple of T): a plain all-reduce of the local gradients;
* resample (t >= threshold, t % T == 0): the residual is added to the local
  gradient, a dense all-reduce, the residual is flushed, and after clipping
  and the AdamW correction the masks are chosen anew;
* sparse (all other steps): the values at the mask are all-reduced (one
  compacted buffer of static shape) and every worker keeps the rest of its
  own gradient in its residual (error feedback).

The update is AdamW on the exchanged (and clipped) gradient. Each kind is one
compiled program (the static `step_kind` of `update`). Every choice the paper
leaves open is pinned in `docs/design.md`, "Radius".

`scale_by_radius` is called inside `jax.shard_map` with each worker's local
gradients and does the data-parallel exchange over `axis_name` itself. The
per-worker residual carries a leading worker axis: size N in the global view
that `init` returns under `jax.set_mesh(mesh)`, size 1 inside `shard_map`
(`scape_jax.state_partition_specs` places it).
"""

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scape_jax.comm import masks as mask_bits
from scape_jax.comm import topk
from scape_jax.comm.collectives import varying
from scape_jax.optim import _common
from scape_jax.optim import _norms
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule

DENSITY = 0.5  # Fraction of each compressed leaf sent (paper, GPT-355M: 0.5).
INTERVAL = 200  # T: steps between resamples of the masks (paper: 200).
# The paper switches from dense to Radius after 16% of training (GPT-355M:
# 80k of 500k steps). The optax primitive takes the step; the trainer's
# `optimizer.radius.dense_fraction` computes it from the run length.
DENSE_FRACTION = 0.16

DENSE, SPARSE, RESAMPLE = 'dense', 'sparse', 'resample'
STEP_KINDS = (DENSE, SPARSE, RESAMPLE)  # Also the `lax.switch` branch order.


class ScaleByRadiusState(NamedTuple):
  """State of `scale_by_radius`."""
  count: jax.Array  # int32: completed updates.
  adam: optax.ScaleByAdamState  # AdamW moments of the exchanged gradient.
  # Shared by all workers: ascending flat offsets int32[slots] per sparse
  # leaf (`size` marks an empty slot); MaskedNode on the other leaves.
  mask: optax.Updates
  # Per worker: error feedback, fp32 [W, *shape] per sparse leaf.
  residual: optax.Updates
  residual_norm: jax.Array  # Per worker: ||residual|| after the step, f32[W].

  # Fields that differ per worker and carry the leading worker axis.
  PER_WORKER_FIELDS = ('residual', 'residual_norm')


@dataclasses.dataclass(frozen=True)
class RadiusSchedule:
  """The kind of each step. Steps are numbered t = 1, 2, ...

  Steps t >= `threshold` with t % `interval` == 0 resample; the steps before
  the first of them are dense; every other step is sparse.
  """
  interval: int = INTERVAL
  threshold: int = 0

  def __post_init__(self):
    _common.check_int('scale_by_radius', 'interval', self.interval, 1)
    _common.check_int('scale_by_radius', 'threshold', self.threshold, 0)

  @property
  def first_resample(self) -> int:
    """The first step t >= max(threshold, 1) with t % interval == 0."""
    return max(1, -(-self.threshold // self.interval)) * self.interval

  def kind(self, count: int) -> str:
    """The kind of the update after `count` completed ones."""
    t = count + 1
    if t >= self.first_resample and t % self.interval == 0:
      return RESAMPLE
    return SPARSE if t > self.first_resample else DENSE

  def kind_index(self, count: jax.Array) -> jax.Array:
    """`STEP_KINDS.index(self.kind(count))` for a traced count."""
    t = jnp.asarray(count, jnp.int32) + 1
    resample = (t >= self.first_resample) & (t % self.interval == 0)
    return jnp.where(resample, 2, jnp.where(t > self.first_resample, 1, 0))


def top_k_count(density: float, size: int) -> int:
  """k = ceil(density * size) on the exact decimal `density`, 1 <= k <= size."""
  try:
    value = float(density)
  except (TypeError, ValueError):
    value = math.nan
  if not 0.0 < value <= 1.0:
    raise ValueError(
        f'scale_by_radius: density={density!r} must be in (0, 1].')
  k = math.ceil(mask_bits.exact_decimal(density) * size)
  return max(1, min(size, k))


@dataclasses.dataclass(frozen=True)
class RadiusPlan:
  """Static per-leaf settings: `slots[j]` mask entries of leaf j, or None.

  A leaf is sparse when it is compressed and its mask has fewer slots than
  entries: k = ceil(density * size) top-k centres, each widened to
  [i - r, i + r], so at most min(size, k (2r + 1)) slots. Other leaves are
  always sent in full.
  """
  treedef: object
  shapes: tuple
  k: tuple
  slots: tuple

  @classmethod
  def create(cls, params, compress: MaskOrFn, density: float,
             index_radius: int) -> 'RadiusPlan':
    leaves, treedef = jax.tree.flatten(params)
    flags = _common.leaf_flags('scale_by_radius', 'compress', params, compress,
                               lambda p: p.ndim >= 2)
    ks, slots = [], []
    for p, flag in zip(leaves, flags):
      size = math.prod(p.shape)
      k = top_k_count(density, size)
      width = min(size, k * (2 * index_radius + 1))
      ks.append(k)
      slots.append(width if flag and width < size else None)
    return cls(treedef, tuple(tuple(p.shape) for p in leaves), tuple(ks),
               tuple(slots))

  def size(self, j: int) -> int:
    return math.prod(self.shapes[j])


def scale_by_radius(
    density: float = DENSITY,
    interval: int = INTERVAL,
    *,
    threshold: int = 0,
    index_radius: int = 0,
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    weight_decay: float = _common.WEIGHT_DECAY,
    weight_decay_mask: MaskOrFn = None,
    clip_norm: Optional[float] = _common.CLIP_NORM,
    axis_name: Optional[str] = 'data',
    compress: MaskOrFn = None,
    select: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Radius's exchange and corrected gradient from each worker's gradients.

  The output is Algorithm 2's corrected gradient `m_hat / (sqrt(v_hat) + eps)
  + weight_decay * w`, on which the masks are chosen; scale it by the
  learning rate (`radius` does) to get AdamW.

  Args:
    density: fraction of each compressed leaf sent on sparse steps, (0, 1].
    interval: T, the steps between resamples of the masks (>= 1).
    threshold: steps t < threshold (t = 1, 2, ...) are dense; the paper uses
      16% of the run (`DENSE_FRACTION`).
    index_radius: r >= 0; each selected index i is widened to [i - r, i + r]
      within its leaf's flat order (mz687/radius `reducers.py`).
    b1, b2, eps: AdamW's moment decays and denominator term.
    weight_decay: decoupled weight decay (the `+ weight_decay * w` of the
      correction).
    weight_decay_mask: optional tree or callable of bools selecting the
      leaves that get weight decay.
    clip_norm: global-norm clip of the exchanged gradient (Algorithm 1, line
      20); `None` or 0 disables it.
    axis_name: the data-parallel mesh axis; `None` means a single worker.
    compress: tree of bools or a callable `params -> tree` selecting the
      leaves to sparsify. Default: leaves with ndim >= 2.
    select: how a resample finds each leaf's top-k, one of
      `comm.topk.SELECTS` ('sort' is `lax.top_k`, which sorts the whole
      leaf for a large k; 'auto' is SCAPE's choice per backend). Every
      value gives the same masks: the k largest |corrected gradient|, ties
      to the lower index, NaN above +-inf (`comm.topk`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update` needs `params`
    (for the weight-decay term) and accepts the static keyword `step_kind`,
    one of `STEP_KINDS` (`RadiusSchedule.kind` of the state's count). Without
    it, every kind is compiled into one `lax.switch` on the count.

  References:
    Zheng et al., "Radius: Range-based Gradient Sparsity for Large Foundation
    Model Pre-training", Algorithms 1-2; `docs/design.md`, "Radius".
  """
  schedule, adam, hyper = _configure(
      density, interval, threshold, index_radius, select, b1=b1, b2=b2,
      eps=eps, clip_norm=clip_norm, weight_decay=weight_decay,
      axis_name=axis_name)

  def init_fn(params):
    return _init_state(params, compress, density, index_radius, axis_name,
                       adam)

  @_common.passes_empty_trees
  def update_fn(updates, state, params=None, *, step_kind=None, **extra):
    del extra
    _common.axis_context('radius update', axis_name)
    _common.check_per_worker_state('radius update', state.residual_norm)
    if params is None and not _is_zero(weight_decay):
      raise ValueError('radius update: params are required for the weight '
                       f'decay term (weight_decay={weight_decay!r}).')
    plan = RadiusPlan.create(updates, compress, density, index_radius)
    decay = _common.leaf_flags('scale_by_radius', 'weight_decay_mask', updates,
                               weight_decay_mask, lambda p: True)
    step = functools.partial(_update, updates, state, params, plan=plan,
                             hyper=hyper, adam=adam, decay=decay)
    return _at_step_kind(step, step_kind, schedule.kind_index(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _configure(density, interval, threshold, index_radius, select, *, b1, b2,
               eps, clip_norm, weight_decay, axis_name) -> tuple:
  """Checks `scale_by_radius`'s arguments (a ValueError names the bad value
  and what is allowed); (its RadiusSchedule, its Adam, its _Hyper)."""
  _common.check_moments('scale_by_radius', b1, b2, eps, clip_norm)
  _common.check_non_negative('scale_by_radius', 'weight_decay', weight_decay)
  top_k_count(density, 1)  # validates density
  _common.check_int('scale_by_radius', 'index_radius', index_radius, 0)
  topk.check_select(select, 'scale_by_radius')
  return (RadiusSchedule(interval, threshold),
          optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
          _Hyper(axis_name=axis_name, clip_norm=clip_norm,
                 weight_decay=weight_decay, index_radius=index_radius,
                 select=select))


def _at_step_kind(step, step_kind: Optional[str], kind_index):
  """`step(step_kind)`, or without a static kind every kind in a
  `lax.switch` on `kind_index` (the schedule's, traced)."""
  if step_kind is None:
    return jax.lax.switch(kind_index, [functools.partial(step, kind)
                                       for kind in STEP_KINDS])
  if step_kind not in STEP_KINDS:
    raise ValueError(f'radius: step_kind={step_kind!r}; allowed: '
                     f'{STEP_KINDS}.')
  return step(step_kind)


def _init_state(params, compress: MaskOrFn, density: float,
                index_radius: int, axis_name, adam) -> ScaleByRadiusState:
  """The initial state: no mask until the first resample (every slot empty,
  = the leaf's size), zero residuals and Adam moments."""
  n, local = _common.axis_context('radius init', axis_name)
  plan = RadiusPlan.create(params, compress, density, index_radius)
  per_worker = functools.partial(_common.per_worker, leading=1 if local
                                 else n, axis_name=axis_name, local=local)
  mask, residual = [], []
  for j, slots in enumerate(plan.slots):
    if slots is None:
      mask.append(optax.MaskedNode())
      residual.append(optax.MaskedNode())
    else:
      mask.append(jnp.full((slots,), plan.size(j), jnp.int32))
      residual.append(per_worker(jnp.zeros(plan.shapes[j], jnp.float32)))
  return ScaleByRadiusState(
      count=jnp.zeros([], jnp.int32),
      adam=adam.init(jax.tree.map(
          lambda p: jnp.zeros(p.shape, jnp.float32), params)),
      mask=plan.treedef.unflatten(mask),
      residual=plan.treedef.unflatten(residual),
      residual_norm=per_worker(jnp.zeros([], jnp.float32)))


@dataclasses.dataclass(frozen=True)
class _Hyper:
  """The static settings of one `scale_by_radius` used inside a step."""
  axis_name: Optional[str]
  clip_norm: Optional[float]
  weight_decay: float
  index_radius: int
  select: str = 'auto'


def _update(grads, state: ScaleByRadiusState, params, kind: str, *,
            plan: RadiusPlan, hyper: _Hyper, adam, decay: Sequence[bool]):
  """One Radius update of the given kind (Algorithm 1, lines 3-25)."""
  flat = plan.treedef.flatten_up_to
  local = [g.astype(jnp.float32) for g in flat(grads)]
  residual = [None if isinstance(e, optax.MaskedNode) else e[0]
              for e in flat(state.residual)]
  masks = flat(state.mask)
  if kind == SPARSE:
    mean, residual = _exchange_sparse(local, residual, masks, plan,
                                      hyper.axis_name)
  else:
    mean, residual = _exchange_dense(local, residual, kind == RESAMPLE,
                                     hyper.axis_name)
  mean = _clip(mean, hyper.clip_norm)
  direction, adam_state = adam.update(plan.treedef.unflatten(mean),
                                      state.adam)
  corrected = _add_weight_decay(flat(direction), params, plan, decay,
                                hyper.weight_decay)
  if kind == RESAMPLE:
    masks = _select(corrected, masks, plan, hyper.index_radius, hyper.select)

  vary = functools.partial(varying, axis_name=hyper.axis_name)
  new_state = ScaleByRadiusState(
      count=optax.safe_increment(state.count),
      adam=adam_state,
      mask=plan.treedef.unflatten(masks),
      residual=plan.treedef.unflatten(
          [optax.MaskedNode() if e is None else vary(e[None])
           for e in residual]),
      residual_norm=vary(_residual_norm(residual, kind)[None]))
  out = [u.astype(g.dtype) for u, g in zip(corrected, flat(grads))]
  return plan.treedef.unflatten(out), new_state


# ----------------------------------------------------------------------------
# The phases of one update. Lists run over the leaves of the tree.


def _residual_norm(residual, kind: str) -> jax.Array:
  """||e||; 0 after a resample, which flushes e to constant zeros: XLA would
  fold their norm's reduction element by element (minutes on a large leaf)."""
  if kind == RESAMPLE:
    return jnp.zeros([], jnp.float32)
  return _norms.global_norm(residual)


def _exchange_dense(local, residual, add_residual: bool, axis_name):
  """Dense all-reduce of the local gradients (plus residual, then flushed)."""
  if add_residual:
    local = [g if e is None else g + e for g, e in zip(local, residual)]
    residual = [None if e is None else jnp.zeros_like(e) for e in residual]
  mean = local if axis_name is None else jax.lax.pmean(local, axis_name)
  return mean, residual


def _exchange_sparse(local, residual, masks, plan: RadiusPlan, axis_name):
  """All-reduce of the values at the shared masks, plus the dense leaves.

  One fp32 buffer of static shape, in leaf order: each sparse leaf's `slots`
  values (empty slots send 0), every other leaf in full. Returns the mean
  gradient (zero outside the masks) and the residual with the unsent part of
  the local gradient added.
  """
  parts = []
  for g, offsets, slots in zip(local, masks, plan.slots):
    parts.append(g.reshape(-1) if slots is None else
                 jnp.take(g.reshape(-1), offsets, mode='fill', fill_value=0))
  buffer = jnp.concatenate(parts)
  if axis_name is not None:
    buffer = jax.lax.pmean(buffer, axis_name)
  mean, new_residual = [], []
  for j, values in enumerate(_split(buffer, [p.size for p in parts])):
    shape, offsets = plan.shapes[j], masks[j]
    if plan.slots[j] is None:
      mean.append(values.reshape(shape))
      new_residual.append(residual[j])
      continue
    size = plan.size(j)
    # Zeros of their own per leaf: a constant zero array would be shared by
    # the leaves of one size and copied before each scatter into it.
    mean.append(mask_bits.own_zeros((size,), jnp.float32, offsets).at[
        offsets].set(values, mode='drop').reshape(shape))
    sent = mask_bits.own_zeros((size,), bool, offsets).at[offsets].set(
        True, mode='drop')
    unsent = jnp.where(sent.reshape(shape), 0.0, local[j])
    new_residual.append(residual[j] + unsent)
  return mean, new_residual


def _is_zero(value) -> bool:
  """None or a static 0; False for a traced value (optax.inject_hyperparams
  passes hyperparameters as arrays)."""
  return value is None or (not isinstance(value, jax.Array) and value == 0)


def _clip(grads, clip_norm):
  """optax.clip_by_global_norm's arithmetic; None or 0 disables it."""
  if _is_zero(clip_norm):
    return grads
  clipped, _ = optax.clip_by_global_norm(clip_norm).update(
      grads, optax.EmptyState())
  if isinstance(clip_norm, jax.Array):  # injected: 0 still disables it
    clipped = [jnp.where(clip_norm > 0, c, g) for c, g in zip(clipped, grads)]
  return clipped


def _add_weight_decay(direction, params, plan, decay, weight_decay):
  """Algorithm 2, line 5: the AdamW direction plus `weight_decay * w`."""
  if _is_zero(weight_decay):
    return list(direction)
  return [d + weight_decay * w if flag else d
          for d, w, flag in zip(direction, plan.treedef.flatten_up_to(params),
                                decay)]


def _select(corrected, masks, plan: RadiusPlan, index_radius: int,
            select: str) -> list:
  """New shared masks: per sparse leaf, the top-k of |corrected| (ties:
  lower index first) as ascending offsets, widened."""
  sparse = [j for j in range(len(masks)) if plan.slots[j] is not None]
  scores = [corrected[j].reshape(-1) for j in sparse]
  ks = [plan.k[j] for j in sparse]
  # Every sparse leaf in one call: the radix selects take them in one set
  # of passes.
  words = topk.chunks_topk_words(scores, [x.shape[0] for x in scores], ks,
                                 ks, select=select)
  out = list(masks)
  for j, w, k in zip(sparse, words, ks):
    centres = mask_bits.words_to_offsets(w[None], k)[0]
    out[j] = centres if index_radius == 0 else _widen(
        centres, plan.size(j), index_radius, plan.slots[j])
  return out


def _widen(centres: jax.Array, size: int, radius: int,
           slots: int) -> jax.Array:
  """The ascending union of [i - r, i + r] over the centres, clipped to the
  leaf; `slots` entries, the unused ones set to `size` (empty)."""
  hits = jnp.zeros((size,), jnp.int32).at[centres].set(1)
  ends = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(hits)])
  pos = jnp.arange(size)
  lo = jnp.clip(pos - radius, 0, size)
  hi = jnp.clip(pos + radius + 1, 0, size)
  covered = ends[hi] - ends[lo] > 0
  (offsets,) = jnp.nonzero(covered, size=slots, fill_value=size)
  return offsets.astype(jnp.int32)


def _split(flat: jax.Array, sizes: Sequence[int]) -> list:
  bounds = np.cumsum([0] + list(sizes))
  return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def radius(
    learning_rate: ScalarOrSchedule,
    *,
    density: float = DENSITY,
    interval: int = INTERVAL,
    threshold: int = 0,
    index_radius: int = 0,
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    weight_decay: float = _common.WEIGHT_DECAY,
    weight_decay_mask: MaskOrFn = None,
    clip_norm: Optional[float] = _common.CLIP_NORM,
    axis_name: Optional[str] = 'data',
    compress: MaskOrFn = None,
    select: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Radius: `scale_by_radius`, then the learning rate.

  `w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)`: AdamW on the
  gradient that Radius exchanges. Call `update` inside `shard_map` with the
  worker's local gradients and the params; it performs the data-parallel
  exchange itself. With `optax.inject_hyperparams`, pass
  `static_args=('density', 'interval', 'threshold', 'index_radius')`.

  Args:
    learning_rate: a float >= 0 or an optax schedule (None: no scaling, as
      in optax).
    density, interval, threshold, index_radius, b1, b2, eps, weight_decay,
      weight_decay_mask, clip_norm, axis_name, compress, select: see
      `scale_by_radius`.

  Returns:
    An `optax.GradientTransformationExtraArgs` (static `step_kind`, see
    `scale_by_radius`).

  References:
    Radius paper, Algorithms 1-2; `docs/design.md`, "Radius".
  """
  return optax.chain(
      scale_by_radius(density, interval, threshold=threshold,
                      index_radius=index_radius, b1=b1, b2=b2, eps=eps,
                      weight_decay=weight_decay,
                      weight_decay_mask=weight_decay_mask,
                      clip_norm=clip_norm, axis_name=axis_name,
                      compress=compress, select=select),
      _common.scale_by_learning_rate('radius', learning_rate),
  )


def radius_stats(opt_state) -> dict:
  """The per-worker residual norm of the first `ScaleByRadiusState`, or {}."""
  return _common.state_stats(opt_state, ScaleByRadiusState,
                             ('residual_norm',))
