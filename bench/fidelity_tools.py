"""Study-only optimizers and probes for `bench/fidelity.py`.

Nothing here is a method to train with; it lives in `bench/` for that reason:

* `topk_error_feedback`: top-k sparsification of the (already averaged)
  gradient with error feedback, the raw-gradient compressor of the paper's
  Figure 3. It averages densely first (the wire is not the point of Figure 3:
  the staleness of error feedback is), so it sends no fewer bytes than AdamW.
* `first_moment_overlap`: wraps AdamS and records, per layer, the overlap of
  the top-k masks of |m| at adjacent steps (Figure 6).
* `scape_probe`: wraps `scale_by_scape` and records what the diagnosis needs:
  the mask in force (one extra all-gather), the freshly selected and retained
  coordinates, the size of their steps, how often and how late each
  coordinate is selected, and the cosine of the update to AdamS's update on
  the same mean gradient (one extra dense all-reduce). The probe changes no
  update: a probed run follows the same trajectory as the plain one.

`register_study_methods()` adds them to the method registry so that the
trainer runs them like any method (`optimizer.name=probe_scape`, ...).
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm import masks
from scape_jax.comm.collectives import all_gather_invariant
from scape_jax.comm.collectives import clip_by_global_norm
from scape_jax.comm.collectives import pmean_gradients
from scape_jax.optim import _common
from scape_jax.optim import _scape as scape_lib
from scape_jax.optim._interleave import interleave_named
from scape_jax.optim import scale_by_adams
from scape_jax.train import methods


def _compressed(leaf) -> bool:
  return leaf.ndim >= 2  # the paper compresses neither norms nor biases


def _k(density: float, size: int) -> int:
  return masks.chunk_k(density, size)


def _topk_bits(x: jax.Array, k: int) -> jax.Array:
  """bool[shape]: the k largest |x| of the whole leaf (ties: lower index)."""
  _, idx = jax.lax.top_k(jnp.abs(x).reshape(-1), k)
  return jnp.zeros(x.size, bool).at[idx].set(True).reshape(x.shape)


def _norm(leaves) -> jax.Array:
  return jnp.sqrt(sum((jnp.sum(jnp.square(x)) for x in leaves),
                      jnp.zeros([], jnp.float32)))


def _names(tree) -> list:
  """'layers.0.attn.q_proj.kernel'-style names of the leaves of `tree`."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return ['.'.join(str(getattr(k, 'key', getattr(k, 'idx', k)))
                   for k in path) for path, _ in paths]


# ----------------------------------------------------------------------------
# Figure 3: top-k gradient sparsification with error feedback.


class TopKErrorFeedbackState(NamedTuple):
  """State of `topk_error_feedback`."""
  residual: optax.Updates  # e: gradient not applied yet; zeros while dense.
  sent_norm: jax.Array  # ||TopK(g + e)|| of the last step (||g|| while dense).
  residual_norm: jax.Array  # ||e|| after the last step.
  count: jax.Array  # updates so far (seeds rule='random')


RULES = ('pending', 'current', 'random')


def topk_error_feedback(rule: str = 'pending', step_scale: float = 1.0
                        ) -> optax.GradientTransformationExtraArgs:
  """Keeps the top `density` of |g + e| per leaf; the rest waits in e.

  `update(..., density=d)` takes the density in force as a static keyword:
  at 1 (the default) the updates pass through (the dense phase); below 1 it
  returns `TopK(g + e)` and keeps `g + e - TopK(g + e)` in the residual, with
  k = ceil(d * size) per leaf. Leaves with fewer than 2 dimensions pass
  through. Put it after the mean gradient to sparsify gradients (Figure 3),
  or after an optimizer's direction to sparsify updates.

  Args:
    rule: which k entries are sent (`RULES`): 'pending' the largest |g + e|
      (the default, above); 'current' the largest |g|, this step's input
      alone; 'random' k drawn uniformly, anew each step. Either way the
      entries sent carry g + e and leave nothing in e.
    step_scale: the entries sent are multiplied by this (1: as they are).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    Seide et al. 2014 and Stich et al. 2018 (error feedback); SCAPE paper,
    Section II-B and Figure 3.
  """
  if rule not in RULES:
    raise ValueError(f'topk_error_feedback: rule={rule!r}; allowed: {RULES}.')

  def init_fn(params):
    zero = jnp.zeros([], jnp.float32)
    return TopKErrorFeedbackState(
        residual=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                              params),
        sent_norm=zero, residual_norm=zero, count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, density: float = 1.0,
                **extra):
    del params, extra
    _k(density, 1)  # validates density
    grads = [g.astype(jnp.float32) for g in jax.tree.leaves(updates)]
    residual = jax.tree.leaves(state.residual)
    if density < 1.0:
      sent, residual = [], list(residual)
      for j, (g, e) in enumerate(zip(grads, residual)):
        acc = g + e
        if _compressed(g):
          score = {'pending': acc, 'current': g}.get(rule)
          if score is None:  # 'random'
            key = jax.random.fold_in(jax.random.key(j), state.count)
            score = jax.random.uniform(key, g.shape)
          keep = _topk_bits(score, _k(density, g.size))
          sent.append(jnp.where(keep, step_scale * acc, 0.0))
          residual[j] = jnp.where(keep, 0.0, acc)
        else:
          sent.append(acc)
          residual[j] = jnp.zeros_like(acc)
    else:
      sent = grads
    treedef = jax.tree.structure(updates)
    out = [s.astype(u.dtype) for s, u in zip(sent, jax.tree.leaves(updates))]
    return treedef.unflatten(out), TopKErrorFeedbackState(
        residual=treedef.unflatten(residual), sent_norm=_norm(sent),
        residual_norm=_norm(residual),
        count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Figure 6: overlap of adjacent first-moment top-k masks under dense AdamS.


class FirstMomentOverlapState(NamedTuple):
  """State of `first_moment_overlap`."""
  inner: Any  # the wrapped `ScaleByAdamSState`
  previous: optax.Updates  # bool top-k mask of |m| after the last step
  overlap: dict  # leaf name -> |M_t & M_{t-1}| / k after the last step


def first_moment_overlap(inner: optax.GradientTransformation,
                         density: float = 0.1) -> optax.GradientTransformation:
  """Records the overlap of adjacent top-`density` masks of |m| per leaf.

  `inner` must keep the first moment in `state.mu` (`scale_by_adams`).
  """

  def init_fn(params):
    names = [n for n, p in zip(_names(params), jax.tree.leaves(params))
             if _compressed(p)]
    return FirstMomentOverlapState(
        inner=inner.init(params),
        previous=jax.tree.map(lambda p: jnp.zeros(p.shape, bool), params),
        overlap={n: jnp.zeros([], jnp.float32) for n in names})

  def update_fn(updates, state, params=None):
    out, inner_state = inner.update(updates, state.inner, params)
    current, overlap = [], {}
    for name, m, prev in zip(_names(updates), jax.tree.leaves(inner_state.mu),
                             jax.tree.leaves(state.previous)):
      if not _compressed(m):
        current.append(prev)
        continue
      k = _k(density, m.size)
      bits = _topk_bits(m, k)
      overlap[name] = jnp.sum(bits & prev).astype(jnp.float32) / k
      current.append(bits)
    treedef = jax.tree.structure(updates)
    return out, FirstMomentOverlapState(inner_state,
                                        treedef.unflatten(current), overlap)

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# SCAPE diagnostics.


class ScapeProbeState(NamedTuple):
  """State of `scape_probe`: the wrapped SCAPE state and what it measured."""
  inner: Any  # the wrapped `ScaleByScapeState`
  adams: Any  # `ScaleByAdamSState` fed the same (clipped) mean gradients
  previous: optax.Updates  # bool: the global mask M_{t-1}; all True at first
  selected: optax.Updates  # int32: steps each coordinate was in M
  last: optax.Updates  # int32: last step it was in M (0: never)
  stats: dict  # scalars of the last step (see `_probe_stats`)


def scape_probe(inner: optax.GradientTransformationExtraArgs, *,
                b1: float, b2: float, eps: float,
                clip_norm: Optional[float], axis_name: Optional[str]
                ) -> optax.GradientTransformationExtraArgs:
  """Wraps `scale_by_scape` (same b1, b2, eps, clip, axis) with diagnostics.

  Per step it reconstructs the global mask M_t in force from the workers'
  chunk masks in the inner state, runs AdamS on the clipped mean gradient
  beside it, and records `_probe_stats`. The updates are the inner ones.
  """
  adams = scale_by_adams(b1=b1, b2=b2, eps=eps)

  def init_fn(params):
    ones = jax.tree.map(lambda p: jnp.ones(p.shape, bool), params)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int32), params)
    return ScapeProbeState(
        inner=inner.init(params), adams=adams.init(params),
        previous=ones, selected=zeros, last=zeros,
        stats={k: jnp.zeros([], jnp.float32) for k in _STAT_KEYS} |
        {f'selected/{b[0]}': jnp.zeros([], jnp.float32)
         for b in SELECTION_BINS} |
        {f'overlap/{n}': jnp.zeros([], jnp.float32)
         for n, p in zip(_names(params), jax.tree.leaves(params))
         if _compressed(p)})

  def update_fn(updates, state, params=None, **extra):
    in_mask = _mask_in_force(updates, state.inner, axis_name)
    out, inner_state = inner.update(updates, state.inner, params, **extra)
    mean = updates if axis_name is None else jax.lax.pmean(updates, axis_name)
    if clip_norm:
      mean = optax.clip_by_global_norm(clip_norm).update(mean, None)[0]
    reference, adams_state = adams.update(mean, state.adams)
    step = inner_state.count
    flat = jax.tree.leaves
    selected = jax.tree.map(lambda s, m: s + m.astype(jnp.int32),
                            state.selected, in_mask)
    stats = _probe_stats(_names(updates), flat(out), flat(reference),
                         flat(in_mask), flat(state.previous),
                         flat(state.last), step, b1, b2)
    stats.update(_selection_histogram(flat(selected), step))
    last = jax.tree.map(lambda t, m: jnp.where(m, step, t), state.last,
                        in_mask)
    return out, ScapeProbeState(inner_state, adams_state, in_mask,
                                selected, last, stats)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_STAT_KEYS = ('fresh_frac', 'step_fresh', 'step_kept', 'step_fresh_pred',
              'staleness_fresh', 'first_time_frac', 'move_scape',
              'move_adams', 'cos_adams', 'cos_adams_compressed',
              'ever_selected')


def _mask_in_force(updates, scape_state, axis_name) -> Any:
  """The global mask M_t of this step: the union of the workers' chunk masks."""
  n = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  out = []
  for g, own in zip(jax.tree.leaves(updates),
                    jax.tree.leaves(scape_state.mask,
                                    is_leaf=lambda x: isinstance(
                                        x, optax.MaskedNode))):
    if isinstance(own, optax.MaskedNode):
      out.append(jnp.ones(g.shape, bool))
      continue
    layout = masks.LeafLayout.create(g.size, n)
    words = own if axis_name is None else all_gather_invariant(own[0],
                                                               axis_name)
    bits = masks.unpack_bits(words, layout.chunk_size)
    out.append(layout.from_chunks(bits, g.shape))
  return jax.tree.structure(updates).unflatten(out)


# Bins of the share of steps a coordinate was in M: (label, low, high].
SELECTION_BINS = (('never', -1.0, 0.0), ('<=2%', 0.0, 0.02),
                  ('2-10%', 0.02, 0.1), ('10-50%', 0.1, 0.5),
                  ('>50%', 0.5, 1.0))


def _selection_histogram(selected, step) -> dict:
  """Fraction of compressed coordinates per `SELECTION_BINS` bin."""
  counts = [s for s in selected if s.ndim >= 2]
  size = float(sum(c.size for c in counts))
  t = jnp.maximum(step, 1).astype(jnp.float32)
  out = {}
  for label, low, high in SELECTION_BINS:
    n = sum(jnp.sum((c / t > low) & (c / t <= high)) for c in counts)
    out[f'selected/{label}'] = (n / size).astype(jnp.float32)
  return out


def _cos(a, b) -> jax.Array:
  dot = sum((jnp.sum(x * y) for x, y in zip(a, b)), jnp.zeros([], jnp.float32))
  return dot / jnp.maximum(_norm(a) * _norm(b), 1e-30)


def _masked_mean(values, where) -> jax.Array:
  num = sum((jnp.sum(jnp.where(w, v, 0.0)) for v, w in zip(values, where)),
            jnp.zeros([], jnp.float32))
  den = sum((jnp.sum(w) for w in where), jnp.zeros([], jnp.int32))
  return num / jnp.maximum(den, 1).astype(jnp.float32)


def _probe_stats(names, out, reference, in_mask, previous, last, step, b1,
                 b2) -> dict:
  """Per-step diagnostics over the compressed leaves (and `cos_adams` all)."""
  comp = [j for j, u in enumerate(out) if _compressed(u)]
  pick = lambda xs: [xs[j] for j in comp]  # noqa: E731
  u, ref, now, prev, last = map(pick, (out, reference, in_mask, previous,
                                       last))
  mag = [jnp.abs(x.astype(jnp.float32)) for x in u]
  fresh = [m & ~p for m, p in zip(now, prev)]
  kept = [m & p for m, p in zip(now, prev)]
  stale = [(step - t).astype(jnp.float32) for t in last]
  seen = [t > 0 for t in last]
  t = step.astype(jnp.float32)
  size = float(sum(x.size for x in u))
  stats = {
      'fresh_frac': sum(jnp.sum(f) for f in fresh) /
                    jnp.maximum(sum(jnp.sum(m) for m in now), 1),
      'step_fresh': _masked_mean(mag, fresh),
      'step_kept': _masked_mean(mag, kept),
      'step_fresh_pred': (1 - b1) / jnp.sqrt(1 - b2) *
                         jnp.sqrt(1 - b2**t) / (1 - b1**t),
      'staleness_fresh': _masked_mean(stale, [f & s for f, s in
                                              zip(fresh, seen)]),
      'first_time_frac': _masked_mean([(~s).astype(jnp.float32)
                                       for s in seen], fresh),
      'move_scape': sum(jnp.sum(x) for x in mag) / size,
      'move_adams': sum(jnp.sum(jnp.abs(x)) for x in ref) / size,
      'cos_adams': _cos([x.astype(jnp.float32) for x in out], reference),
      'cos_adams_compressed': _cos([x.astype(jnp.float32) for x in u], ref),
      'ever_selected': sum(jnp.sum(s | m) for s, m in zip(seen, now)) / size,
  }
  for j, i in enumerate(comp):
    stats[f'overlap/{names[i]}'] = (
        jnp.sum(kept[j]) / jnp.maximum(jnp.sum(now[j]), 1)).astype(
            jnp.float32)
  return {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}


# ----------------------------------------------------------------------------
# Registry entries, so that the trainer runs the study's methods.


def _find(opt_state, kind):
  found = [s for s in jax.tree.leaves(opt_state,
                                      is_leaf=lambda x: isinstance(x, kind))
           if isinstance(s, kind)]
  return found[0] if found else None


def _probe_stats_of(opt_state) -> dict:
  probe = _find(opt_state, ScapeProbeState)
  return dict(probe.stats, **scape_lib.scape_stats(probe.inner))


def _build_probe_scape(cfg, section, lr, ctx) -> methods.Built:
  """SCAPE (faithful or a variant, from `optimizer.scape`) under the probe."""
  del section
  s = cfg.scape
  if s.dense_leaves:
    raise ValueError(f'probe_scape: optimizer.scape.dense_leaves='
                     f"{s.dense_leaves!r}; the probe allows only ''.")
  schedule = scape_lib.DensitySchedule(s.density, s.density_warmup_steps)
  clip = cfg.clip_norm if cfg.clip_norm > 0 else None
  inner = scape_lib.scale_by_scape(
      schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, clip_norm=clip,
      axis_name=ctx.axis_name, mask_encoding=s.mask_encoding,
      variant=s.variant)
  tx = optax.chain(
      scape_probe(inner, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, clip_norm=clip,
                  axis_name=ctx.axis_name),
      optax.add_decayed_weights(cfg.weight_decay),
      optax.scale_by_learning_rate(lr))
  tx = interleave_named(tx, s.interleaved_leaves, ctx.axis_name,
                        variant=s.variant)
  return methods.Built(tx, lambda step: {'density_level': schedule.level(step)})


def _overlap_stats(opt_state) -> dict:
  return {f'overlap/{k}': v for k, v in
          _find(opt_state, FirstMomentOverlapState).overlap.items()}


def _dense_prefix(cfg, ctx) -> list:
  clip = ([clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0
          else [])
  return [pmean_gradients(ctx.axis_name)], clip


def _build_overlap_adams(cfg, section, lr, ctx) -> methods.Built:
  del section
  mean, clip = _dense_prefix(cfg, ctx)
  return methods.Built(optax.chain(
      *mean, *clip,
      first_moment_overlap(scale_by_adams(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)),
      optax.add_decayed_weights(cfg.weight_decay),
      optax.scale_by_learning_rate(lr)))


def _topk_stats(opt_state) -> dict:
  state = _find(opt_state, TopKErrorFeedbackState)
  return {'topk_grad_norm': state.sent_norm,
          'residual_norm': state.residual_norm}


def register_topk(base: str, stage: str, density: float, *,
                  switch_step: Optional[int] = None,
                  warmup_steps: Optional[int] = None, rule: str = 'pending',
                  step_scale: float = 1.0) -> str:
  """Registers `base` (adamw|adams) with top-k error feedback; returns its name.

  stage='gradient' (Figure 3): mean gradient -> `topk_error_feedback` ->
  clip -> base. stage='update' (adams only): the mean gradient and AdamS's
  dense state, but only the top-k of the pending *updates* are applied per
  step; the rest waits in the residual. That is an oracle: the information
  of dense AdamS, the sparse updates of SCAPE.

  The density is 1 before `switch_step` updates and `density` from then on,
  or, with `warmup_steps`, SCAPE's `DensitySchedule(density, warmup_steps)`.
  `rule` and `step_scale` (stage='update' only) are `topk_error_feedback`'s:
  the oracle's choice of coordinates and the size of their steps, varied to
  test what the oracle assumes.
  """
  if stage != 'update' and (rule, step_scale) != ('pending', 1.0):
    raise ValueError(f'register_topk: rule={rule!r}, step_scale={step_scale}'
                     " are for stage='update' only.")
  if (switch_step is None) == (warmup_steps is None):
    raise ValueError('give exactly one of switch_step and warmup_steps')
  when = (f'from{switch_step}' if warmup_steps is None else
          f'warmup{warmup_steps}')
  name = f'topk{density:g}_{stage}_{base}_{when}'
  if rule != 'pending':
    name += f'_{rule}'
  if step_scale != 1.0:
    name += f'_x{step_scale:g}'
  if name in methods.REGISTRY:
    return name
  if warmup_steps is None:
    level = lambda step: density if step >= switch_step else 1.0  # noqa: E731
  else:
    schedule = scape_lib.DensitySchedule(density, warmup_steps)
    level = lambda step: schedule.levels[schedule.level(step)]  # noqa: E731

  def build(cfg, section, lr, ctx):
    del section
    mean, clip = _dense_prefix(cfg, ctx)
    sparsify = [topk_error_feedback(rule, step_scale)]
    scale = [optax.add_decayed_weights(cfg.weight_decay),
             optax.scale_by_learning_rate(lr)]
    if base == 'adamw':
      opt = [optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay)]
    else:
      opt = [scale_by_adams(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
             *(sparsify if stage == 'update' else []), *scale]
    head = sparsify if stage == 'gradient' else []
    tx = optax.chain(*mean, *head, *clip, *opt)
    return methods.Built(tx, lambda step: {'density': level(step)})

  methods.register(methods.MethodSpec(
      name, build, stats=_topk_stats,
      summary=f'{base} with top-{density:g} {stage} sparsification and '
      f'error feedback ({when}; study only)'))
  return name


def register_study_methods() -> None:
  """Adds `probe_scape` and `overlap_adams` to the registry (idempotent)."""
  if 'probe_scape' not in methods.REGISTRY:
    methods.register(methods.MethodSpec(
        'probe_scape', _build_probe_scape, stats=_probe_stats_of,
        summary='SCAPE (optimizer.scape) with the fidelity probe (study only)'))
  if 'overlap_adams' not in methods.REGISTRY:
    methods.register(methods.MethodSpec(
        'overlap_adams', _build_overlap_adams, stats=_overlap_stats,
        summary='AdamS recording first-moment mask overlap (study only)'))
