"""SCAPE: AdamS with a top-k sparsified, error-fed first moment (Algorithm 1).

`scale_by_scape` is called inside `jax.shard_map` (or any context where
`axis_name` is bound) with each worker's *local* gradients and performs the
data-parallel exchange itself: one all-gather of the chunk masks and one
all-reduce of the compacted payload per step (with a 16-bit payload, an
all-to-all and an all-gather instead: `_wire`). Every choice the paper leaves
open is pinned down in `docs/design.md`.

Per-worker state (the residual `e^n`, the worker's own chunk mask and its
residual norm) carries a leading worker axis: size N in the global view that
`init` returns outside `shard_map`, size 1 in the local view that `update`
sees. `scape_jax.state_partition_specs` gives the `PartitionSpec`s that
place it.
"""

import functools
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm import masks
from scape_jax.comm.axes import DATA
from scape_jax.comm.collectives import varying
from scape_jax.optim import _common
from scape_jax.optim import _exchange
from scape_jax.optim import _norms
from scape_jax.optim import _scape_clip
from scape_jax.optim import _wire
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule
from scape_jax.optim._density import DensitySchedule
from scape_jax.optim._plan import CompressionPlan


class ScaleByScapeState(NamedTuple):
  """State of `scale_by_scape`."""
  count: jax.Array  # int32: completed updates.
  mu: optax.Updates  # First moment m, synchronized (zero outside the mask).
  residual: optax.Updates  # Per worker: e^n, fp32 [W, *shape]; MaskedNode on dense leaves.
  mask: optax.Updates  # Per worker: own chunk bitmap, uint32 [W, words]; MaskedNode on dense leaves.
  residual_norm: jax.Array  # Per worker: ||e^n|| after the last step, f32[W].
  density: jax.Array  # f32: density in force at the last step.

  # Fields that differ per worker and carry the leading worker axis.
  PER_WORKER_FIELDS = ('residual', 'mask', 'residual_norm')
  # Fields that may live in host memory between steps (Section IV-E;
  # `scape_jax.sharding.state_shardings(..., offload='pinned_host')`).
  OFFLOADED_FIELDS = ('residual',)


def scale_by_scape(
    density: Union[float, DensitySchedule],
    *,
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    clip_norm: Optional[float] = _common.CLIP_NORM,
    axis_name: Optional[str] = DATA,
    compress: MaskOrFn = None,
    density_warmup_steps: int = 0,
    mask_encoding: str = 'auto',
    select: str = 'auto',
    payload_dtype: str = 'float32',
    offset_bits: Union[str, int] = '32',
) -> optax.GradientTransformationExtraArgs:
  """SCAPE's exchange and AdamS direction from each worker's local gradients.

  Args:
    density: fraction of each compressed leaf sent per step, in (0, 1], or a
      `DensitySchedule` (then `density_warmup_steps` must be 0).
    b1: decay rate of the first moment.
    b2: weight of the previous first moment squared in the preconditioner.
    eps: term added to the denominator for numerical stability.
    clip_norm: global-norm clip of gbar (Algorithm 1, line 18); None or 0: off.
    axis_name: the data-parallel mesh axis; `None` means a single worker.
    compress: tree of bools or a callable `params -> tree`, in optax's `mask`
      style, selecting the leaves to sparsify. Default: leaves with ndim >= 2;
      norm scales and biases stay dense.
    density_warmup_steps: steps of the exponential warmup from density 1.
    mask_encoding: one of `masks.ENCODINGS`: 'auto' (the smallest
      allowed), 'bitmap' or 'indices' (offsets, of `offset_bits`).
    select: how the next mask's top-k is found, one of `topk.SELECTS`:
      'auto' (`topk.AUTO_SELECT` for the platform the program is lowered
      for: 'threshold' on CPU and TPU, 'pallas_radix' on CUDA), 'sort'
      (`lax.top_k`, the reference), 'threshold' (a sort-free search in
      jnp) or 'pallas_radix' (a fixed number of sort-free passes as
      Pallas kernels, every chunk at once; GPU and TPU). All give the
      same bits.
    payload_dtype: one of `payload.PAYLOAD_DTYPES`: the width of the
      payload values on the wire. 'bfloat16' and 'float16' round each
      worker's values and the owner's mean, and feed every rounding error
      back into that worker's residual (`comm.payload`).
    offset_bits: one of `masks.OFFSET_BITS` ('32' and '16' are accepted
      too): offsets as int32 (32), as 16 bits plus sub-block ends (16), or
      whichever is smaller ('auto'). The default is the string '32' so that
      `optax.inject_hyperparams` leaves it static.

  Returns:
    An `optax.GradientTransformationExtraArgs`. `update` takes the static
    keyword `density_level` (the `DensitySchedule.level` of the state's
    count): the step holds that level's collectives only; without it every
    level is compiled into one `lax.switch`. A range `(first, last)` of
    sparse levels is one program for all of them: its buffers sized for
    `first`'s k, the level in force taken from the count, the same numbers
    (`DensitySchedule(shared_warmup=True)` gives the warmup's). With
    `density_level=0`, the static `next_dense=True` says that the next
    update is dense too: its masks are all ones, and no mask search is
    compiled (the trainer's first steps of a density warmup).

  References:
    SCAPE paper, Algorithm 1 and Sections IV-A..IV-C, IV-E;
    `docs/design.md` sections 2-4.
  """
  schedule, hyper = _exchange.configure(
      'scape', density, density_warmup_steps, b1=b1, b2=b2, eps=eps,
      clip_norm=clip_norm, axis_name=axis_name, mask_encoding=mask_encoding,
      select=select, payload_dtype=payload_dtype, offset_bits=offset_bits)

  def init_fn(params):
    return _init_state(params, compress, axis_name)

  @_common.passes_empty_trees
  def update_fn(updates, state, params=None, *, density_level=None,
                next_dense=False, **extra):
    del params, extra
    return _update(updates, state, compress, schedule, hyper, density_level,
                   next_dense)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(updates, state, compress: MaskOrFn, schedule: DensitySchedule,
            hyper, density_level, next_dense) -> tuple:
  """`update_fn`'s checks, then `at_level`."""
  n, _ = _common.axis_context('scape update', hyper.axis_name)
  plan = CompressionPlan.create(updates, compress, n)
  _common.check_per_worker_state('scape update', state.residual_norm)
  return _exchange.at_level(_update_at_level, updates, state, plan, hyper,
                            schedule, density_level, next_dense)


def _init_state(params, compress: MaskOrFn,
                axis_name) -> ScaleByScapeState:
  """Algorithm 1's initial state: m = 0, e = 0, M_0 = all ones."""
  n, local = _common.axis_context('scape init', axis_name)
  plan = CompressionPlan.create(params, compress, n)
  per_worker = functools.partial(_common.per_worker, leading=1 if local else n,
                                 axis_name=axis_name, local=local)
  residual, own_mask = [], []
  for p, layout in zip(jax.tree.leaves(params), plan.layouts):
    if layout is None:
      residual.append(optax.MaskedNode())
      own_mask.append(optax.MaskedNode())
    else:
      residual.append(per_worker(jnp.zeros(p.shape, jnp.float32)))
      # M_0 = 1
      own_mask.append(per_worker(masks.ones_words(layout.chunk_size)))
  return ScaleByScapeState(
      count=jnp.zeros([], jnp.int32),
      mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
      residual=plan.treedef.unflatten(residual),
      mask=plan.treedef.unflatten(own_mask),
      residual_norm=per_worker(jnp.zeros([], jnp.float32)),
      density=jnp.ones([], jnp.float32))


_STORE_MIN = 1 << 16  # smaller leaves recompute m~ (`_semi_updated_moment`)


def _update_at_level(grads, state: ScaleByScapeState, level: int, *,
                     plan: CompressionPlan, hyper: _exchange.Hyper,
                     schedule: DensitySchedule, next_level, live=None):
  """One SCAPE update whose payload has the k of density level `level`
  (with `live`, the traced level in force: its k, `level`'s buffers)."""
  flat = plan.treedef.flatten_up_to
  grad_leaves = [g.astype(jnp.float32) for g in flat(grads)]
  mu = flat(state.mu)
  k_levels = _exchange.k_per_level(plan, hyper)
  k_now = [None if per_level is None else per_level[level]
           for per_level in k_levels]

  moment = _semi_updated_moment(grad_leaves, mu, flat(state.residual),
                                plan, hyper.b1, state.count, k_now)
  # The next mask first: where m~ is stored, its selection and the payload
  # are the last reads of m~ before the residual overwrites M in m~'s own
  # buffer (`after`).
  del schedule  # `next_level` is the next update's (`_exchange.at_level`)
  own_mask = _exchange.next_own_masks(moment, plan, k_levels, level,
                                      next_level, hyper)
  global_masks = _exchange.exchange_masks(
      flat(state.mask), plan, k_now, hyper,
      k_live=_exchange.live_k(k_levels, live))
  stored = [_stores_moment(plan, j, k_now[j]) for j in range(len(mu))]
  after = [(o,) if keep else () for o, keep in zip(own_mask, stored)]
  if hyper.payload_dtype == 'float32':
    sent = _exchange.payload(moment, plan, global_masks)
    exchanged, errors = _exchange.mean(sent, global_masks,
                                       hyper.axis_name), None
    after = [a + (x,) if keep else a
             for a, x, keep in zip(after, sent, stored)]
  else:  # the errors come from the sent values
    exchanged, errors = _wire.exchange_narrow(
        moment, plan.layouts, [g and g.offsets for g in global_masks],
        hyper.axis_name, hyper.payload_dtype)
  bbar, gbar, residual, in_mask = _reconstruct(
      moment, mu, exchanged, plan, global_masks, hyper.b1, errors, after)
  if hyper.clip_norm is not None:
    gbar = _scape_clip.clip(gbar, hyper.clip_norm, _scape_clip.squared_norms(
        gbar, bbar, in_mask, mu, exchanged, plan, global_masks, hyper.b1,
        at_m=live is None))
  count = optax.safe_increment(state.count)
  nu = [hyper.b2 * m * m + (1.0 - hyper.b2) * g * g
        for m, g in zip(mu, gbar)]
  direction = _common.bias_corrected_direction(bbar, nu, count, b1=hyper.b1,
                                               b2=hyper.b2, eps=hyper.eps)

  vary = functools.partial(varying, axis_name=hyper.axis_name)
  new_state = ScaleByScapeState(
      count=count,
      mu=plan.treedef.unflatten(bbar),
      residual=plan.treedef.unflatten(
          [optax.MaskedNode() if r is None else vary(r) for r in residual]),
      mask=plan.treedef.unflatten(
          [optax.MaskedNode() if o is None else vary(o) for o in own_mask]),
      residual_norm=vary(_norms.global_norm(residual)[None]),
      density=_exchange.density_at(hyper, level, live))
  direction = [d.astype(g.dtype) for d, g in zip(direction, flat(grads))]
  return plan.treedef.unflatten(direction), new_state


# ----------------------------------------------------------------------------
# The phases of one update, in order. Lists run over the leaves of the tree.


def _semi_updated_moment(grads, mu, residual, plan, b1, count, k_now):
  """m~ = b1 m + (1 - b1) g^n + e^n (the residual only on compressed leaves).

  On large leaves sparse at this level (k_now), divided by a 1 that XLA
  cannot fold (from `count`): a division is costly enough that XLA stores
  m~ once, where it would otherwise recompute it from three arrays in each
  full-size consumer (`bench/optimizer_overhead.py`). x / 1 is exact.
  m~ is computed in the residual's own shape [1, *shape], so that with the
  state donated XLA writes it, and the residual after it (`masks.set_at`),
  into e's buffer instead of copying the residual there at the end.
  """
  one = _common.unfoldable_one(count)
  moment = []
  for j, (g, m, e) in enumerate(zip(grads, mu, residual)):
    mt = b1 * m + (1.0 - b1) * g
    if plan.layouts[j] is not None:
      mt = mt[None] + e
      if _stores_moment(plan, j, k_now[j]):
        mt = mt / one
      mt = mt[0]
    moment.append(mt)
  return moment


def _stores_moment(plan, j: int, k) -> bool:
  """Whether leaf j's m~ is stored once (`_semi_updated_moment`)."""
  return (plan.layouts[j] is not None and plan.layouts[j].size >= _STORE_MIN
          and plan.is_sparse(j, k))


def _reconstruct(moment, mu, bbar_parts, plan, global_masks, b1,
                 errors=None, after=None):
  """bbar at full shape, the mean gradient at M (Eq. 3), the new residual
  and M (bool at full shape; None where the leaf is dense this step).

  Outside M gbar and bbar are zero and the residual is m~; dense leaves
  have no residual (None) or, compressed but dense at this level, zeros.
  Inside M the residual is zero, or the payload's rounding error `errors`
  of a half-width wire. `after`: per leaf, the results of the other reads
  of m~ (`masks.set_at`), so that the residual is written into m~'s buffer,
  not a copy of it.
  """
  errors = errors or [None] * len(moment)
  after = after or [()] * len(moment)
  bbar, gbar, residual, in_masks = [], [], [], []
  for j, (mt, m, values) in enumerate(zip(moment, mu, bbar_parts)):
    shape, layout, mask = plan.shapes[j], plan.layouts[j], global_masks[j]
    err = errors[j]
    if mask is not None:
      b = masks.scatter_at(values, layout, mask.offsets, shape)
      in_mask = layout.from_chunks(
          masks.unpack_bits(mask.words, layout.chunk_size), shape)
      kept = jnp.zeros_like(values) if err is None else err
      # e with M overwritten: no masked full pass
      residual.append(masks.set_at(mt, layout, mask.offsets, kept,
                                   after[j])[None])
      gbar.append(jnp.where(in_mask, (b - b1 * m) / (1.0 - b1), 0.0))
    else:
      in_mask = None
      b = values.reshape(shape)
      gbar.append((b - b1 * m) / (1.0 - b1))
      residual.append(None if layout is None else
                      masks.own_zeros((1,) + shape, jnp.float32, mt)
                      if err is None else err.reshape((1,) + shape))
    bbar.append(b)
    in_masks.append(in_mask)
  return bbar, gbar, residual, in_masks


# ----------------------------------------------------------------------------
# The user-facing alias.


def scape(
    learning_rate: ScalarOrSchedule,
    *,
    density: Union[float, DensitySchedule],
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    weight_decay: float = _common.WEIGHT_DECAY,
    clip_norm: Optional[float] = _common.CLIP_NORM,
    axis_name: Optional[str] = DATA,
    compress: MaskOrFn = None,
    density_warmup_steps: int = 0,
    mask_encoding: str = 'auto',
    select: str = 'auto',
    payload_dtype: str = 'float32',
    offset_bits: Union[str, int] = '32',
    weight_decay_mask: MaskOrFn = None,
) -> optax.GradientTransformationExtraArgs:
  """SCAPE: `scale_by_scape`, then decoupled weight decay and the learning rate.

  `w -= lr * (u + weight_decay * w)`, where `u` is the AdamS direction built
  from the sparsified first moment. Call `update` inside `shard_map` with the
  worker's local gradients; it performs the data-parallel exchange itself.
  With `optax.inject_hyperparams`, pass
  `static_args=('density', 'density_warmup_steps')`.

  Which SCAPE to use: this is the paper's Algorithm 1. At the same bytes
  per step, `scape_local_adam` (per-worker Adam) came closer to AdamS at
  d = 0.1 and at d = 0.01 in the project's runs (docs/results.md, "SCAPE's
  modes"); at d <= 0.02 also interleave the input embedding's chunks
  (`interleave_chunks`, `optimizer.scape.interleaved_leaves=embed_tokens`).

  Args:
    learning_rate: a float >= 0 or an optax schedule (None: no scaling, as
      in optax).
    density: fraction of each compressed leaf sent per step, in (0, 1], or a
      `DensitySchedule`.
    b1, b2, eps, clip_norm, axis_name, compress, density_warmup_steps,
      mask_encoding, select, payload_dtype, offset_bits: see
      `scale_by_scape`.
    weight_decay: decoupled weight-decay strength, >= 0.
    weight_decay_mask: optional tree or callable of bools selecting the leaves
      that get weight decay.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    SCAPE paper, Algorithm 1; `docs/design.md`.
  """
  return optax.chain(
      scale_by_scape(density, b1=b1, b2=b2, eps=eps, clip_norm=clip_norm,
                     axis_name=axis_name, compress=compress,
                     density_warmup_steps=density_warmup_steps,
                     mask_encoding=mask_encoding, select=select,
                     payload_dtype=payload_dtype, offset_bits=offset_bits),
      _common.add_decayed_weights('scape', weight_decay,
                                  weight_decay_mask),
      _common.scale_by_learning_rate('scape', learning_rate),
  )


def scape_stats(opt_state) -> dict:
  """The statistics of the first `ScaleByScapeState` in `opt_state`, or {}.

  `density` is the density in force at the last update; `residual_norm` is
  per worker (a vector over the global state's workers).
  """
  return _common.state_stats(opt_state, ScaleByScapeState,
                             ('density', 'residual_norm'))
