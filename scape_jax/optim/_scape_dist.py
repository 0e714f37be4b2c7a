"""SCAPE's distributed-optimizer mode (Algorithm 2, Section IV-D).

The first moment is split over the data axis the way the chunks are: worker
n keeps m only on chunk n of every compressed leaf (4W/N bytes instead of
4W), updates only that chunk, and the k values per chunk of the new
direction travel in one sparse all-gather. Outside the mask the direction
is zero, so every worker computes the update there (pure weight decay,
`w (1 - lr wd)`) from its own full fp32 copy of the parameters; the chain
after this transformation is Algorithm 1's.

Worker n cannot form m~ = b1 m + (1 - b1) g^n + e^n outside its chunk, so
the residual is kept in two parts with the same sum as Algorithm 1's e^n:

* `residual` (local, per worker, full shape): (1 - b1) g^n + its previous
  value, outside the mask; it may live in host memory (`OFFLOADED_FIELDS`);
* `carry` (synchronized, identical on every worker, so kept by the chunk's
  owner only): b1 m + its previous value, outside the mask.

The payload all-reduce carries the local parts at the mask; the owner adds
the synchronized part to its chunk. This equals Algorithm 1 up to the order
of the additions (checked within 1e-6 relative in `tests/test_alg2.py`).

Per step: Algorithm 1's mask all-gather and payload all-reduce, plus the
all-gather of k direction values per chunk and one scalar all-reduce (the
clip norm). The state is made for the data-axis size it was created on.
"""

import functools
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm import masks
from scape_jax.comm.axes import DATA
from scape_jax.comm.collectives import all_gather_invariant, varying
from scape_jax.optim import _common
from scape_jax.optim import _exchange
from scape_jax.optim import _scape
from scape_jax.optim import _norms
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule
from scape_jax.optim._scape import CompressionPlan, DensitySchedule


class ScaleByScapeDistState(NamedTuple):
  """State of `scale_by_scape_dist`."""
  count: jax.Array  # int32: completed updates.
  mu_dense: optax.Updates  # m of the dense leaves; MaskedNode on compressed.
  mu_own: optax.Updates  # Per worker: m on its chunk, f32[W, c].
  carry: optax.Updates  # Per worker: synchronized residual on its chunk.
  residual: optax.Updates  # Per worker: local residual, f32[W, *shape].
  mask: optax.Updates  # Per worker: own chunk bitmap, uint32[W, words].
  residual_norm: jax.Array  # Per worker: ||local residual||, f32[W].
  density: jax.Array  # f32: density in force at the last step.

  PER_WORKER_FIELDS = ('mu_own', 'carry', 'residual', 'mask',
                       'residual_norm')
  OFFLOADED_FIELDS = ('residual',)


def scale_by_scape_dist(
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
) -> optax.GradientTransformationExtraArgs:
  """SCAPE's direction with the first moment split over the workers.

  Args: as `scale_by_scape`.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is
    `ScaleByScapeDistState`; `update` takes the static `density_level` as
    `scale_by_scape`'s does.

  Raises (in `update`):
    ValueError: the state was made for another size of `axis_name`.

  References:
    SCAPE paper, Algorithm 2 and Section IV-D; `docs/design.md`.
  """
  # Validation and the density schedule are Algorithm 1's.
  schedule, hyper = _exchange.configure(
      'scape', density, density_warmup_steps, b1=b1, b2=b2, eps=eps,
      clip_norm=clip_norm, axis_name=axis_name, mask_encoding=mask_encoding,
      select=select)

  def init_fn(params):
    n, local = _common.axis_context('scape_dist init', axis_name)
    plan = CompressionPlan.create(params, compress, n)
    per_worker = functools.partial(_common.per_worker,
                                   leading=1 if local else n,
                                   axis_name=axis_name, local=local)
    fields = {f: [] for f in ('mu_dense', 'mu_own', 'carry', 'residual',
                              'mask')}
    for p, layout in zip(jax.tree.leaves(params), plan.layouts):
      dense = layout is None
      c = None if dense else layout.chunk_size
      zeros_c = lambda: per_worker(jnp.zeros((c,), jnp.float32))  # noqa: E731
      fields['mu_dense'].append(jnp.zeros(p.shape, jnp.float32) if dense
                                else optax.MaskedNode())
      fields['mu_own'].append(optax.MaskedNode() if dense else zeros_c())
      fields['carry'].append(optax.MaskedNode() if dense else zeros_c())
      fields['residual'].append(optax.MaskedNode() if dense else per_worker(
          jnp.zeros(p.shape, jnp.float32)))
      fields['mask'].append(optax.MaskedNode() if dense else per_worker(
          masks.ones_words(c)))  # M_0 = 1
    return ScaleByScapeDistState(
        count=jnp.zeros([], jnp.int32),
        residual_norm=per_worker(jnp.zeros([], jnp.float32)),
        density=jnp.ones([], jnp.float32),
        **{f: plan.treedef.unflatten(v) for f, v in fields.items()})

  @_common.passes_empty_trees
  def update_fn(updates, state, params=None, *, density_level=None,
                next_dense=False, **extra):
    del params, extra
    n, _ = _common.axis_context('scape_dist update', axis_name)
    plan = CompressionPlan.create(updates, compress, n)
    _check_chunking(plan, state, n, axis_name)
    _common.check_per_worker_state('scape_dist update', state.residual_norm)
    return _exchange.at_level(_update_at_level, updates, state, plan, hyper,
                              schedule, density_level, next_dense)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_chunking(plan: CompressionPlan, state, n: int, axis_name) -> None:
  """Raises unless the state's chunks are those of `n` workers."""
  own = plan.treedef.flatten_up_to(state.mu_own)
  for j, (layout, m) in enumerate(zip(plan.layouts, own)):
    if layout is None or m.shape[-1] == layout.chunk_size:
      continue
    made_for = m.shape[0] * n
    raise ValueError(
        f'scape_dist: leaf {j} of shape {plan.shapes[j]} is split into chunks '
        f'of {m.shape[-1]} elements in the state, made for {made_for} '
        f'workers, but axis {axis_name!r} has {n} workers (chunks of '
        f'{layout.chunk_size}). The state (m split into chunks, a residual '
        'per worker) only runs on the data-axis size it was made for; use a '
        'mesh with that size.')


def _own(x: jax.Array, worker) -> jax.Array:
  """Row `worker` of `x` [N, ...]."""
  return jax.lax.dynamic_index_in_dim(x, worker, 0, False)


def _update_at_level(grads, state: ScaleByScapeDistState, level: int, *,
                     plan: CompressionPlan, hyper, schedule: DensitySchedule,
                     next_level, live=None):
  """One update whose payload has the k of density level `level` (with
  `live`, the traced level in force: its k, `level`'s buffers)."""
  flat = plan.treedef.flatten_up_to
  grad_leaves = [g.astype(jnp.float32) for g in flat(grads)]
  k_levels = _exchange.k_per_level(plan, hyper)
  k_now = [None if ks is None else ks[level] for ks in k_levels]
  worker = (0 if hyper.axis_name is None else
            jax.lax.axis_index(hyper.axis_name))
  b1 = hyper.b1

  local, sync = _moment_parts(grad_leaves, state, plan, b1, flat)
  offsets = _exchange.exchange_masks(flat(state.mask), plan, k_now, hyper,
                                     k_live=_exchange.live_k(k_levels, live))
  mean = _exchange.exchange_payload(local, plan, offsets, hyper.axis_name)
  own = _own_chunks(local, sync, mean, offsets, plan, worker, b1,
                    flat(state.mu_own), flat(state.mu_dense))
  gbar = _clip([o.gbar for o in own], plan, hyper)
  count = optax.safe_increment(state.count)
  old_mu = [md if lay is None else mo[0]
            for md, mo, lay in zip(flat(state.mu_dense), flat(state.mu_own),
                                   plan.layouts)]
  nu = [hyper.b2 * m * m + (1.0 - hyper.b2) * g * g
        for m, g in zip(old_mu, gbar)]
  direction = _common.bias_corrected_direction(
      [o.bbar for o in own], nu, count, b1=b1, b2=hyper.b2, eps=hyper.eps)
  direction = _gather_direction(direction, own, offsets, plan, hyper.axis_name)

  vary = functools.partial(varying, axis_name=hyper.axis_name)
  next_masks = _common.next_chunk_masks(  # Algorithm 1's, from own m~
      lambda j: (own[j].moment, plan.layouts[j].num_valid(worker)),
      plan.layouts, k_levels, level, next_level, hyper.select)
  per_leaf = lambda fn: plan.treedef.unflatten(  # noqa: E731
      [optax.MaskedNode() if lay is None else vary(fn(o, m))
       for o, m, lay in zip(own, next_masks, plan.layouts)])
  new_state = ScaleByScapeDistState(
      count=count,
      mu_dense=plan.treedef.unflatten(
          [o.bbar if lay is None else optax.MaskedNode()
           for o, lay in zip(own, plan.layouts)]),
      mu_own=per_leaf(lambda o, _: o.bbar[None]),
      carry=per_leaf(lambda o, _: o.carry[None]),
      residual=per_leaf(lambda o, _: o.residual[None]),
      mask=per_leaf(lambda _, m: m),
      # A leaf sent whole keeps constant zeros, whose norm XLA would fold
      # element by element: left out.
      residual_norm=vary(_norms.global_norm(
          [None if off is None else o.residual
           for o, off in zip(own, offsets)])[None]),
      density=_exchange.density_at(hyper, level, live))
  direction = [d.astype(g.dtype) for d, g in zip(direction, flat(grads))]
  return plan.treedef.unflatten(direction), new_state


def _moment_parts(grads, state, plan, b1, flat) -> tuple:
  """m~ = sync + local: local (full shape) and sync (own chunk, or None).

  Compressed leaves: local = (1 - b1) g^n + residual, sync = b1 m + carry on
  the own chunk. Dense leaves: local = b1 m + (1 - b1) g^n, as Algorithm 1.
  """
  local, sync = [], []
  for g, md, mo, cr, e, layout in zip(grads, flat(state.mu_dense),
                                      flat(state.mu_own), flat(state.carry),
                                      flat(state.residual), plan.layouts):
    if layout is None:
      local.append(b1 * md + (1.0 - b1) * g)
      sync.append(None)
    else:
      local.append((1.0 - b1) * g + e[0])
      sync.append(b1 * mo[0] + cr[0])
  return local, sync


class _Own(NamedTuple):
  """One leaf after the payload: own chunk (compressed) or full (dense)."""
  bbar: jax.Array  # the new m
  gbar: jax.Array  # the mean gradient at the mask
  moment: Optional[jax.Array]  # m~ on the own chunk (the next mask's scores)
  carry: Optional[jax.Array]
  residual: Optional[jax.Array]  # the new local residual (full shape)
  in_own: Optional[jax.Array]  # bool[c]: the mask on the own chunk
  own_offsets: Optional[jax.Array]  # int32[k] of the own chunk, or None


def _own_chunks(local, sync, mean, offsets, plan, worker, b1, mu_own,
                mu_dense) -> list:
  """bbar, gbar, the next carry and residual per leaf (`_Own`)."""
  out = []
  for j, layout in enumerate(plan.layouts):
    if layout is None:
      bbar = mean[j].reshape(plan.shapes[j])
      out.append(_Own(bbar, (bbar - b1 * mu_dense[j]) / (1.0 - b1), None,
                      None, None, None, None))
      continue
    c, shape = layout.chunk_size, plan.shapes[j]
    moment = sync[j] + _own(layout.to_chunks(local[j]), worker)
    if offsets[j] is None:  # every position of every chunk is sent
      in_own, own_offsets = jnp.ones((c,), bool), None
      received = _own(layout.to_chunks(mean[j].reshape(shape)), worker)
      residual = jnp.zeros(shape, jnp.float32)
    else:
      mask = offsets[j]  # the gathered `_exchange.GlobalMask`
      own_offsets = _own(mask.offsets, worker)
      # Zeros of their own per leaf (`masks.own_zeros`): a constant zero
      # array would be shared by the leaves of one chunk size and copied
      # before each scatter into it.
      in_own = masks.own_zeros((c,), bool, own_offsets).at[
          own_offsets].set(True)
      values = _own(mean[j].reshape(mask.offsets.shape), worker)
      received = masks.own_zeros((c,), jnp.float32, own_offsets).at[
          own_offsets].set(values)
      in_mask = layout.from_chunks(masks.unpack_bits(mask.words, c), shape)
      residual = jnp.where(in_mask, 0.0, local[j])
    bbar = jnp.where(in_own, sync[j] + received, 0.0)
    gbar = jnp.where(in_own, (bbar - b1 * mu_own[j][0]) / (1.0 - b1), 0.0)
    out.append(_Own(bbar, gbar, moment, jnp.where(in_own, 0.0, sync[j]),
                    residual, in_own, own_offsets))
  return out


def _clip(gbar, plan, hyper) -> list:
  """Algorithm 1's global-norm clip; own chunks summed over the workers."""
  if hyper.clip_norm is None:
    return gbar
  split = sum((jnp.sum(g * g) for g, lay in zip(gbar, plan.layouts)
               if lay is not None), jnp.zeros([], jnp.float32))
  if hyper.axis_name is not None:
    split = jax.lax.psum(split, hyper.axis_name)
  whole = sum((jnp.sum(g * g) for g, lay in zip(gbar, plan.layouts)
               if lay is None), jnp.zeros([], jnp.float32))
  norm = jnp.sqrt(split + whole)
  clip = hyper.clip_norm
  factor = jnp.where((clip > 0) & (norm > clip),
                     clip / jnp.maximum(norm, 1e-30), 1.0)
  return [g * factor for g in gbar]


def _gather_direction(direction, own, offsets, plan, axis_name) -> list:
  """The sparse all-gather: each owner's direction at its part of the mask.

  Returns the full-shape direction of every leaf, zero outside the mask.
  """
  sent, where = [], []
  for j, (u, o, layout) in enumerate(zip(direction, own, plan.layouts)):
    if layout is None:
      continue
    sent.append(u if o.own_offsets is None else u[o.own_offsets])
    where.append(j)
  if not sent:
    return direction
  buf = jnp.concatenate(sent)
  gathered = (buf[None] if axis_name is None else
              all_gather_invariant(buf, axis_name))
  full = list(direction)
  parts = _exchange.split(gathered, [x.shape[0] for x in sent])
  for j, part in zip(where, parts):
    layout, shape = plan.layouts[j], plan.shapes[j]
    if offsets[j] is None:
      full[j] = layout.from_chunks(part, shape)
    else:
      full[j] = masks.scatter_at(part.reshape(-1), layout,
                                 offsets[j].offsets, shape)
  return full


def scape_dist(
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
    weight_decay_mask: MaskOrFn = None,
) -> optax.GradientTransformationExtraArgs:
  """SCAPE in distributed-optimizer mode: `scale_by_scape_dist`, then
  decoupled weight decay and the learning rate (as `scape`).

  Args: as `scape`.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    SCAPE paper, Algorithm 2; `docs/design.md`.
  """
  return optax.chain(
      scale_by_scape_dist(density, b1=b1, b2=b2, eps=eps, clip_norm=clip_norm,
                          axis_name=axis_name, compress=compress,
                          density_warmup_steps=density_warmup_steps,
                          mask_encoding=mask_encoding, select=select),
      _common.add_decayed_weights('scape_dist', weight_decay,
                                  weight_decay_mask),
      _common.scale_by_learning_rate('scape_dist', learning_rate),
  )


def scape_dist_stats(opt_state) -> dict:
  """The statistics of the first `ScaleByScapeDistState` in `opt_state`, or
  {} (as `scape_stats`; the residual norm is of the local part)."""
  return _common.state_stats(opt_state, ScaleByScapeDistState,
                             ('density', 'residual_norm'))


# ----------------------------------------------------------------------------
# Between the modes (global views, outside shard_map).


def scape_to_dist(state: _scape.ScaleByScapeState, params,
                  compress: MaskOrFn = None) -> ScaleByScapeDistState:
  """Algorithm 1's state as the distributed mode's, with the same numbers.

  m is cut into the chunks (worker n keeps chunk n); each worker's residual
  becomes its local part and the synchronized part starts at zero (only
  their sum matters). `params` (arrays or shapes) and `compress` are those
  the state was made with; its worker count is the state's.
  """
  n = state.residual_norm.shape[0]
  plan = CompressionPlan.create(params, compress, n)
  mu_dense, mu_own, carry = [], [], []
  for m, layout in zip(plan.treedef.flatten_up_to(state.mu), plan.layouts):
    dense = layout is None
    mu_dense.append(m if dense else optax.MaskedNode())
    mu_own.append(optax.MaskedNode() if dense else layout.to_chunks(m))
    carry.append(optax.MaskedNode() if dense else jnp.zeros(
        (n, layout.chunk_size), jnp.float32))
  unflat = plan.treedef.unflatten
  return ScaleByScapeDistState(
      count=state.count, mu_dense=unflat(mu_dense), mu_own=unflat(mu_own),
      carry=unflat(carry), residual=state.residual, mask=state.mask,
      residual_norm=state.residual_norm, density=state.density)


def dist_to_scape(state: ScaleByScapeDistState, params,
                  compress: MaskOrFn = None) -> _scape.ScaleByScapeState:
  """The distributed mode's state as Algorithm 1's: m from its chunks, and
  each worker's residual = its local part + the synchronized part."""
  n = state.residual_norm.shape[0]
  plan = CompressionPlan.create(params, compress, n)
  flat = plan.treedef.flatten_up_to
  mu, residual = [], []
  for j, layout in enumerate(plan.layouts):
    shape = plan.shapes[j]
    if layout is None:
      mu.append(flat(state.mu_dense)[j])
      residual.append(optax.MaskedNode())
      continue
    mu.append(layout.from_chunks(flat(state.mu_own)[j], shape))
    residual.append(flat(state.residual)[j] +
                    layout.from_chunks(flat(state.carry)[j], shape)[None])
  sq = sum((jnp.sum(r * r, axis=tuple(range(1, r.ndim))) for r in residual
            if not isinstance(r, optax.MaskedNode)), jnp.zeros((n,)))
  return _scape.ScaleByScapeState(
      count=state.count, mu=plan.treedef.unflatten(mu),
      residual=plan.treedef.unflatten(residual), mask=state.mask,
      residual_norm=jnp.sqrt(sq), density=state.density)
