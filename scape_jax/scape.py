"""SCAPE: AdamS with a top-k sparsified, error-fed first moment (Algorithm 1).

`scale_by_scape` is called inside `jax.shard_map` (or any context where
`axis_name` is bound) with each worker's *local* gradients and performs the
data-parallel exchange itself: one all-reduce of the compacted payload and one
all-gather of the chunk masks per step. Every choice the paper leaves open is
pinned down in `docs/design.md`.

Per-worker state (the residual `e^n`, the worker's own chunk mask and its
residual norm) carries a leading worker axis: size N in the global view that
`init` returns outside `shard_map`, size 1 in the local view that `update`
sees. `state_partition_specs` gives the `PartitionSpec`s that place it.
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from scape_jax import comm
from scape_jax._compat import all_gather_invariant
from scape_jax import masks
from scape_jax.adams import ScalarOrSchedule, bias_corrected_direction

PER_WORKER_FIELDS = ('residual', 'mask', 'residual_norm')


class ScaleByScapeState(NamedTuple):
  """State of `scale_by_scape`."""
  count: jax.Array  # int32: completed updates.
  mu: optax.Updates  # First moment m, synchronized (zero outside the mask).
  residual: optax.Updates  # Per worker: e^n, fp32 [W, *shape]; MaskedNode on dense leaves.
  mask: optax.Updates  # Per worker: own chunk bitmap, uint32 [W, words]; MaskedNode on dense leaves.
  residual_norm: jax.Array  # Per worker: ||e^n|| after the last step, f32[W].
  density: jax.Array  # f32: density in force at the last step.
  payload_values: jax.Array  # int32: values in the last payload all-reduce.
  bytes_sent: jax.Array  # f32: bytes this worker sent at the last step (ring model).


@dataclasses.dataclass(frozen=True)
class DensitySchedule:
  """Exponential density warmup from 1 to `density`, quantized to levels.

  Level 0 is density 1: the first step is dense because M_0 is all ones. The
  continuous schedule `density ** (min(t, W) / W)` at `t` completed updates is
  rounded to the nearest of at most `max_levels` levels, evenly spaced in log
  density. Each level is one compiled program; nothing recompiles per step.
  """
  density: float
  warmup_steps: int = 0
  max_levels: int = 8

  def __post_init__(self):
    masks.chunk_k(self.density, 1)  # validates density
    if self.warmup_steps < 0:
      raise ValueError(
          f'density_warmup_steps={self.warmup_steps!r} must be >= 0.')

  @property
  def levels(self) -> tuple:
    if self.density == 1.0:
      return (1.0,)
    if self.warmup_steps == 0:
      return (1.0, self.density)
    n = min(self.max_levels, self.warmup_steps + 1)
    return tuple(self.density ** (i / (n - 1)) for i in range(n - 1)) + (
        self.density,)

  def level(self, count):
    """Level in force at the update after `count` completed ones (int or array)."""
    last = len(self.levels) - 1
    w = self.warmup_steps
    if isinstance(count, int):
      if count == 0 or last == 0:
        return 0
      return last if w == 0 else (2 * min(count, w) * last + w) // (2 * w)
    count = jnp.asarray(count, jnp.int32)
    if last == 0:
      return jnp.zeros([], jnp.int32)
    ramp = last if w == 0 else (2 * jnp.minimum(count, w) * last + w) // (2 * w)
    return jnp.where(count == 0, 0, ramp).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static per-leaf layout; `layouts[j]` is None for a dense leaf."""
  treedef: Any
  shapes: tuple
  layouts: tuple
  num_workers: int

  def ks(self, j: int, levels: Sequence[float]) -> tuple:
    return tuple(masks.chunk_k(d, self.layouts[j].chunk) for d in levels)


def _axis_context(axis_name: Optional[str], where: str):
  """(N, local): local means a bound axis (inside shard_map) or no axis."""
  if axis_name is None:
    return 1, True
  try:
    return jax.lax.axis_size(axis_name), True
  except NameError:
    pass
  mesh = jax.sharding.get_abstract_mesh()
  if where == 'init' and not mesh.empty and axis_name in mesh.axis_names:
    return mesh.shape[axis_name], False
  raise ValueError(
      f'scape {where}: axis_name={axis_name!r} is not bound. Call update '
      f'inside jax.shard_map over a mesh with a {axis_name!r} axis (init also '
      'works under jax.set_mesh(mesh)), or pass axis_name=None for a single '
      'worker.')


def _make_plan(params, compress, num_workers: int) -> _Plan:
  leaves, treedef = jax.tree.flatten(params)
  if compress is None:
    flags = [p.ndim >= 2 for p in leaves]
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
      raise ValueError(f'scape: compress entries must be bools, got {flag!r}.')
    if bool(flag) and p.ndim == 0:
      raise ValueError('scape: a scalar leaf cannot be compressed; mark it '
                       'False in compress.')
    layouts.append(
        masks.LeafLayout.create(p.size, num_workers) if bool(flag) else None)
  return _Plan(treedef, tuple(p.shape for p in leaves), tuple(layouts),
               num_workers)


def _varying(x, axis_name):
  """Marks `x` as differing per worker (shard_map's varying type)."""
  if axis_name is None or axis_name in jax.typeof(x).manual_axis_type.varying:
    return x
  return jax.lax.pcast(x, axis_name, to='varying')


def _per_worker(x, leading: int, axis_name, local: bool):
  x = jnp.broadcast_to(x, (leading,) + x.shape)
  return _varying(x, axis_name) if local else x


def scale_by_scape(
    density: float,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    clip_norm: Optional[float] = 1.0,
    axis_name: Optional[str] = 'data',
    compress: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    density_warmup_steps: int = 0,
    mask_encoding: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """SCAPE's exchange and AdamS direction from each worker's local gradients.

  Args:
    density: fraction of each compressed leaf sent per step, in (0, 1].
    b1: decay rate of the first moment.
    b2: weight of the previous first moment squared in the preconditioner.
    eps: term added to the denominator for numerical stability.
    clip_norm: global-norm clip of the reconstructed mean gradient (line 18
      of Algorithm 1); `None` or 0 disables it.
    axis_name: the data-parallel mesh axis; `None` means a single worker.
    compress: tree of bools or a callable `params -> tree`, in optax's `mask`
      style, selecting the leaves to sparsify. Default: leaves with ndim >= 2;
      norm scales and biases stay dense.
    density_warmup_steps: steps of the exponential warmup from density 1.
    mask_encoding: 'auto' (the smaller of the two), 'bitmap' or 'indices'.

  Returns:
    An `optax.GradientTransformationExtraArgs`. `update` accepts the extra
    keyword `density_level`, a static int, the `DensitySchedule.level` of the
    state's count; given, the step holds that level's collectives only.
    Without it every level is compiled into one `lax.switch`.

  References:
    SCAPE paper, Algorithm 1 and Sections IV-A..IV-C, IV-E;
    `docs/design.md` sections 2-4.
  """
  schedule = DensitySchedule(density, density_warmup_steps)
  levels = schedule.levels
  if mask_encoding not in masks.ENCODINGS:
    raise ValueError(f'scape: mask_encoding={mask_encoding!r}; allowed: '
                     f'{masks.ENCODINGS}.')

  def init_fn(params):
    n, local = _axis_context(axis_name, 'init')
    leading = 1 if local else n
    plan = _make_plan(params, compress, n)
    leaves = jax.tree.leaves(params)
    res, msk = [], []
    for p, lay in zip(leaves, plan.layouts):
      if lay is None:
        res.append(optax.MaskedNode())
        msk.append(optax.MaskedNode())
      else:
        res.append(_per_worker(jnp.zeros(p.shape, jnp.float32), leading,
                               axis_name, local))
        ones = masks.pack_bits(jnp.ones((lay.chunk,), bool))  # M_0 = 1
        msk.append(_per_worker(ones, leading, axis_name, local))
    return ScaleByScapeState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        residual=plan.treedef.unflatten(res),
        mask=plan.treedef.unflatten(msk),
        residual_norm=_per_worker(jnp.zeros([], jnp.float32), leading,
                                  axis_name, local),
        density=jnp.ones([], jnp.float32),
        payload_values=jnp.zeros([], jnp.int32),
        bytes_sent=jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None, *, density_level=None, **extra):
    del params, extra
    n, _ = _axis_context(axis_name, 'update')
    plan = _make_plan(updates, compress, n)
    if state.residual_norm.shape != (1,):
      raise ValueError(
          'scape update: per-worker state has leading size '
          f'{state.residual_norm.shape[0]}, expected 1. Pass the state through '
          'shard_map with in_specs=scape_jax.state_partition_specs(state).')
    step = functools.partial(_update_at_level, updates, state, plan=plan)
    if density_level is not None:
      if not 0 <= int(density_level) < len(levels):
        raise ValueError(f'scape: density_level={density_level!r}; allowed: '
                         f'0..{len(levels) - 1} (levels {levels}).')
      return step(int(density_level))
    if len(levels) == 1:
      return step(0)
    return jax.lax.switch(schedule.level(state.count),
                          [functools.partial(step, i)
                           for i in range(len(levels))])

  def _update_at_level(grads, state, level, *, plan):
    f32 = jnp.float32
    g_l = [g.astype(f32) for g in plan.treedef.flatten_up_to(grads)]
    mu_l = plan.treedef.flatten_up_to(state.mu)
    res_l = plan.treedef.flatten_up_to(state.residual)
    own_l = plan.treedef.flatten_up_to(state.mask)
    me = 0 if axis_name is None else jax.lax.axis_index(axis_name)
    next_level = schedule.level(state.count + 1)

    # m~ = b1 m + (1 - b1) g^n + e^n, and each leaf's sparsity at this level.
    mt_l, ks, sparse = [], [], []
    for j, (g, m, e, lay) in enumerate(zip(g_l, mu_l, res_l, plan.layouts)):
      mt = b1 * m + (1.0 - b1) * g
      if lay is not None:
        mt = mt + e[0]
      mt_l.append(mt)
      ks.append(plan.ks(j, levels) if lay is not None else None)
      sparse.append(lay is not None and ks[j][level] < lay.chunk)

    # The mask all-gather: every worker's own chunk mask, one uint32 buffer.
    live = [j for j in range(len(mt_l)) if sparse[j]]
    sends = [_encode_own(own_l[j][0], plan.layouts[j], ks[j][level],
                         mask_encoding) for j in live]
    mask_words = sum(x.shape[0] for x in sends)
    offsets = [None] * len(mt_l)
    if sends:
      buf = jnp.concatenate(sends)
      gathered = (buf[None] if axis_name is None else
                  all_gather_invariant(buf, axis_name))
      for j, part in zip(live, _split(gathered, [x.shape[0] for x in sends])):
        offsets[j] = _decode(part, plan.layouts[j], ks[j][level],
                             mask_encoding)

    # The payload all-reduce: compacted values at M plus the dense leaves.
    payload = [_compact(mt, plan.layouts[j], offsets[j]) if sparse[j] else
               mt.reshape(-1) for j, mt in enumerate(mt_l)]
    flat = jnp.concatenate(payload)
    bbar_flat = flat if axis_name is None else jax.lax.pmean(flat, axis_name)

    # Unpack bbar; reconstruct the mean gradient at M (Eq. 3); new residual.
    bbar_l, gbar_l, new_res = [], [], []
    parts = _split(bbar_flat, [x.size for x in payload])
    for j, (mt, m, vals) in enumerate(zip(mt_l, mu_l, parts)):
      shape, lay = plan.shapes[j], plan.layouts[j]
      if sparse[j]:
        bbar, in_m = _scatter(vals, lay, offsets[j], shape)
        new_res.append(jnp.where(in_m, 0.0, mt)[None])
        gbar = jnp.where(in_m, (bbar - b1 * m) / (1.0 - b1), 0.0)
      else:
        bbar = vals.reshape(shape)
        gbar = (bbar - b1 * m) / (1.0 - b1)
        new_res.append(None if lay is None else jnp.zeros((1,) + shape, f32))
      bbar_l.append(bbar)
      gbar_l.append(gbar)

    if clip_norm is not None:
      gnorm = optax.tree.norm(gbar_l)
      factor = jnp.where((clip_norm > 0) & (gnorm > clip_norm),
                         clip_norm / jnp.maximum(gnorm, 1e-30), 1.0)
      gbar_l = [g * factor for g in gbar_l]
    nu_l = [b2 * m * m + (1.0 - b2) * g * g for m, g in zip(mu_l, gbar_l)]
    count = optax.safe_increment(state.count)
    direction = bias_corrected_direction(bbar_l, nu_l, count, b1=b1, b2=b2,
                                         eps=eps)

    # The next mask: top-k of |m~| in this worker's own chunk (used at t+1).
    new_own = [None if lay is None else _next_own_mask(
        mt, lay, me, ks[j], level, next_level)
               for j, (mt, lay) in enumerate(zip(mt_l, plan.layouts))]

    res_sq = sum((jnp.sum(r * r) for r in new_res if r is not None),
                 jnp.zeros([], f32))
    vary = functools.partial(_varying, axis_name=axis_name)
    stats = _wire_stats(flat.size, mask_words, plan.num_workers)
    new_state = ScaleByScapeState(
        count=count,
        mu=plan.treedef.unflatten(bbar_l),
        residual=plan.treedef.unflatten(
            [optax.MaskedNode() if r is None else vary(r) for r in new_res]),
        mask=plan.treedef.unflatten(
            [optax.MaskedNode() if o is None else vary(o) for o in new_own]),
        residual_norm=vary(jnp.sqrt(res_sq)[None]),
        density=jnp.asarray(levels[level], f32),
        payload_values=jnp.asarray(flat.size, jnp.int32),
        bytes_sent=jnp.asarray(stats, f32))
    dtypes = [g.dtype for g in plan.treedef.flatten_up_to(grads)]
    direction = [d.astype(dt) for d, dt in zip(direction, dtypes)]
    return plan.treedef.unflatten(direction), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _split(flat: jax.Array, sizes: Sequence[int]) -> list:
  """Consecutive slices of `flat` along its last axis."""
  bounds = np.cumsum([0] + list(sizes))
  return [flat[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _encode_own(own: jax.Array, lay: masks.LeafLayout, k: int,
                encoding: str) -> jax.Array:
  """This worker's chunk bitmap as sent: the bitmap or k offsets (uint32)."""
  if lay.encoding(k, encoding) == 'bitmap':
    return own
  offs = masks.bits_to_offsets(masks.unpack_bits(own, lay.chunk), k)
  return jax.lax.bitcast_convert_type(offs, jnp.uint32)


def _decode(part: jax.Array, lay: masks.LeafLayout, k: int,
            encoding: str) -> jax.Array:
  """Gathered masks [N, words] -> ascending offsets int32[N, k] per chunk."""
  if lay.encoding(k, encoding) == 'bitmap':
    return masks.bits_to_offsets(masks.unpack_bits(part, lay.chunk), k)
  return jax.lax.bitcast_convert_type(part, jnp.int32)


def _compact(mt: jax.Array, lay: masks.LeafLayout,
             offsets: jax.Array) -> jax.Array:
  """The N*k values of m~ at the mask, chunk by chunk."""
  return jnp.take_along_axis(lay.to_chunks(mt), offsets, axis=1).reshape(-1)


def _scatter(values: jax.Array, lay: masks.LeafLayout, offsets: jax.Array,
             shape) -> tuple:
  """Compacted values -> (full-shape array zero outside M, bool mask M)."""
  rows = jnp.arange(lay.num_chunks)[:, None]
  full = jnp.zeros((lay.num_chunks, lay.chunk), values.dtype)
  full = full.at[rows, offsets].set(values.reshape(offsets.shape))
  in_m = jnp.zeros((lay.num_chunks, lay.chunk), bool).at[rows, offsets].set(
      True)
  return lay.from_chunks(full, shape), lay.from_chunks(in_m, shape)


def _next_own_mask(mt: jax.Array, lay: masks.LeafLayout, me, ks: tuple,
                   level: int, next_level: jax.Array) -> jax.Array:
  """Top-k of |m~| in chunk `me`, k of the next step's level: uint32[1, w].

  `ks[level]` (static) is the top-k width; levels never increase, so the
  next step's k (traced) is a prefix of it.
  """
  if min(ks) == lay.chunk:  # dense at every level
    bits = jnp.ones((lay.chunk,), bool)
  else:
    mine = jnp.abs(jax.lax.dynamic_index_in_dim(lay.to_chunks(mt), me, 0,
                                                False))
    valid = me * lay.chunk + jnp.arange(lay.chunk) < lay.size
    k_next = jnp.asarray(ks, jnp.int32)[next_level]
    bits = masks.chunk_topk_bits(mine, valid, ks[level], k_next)
  return masks.pack_bits(bits)[None]


def _wire_stats(payload_values: int, mask_words: int, n: int) -> float:
  """Bytes one worker sends per step: payload all-reduce + mask all-gather."""
  return (comm.ring_all_reduce_bytes(4 * payload_values, n) +
          comm.ring_all_gather_bytes(4 * mask_words * n, n))


def scape(
    learning_rate: ScalarOrSchedule,
    *,
    density: float,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: Optional[float] = 1.0,
    axis_name: Optional[str] = 'data',
    compress: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    density_warmup_steps: int = 0,
    mask_encoding: str = 'auto',
    weight_decay_mask: Optional[Union[Any, Callable[[optax.Params],
                                                    Any]]] = None,
) -> optax.GradientTransformationExtraArgs:
  """SCAPE: `scale_by_scape`, then decoupled weight decay and the learning rate.

  `w -= lr * (u + weight_decay * w)`, where `u` is the AdamS direction built
  from the sparsified first moment. Call `update` inside `shard_map` with the
  worker's local gradients; it performs the data-parallel exchange itself.
  With `optax.inject_hyperparams`, pass
  `static_args=('density', 'density_warmup_steps')`.

  Args:
    learning_rate: a float or an optax schedule.
    density: fraction of each compressed leaf sent per step, in (0, 1].
    b1, b2, eps, clip_norm, axis_name, compress, density_warmup_steps,
      mask_encoding: see `scale_by_scape`.
    weight_decay: decoupled weight-decay strength.
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
                     mask_encoding=mask_encoding),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def _is_scape_state(x) -> bool:
  return isinstance(x, ScaleByScapeState)


def state_partition_specs(opt_state, axis_name: Optional[str] = 'data'):
  """PartitionSpecs for an optimizer state holding `ScaleByScapeState`s.

  Per-worker fields are split over `axis_name` along their leading worker
  axis; everything else is replicated. Works on concrete or abstract states.
  """

  def specs(node):
    if not _is_scape_state(node):
      return jax.tree.map(lambda _: P(), node)
    return node._replace(**{
        f: jax.tree.map(
            lambda _: P(axis_name) if f in PER_WORKER_FIELDS else P(),
            getattr(node, f)) for f in node._fields
    })

  return jax.tree.map(specs, opt_state, is_leaf=_is_scape_state)


def scape_stats(opt_state) -> dict:
  """The statistics of the first `ScaleByScapeState` in `opt_state`, or {}.

  `residual_norm` is per worker (a vector over the global state's workers).
  """
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_scape_state)
           if _is_scape_state(s)]
  if not found:
    return {}
  s = found[0]
  return {
      'density': s.density,
      'payload_values': s.payload_values,
      'bytes_sent': s.bytes_sent,
      'residual_norm': s.residual_norm,
  }
