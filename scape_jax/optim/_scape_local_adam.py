"""SCAPE with per-worker Adam: sparse updates with error feedback, on
Algorithm 1's wire.

Each worker runs Adam on its own gradient of every compressed leaf (local
moments m, v and w, the moving average of m^2) and keeps the updates it has
not applied yet as its residual: error feedback on the *update*, where
Algorithm 1 feeds back the first moment. Each step the payload is that
pending update at the mask, and its mean over the workers is the step there.

* The direction. v alone is the worker's gradient's second moment, noisier
  than the mean gradient's that AdamS divides by. `smooth_v_mean` estimates
  the mean gradient's from v and w, so u = m^ / (sqrt(v_mean) + eps) has
  AdamS's size.
* The mask. Worker n ranks chunk (n + t) mod N at step t (ownership rotates,
  so no chunk is ranked by one worker's noise for long) and uses the mask
  in the step that chooses it (the payload's all-reduce waits for the masks'
  all-gather). It ranks by the posterior mean of the workers' mean update,
  |u| / (tau2 + noise) (`shrunk_score`), so a coordinate's noise alone does
  not win it a place.

Leaves that are never compressed (norms, biases) take Algorithm 1's dense
path (m~ exchanged whole, AdamS's direction). The masks, the payload and
the collectives are Algorithm 1's, byte for byte (`_exchange`). The
measurements behind each choice are in docs/results.md and docs/design.md
("What was tried").
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
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule
from scape_jax.optim._density import DensitySchedule
from scape_jax.optim._plan import CompressionPlan


class ScaleByScapeLocalAdamState(NamedTuple):
  """State of `scale_by_scape_local_adam`."""
  count: jax.Array  # int32: completed updates.
  mu: optax.Updates  # Dense leaves: synchronized first moment; MaskedNode else.
  residual: optax.Updates  # Per worker: pending update, f32[W, *shape].
  m: optax.Updates  # Per worker: first moment of its own gradient.
  v: optax.Updates  # Per worker: second moment of its own gradient.
  w: optax.Updates  # Per worker: moving average (rate b2) of m^**2.
  residual_norm: jax.Array  # Per worker: ||pending update||, f32[W].
  density: jax.Array  # f32: density in force at the last step.

  PER_WORKER_FIELDS = ('residual', 'm', 'v', 'w', 'residual_norm')
  OFFLOADED_FIELDS = ('residual',)


def scale_by_scape_local_adam(
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
    offset_bits: Union[str, int] = '32',
) -> optax.GradientTransformationExtraArgs:
  """Per-worker Adam whose pending updates travel on SCAPE's wire.

  Args:
    density: fraction of each compressed leaf sent per step, in (0, 1], or a
      `DensitySchedule` (then `density_warmup_steps` must be 0).
    b1: decay rate of the first moments, in (0, 1).
    b2: decay rate of the second moments (v, w; AdamS's on dense leaves).
    eps: term added to the denominator for numerical stability.
    clip_norm: global-norm clip of each worker's own gradient; None: off.
    axis_name: the data-parallel mesh axis; `None` means a single worker.
    compress, density_warmup_steps, mask_encoding, select, offset_bits:
      see `scale_by_scape`. The payload is float32 (the pending updates
      have no rounding feedback of their own).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update` takes the
    static keyword `density_level`, as `scale_by_scape`'s does.

  References:
    SCAPE paper, Algorithm 1 (the wire); docs/results.md (the measurements
    against AdamS and Algorithm 1).
  """
  if not 0.0 < b1:  # c = (1 - b1) / (1 + b1) < 1 (`smooth_v_mean`)
    raise ValueError(f'scale_by_scape_local_adam: b1={b1!r} must be in '
                     '(0, 1): its noise estimate divides by 1 - (1 - b1) / '
                     '(1 + b1).')
  schedule, hyper = _exchange.configure(
      'scape_local_adam', density, density_warmup_steps, b1=b1, b2=b2,
      eps=eps, clip_norm=clip_norm, axis_name=axis_name,
      mask_encoding=mask_encoding, select=select, offset_bits=offset_bits)

  def init_fn(params):
    n, local = _common.axis_context('scape_local_adam init', axis_name)
    plan = CompressionPlan.create(params, compress, n)
    per_worker = functools.partial(_common.per_worker,
                                   leading=1 if local else n,
                                   axis_name=axis_name, local=local)
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    leaves = list(zip(jax.tree.leaves(params), plan.layouts))
    sparse = plan.treedef.unflatten(
        [optax.MaskedNode() if layout is None else per_worker(zeros(p))
         for p, layout in leaves])
    return ScaleByScapeLocalAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=plan.treedef.unflatten(
            [zeros(p) if layout is None else optax.MaskedNode()
             for p, layout in leaves]),
        residual=sparse, m=sparse, v=sparse, w=sparse,
        residual_norm=per_worker(jnp.zeros([], jnp.float32)),
        density=jnp.ones([], jnp.float32))

  @_common.passes_empty_trees
  def update_fn(updates, state, params=None, *, density_level=None, **extra):
    del params, extra
    n, _ = _common.axis_context('scape_local_adam update', axis_name)
    plan = CompressionPlan.create(updates, compress, n)
    _common.check_per_worker_state('scape_local_adam update',
                                   state.residual_norm)
    return _exchange.at_level(_update_at_level, updates, state, plan, hyper,
                              schedule, density_level)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_at_level(grads, state: ScaleByScapeLocalAdamState, level: int, *,
                     plan: CompressionPlan, hyper: _exchange.Hyper,
                     schedule: DensitySchedule, next_level, live=None):
  """One update whose payload has the k of density level `level` (with
  `live`, the traced level in force: its k, `level`'s buffers)."""
  del schedule, next_level  # the mask is chosen and used in this step
  flat = plan.treedef.flatten_up_to
  grad_leaves = [g.astype(jnp.float32) for g in flat(grads)]
  if hyper.clip_norm:  # each worker clips its own gradient
    grad_leaves = _scape_clip.clip(grad_leaves, hyper.clip_norm)
  count = optax.safe_increment(state.count)
  sent, moments, scores = _local_updates(grad_leaves, state, count, plan,
                                         hyper)
  k_levels = _exchange.k_per_level(plan, hyper)
  k_now = [None if k is None else k[level] for k in k_levels]
  shift = count % plan.num_workers  # worker n ranks chunk (n + t) % N
  own_mask = _exchange.next_own_masks(
      scores, plan, k_levels, level, level if live is None else live, hyper,
      shift)
  global_masks = _exchange.exchange_masks(
      own_mask, plan, k_now, hyper, shift,
      k_live=_exchange.live_k(k_levels, live))
  mean = _exchange.exchange_payload(sent, plan, global_masks,
                                    hyper.axis_name)
  direction, residual, mu = _apply(mean, sent, global_masks, flat(state.mu),
                                   count, plan, hyper)

  vary = functools.partial(varying, axis_name=hyper.axis_name)
  per_worker = lambda x: optax.MaskedNode() if x is None else vary(x)  # noqa: E731
  m, v, w = (plan.treedef.unflatten([per_worker(x) for x in tree])
             for tree in moments)
  new_state = ScaleByScapeLocalAdamState(
      count=count, mu=plan.treedef.unflatten(mu),
      residual=plan.treedef.unflatten([per_worker(r) for r in residual]),
      m=m, v=v, w=w,
      residual_norm=vary(_residual_norm(residual, global_masks)[None]),
      density=_exchange.density_at(hyper, level, live))
  direction = [d.astype(g.dtype) for d, g in zip(direction, flat(grads))]
  return plan.treedef.unflatten(direction), new_state


def _residual_norm(residual, global_masks) -> jax.Array:
  """||e|| over the leaves sent under a mask; a leaf sent whole keeps
  constant zeros, whose norm XLA would fold element by element."""
  return _norms.global_norm([None if m is None else e
                             for e, m in zip(residual, global_masks)])


def _local_updates(grad_leaves, state, count, plan, hyper) -> tuple:
  """(payload per leaf, the new (m, v, w) per leaf, the mask's scores).

  A compressed leaf sends its pending update e + u, u the worker's own
  direction (`local_step`); a dense leaf sends Algorithm 1's
  m~ = b1 m + (1 - b1) g whole (no moments, no score: None).
  """
  flat = plan.treedef.flatten_up_to
  mu, pending = flat(state.mu), flat(state.residual)
  previous = [flat(tree) for tree in (state.m, state.v, state.w)]
  sent, moments, scores = [], ([], [], []), []
  for j, g in enumerate(grad_leaves):
    if plan.layouts[j] is None:
      sent.append(hyper.b1 * mu[j] + (1.0 - hyper.b1) * g)
      for tree in moments:
        tree.append(None)
      scores.append(None)
      continue
    new, u, score = local_step(g, *(x[j][0] for x in previous), count,
                               plan.num_workers, b1=hyper.b1, b2=hyper.b2,
                               eps=hyper.eps)
    sent.append(pending[j][0] + u)
    for tree, x in zip(moments, new):
      tree.append(x[None])
    scores.append(score)
  return sent, moments, scores


def local_step(g, m, v, w, count, num_workers: int, *, b1, b2, eps) -> tuple:
  """((m, v, w), u, score): one worker's moments of one leaf from its
  gradient `g`, its direction u and what its next mask ranks."""
  m = b1 * m + (1.0 - b1) * g
  v = b2 * v + (1.0 - b2) * g * g
  c1, c2 = _common.bias_corrections(count, b1, b2)
  m_hat = m / c1
  w = b2 * w + (1.0 - b2) * m_hat * m_hat
  v_hat, w_hat = v / c2, w / c2
  v_mean = smooth_v_mean(v_hat, w_hat, num_workers, b1=b1)
  u = m_hat / (jnp.sqrt(v_mean) + eps)
  noise = mean_update_noise(v_hat, w_hat, num_workers, b1=b1, eps=eps)
  return (m, v, w), u, shrunk_score(u, noise)


def smooth_v_mean(v_hat, w_hat, num_workers: int, *, b1):
  """The mean gradient's second moment, estimated from one worker's
  bias-corrected v^ and w^ (the moving average, rate b2, of m^**2).

  For a gradient of mean mu and per-worker variance s2, v^ ~ mu**2 + s2 and
  w^ ~ mu**2 + c s2 with c = (1 - b1) / (1 + b1), the variance a moving
  average of rate b1 keeps; so s2 ~ max(v^ - w^, 0) / (1 - c), and the
  mean gradient's second moment mu**2 + s2 / N is
  w^ + (1 / N - c) / (1 - c) * max(v^ - w^, 0), kept at least v^ / N (the
  steps at most sqrt(N) times Adam's). With one worker, max(v^, w^).
  """
  c = (1.0 - b1) / (1.0 + b1)
  spread = jnp.maximum(v_hat - w_hat, 0.0)
  v_mean = w_hat + (1.0 / num_workers - c) / (1.0 - c) * spread
  return jnp.maximum(v_mean, v_hat / num_workers)


def mean_update_noise(v_hat, w_hat, num_workers: int, *, b1, eps):
  """The variance of one worker's u around the workers' mean update.

  A worker's m^ differs from the workers' mean m^ by a moving average
  (rate b1) of its own gradient noise less the mean's, of variance
  c (1 - 1/N) s2 with c = (1 - b1) / (1 + b1) and s2 = max(v^ - w^, 0) /
  (1 - c) the worker's gradient variance (`smooth_v_mean`). u is m^ over
  sqrt(v_mean) + eps, so its variance is that over (sqrt(v_mean) + eps)**2.
  """
  c = (1.0 - b1) / (1.0 + b1)
  scale = jnp.sqrt(smooth_v_mean(v_hat, w_hat, num_workers, b1=b1)) + eps
  s2 = jnp.maximum(v_hat - w_hat, 0.0) / (1.0 - c)
  return c * (1.0 - 1.0 / num_workers) * s2 / (scale * scale)


def shrunk_score(u, noise):
  """What the mask ranks a chunk by: |u| / (tau2 + `noise`).

  Empirical Bayes: with the workers' mean update a priori N(0, tau2) over
  the leaf and u = mean + noise of variance `noise`, the posterior mean of
  the mean update is u tau2 / (tau2 + noise), and tau2 is estimated as
  mean(u**2) - mean(noise) over the leaf (at least 1e-12); the top-k of the
  posterior mean's magnitude is the top-k of this score. With one worker
  (no noise) it ranks as |u| does.
  """
  tau2 = jnp.maximum(jnp.mean(u * u) - jnp.mean(noise), 1e-12)
  return jnp.abs(u) / (tau2 + noise)


def _apply(mean, sent, global_masks, mu, count, plan, hyper) -> tuple:
  """(direction, residual, mu) per leaf from the exchanged means: AdamS on
  a dense leaf's synchronized moment; on a compressed leaf the mean pending
  update at M (every entry at a dense level), the rest kept as residual."""
  b1, b2 = hyper.b1, hyper.b2
  direction, residual, mu_out = [], [], []
  for j, (values, mask) in enumerate(zip(mean, global_masks)):
    layout, shape = plan.layouts[j], plan.shapes[j]
    if layout is None:
      bbar = values.reshape(shape)
      gbar = (bbar - b1 * mu[j]) / (1.0 - b1)
      nu = b2 * mu[j] * mu[j] + (1.0 - b2) * gbar * gbar
      direction.append(_common.bias_corrected_direction(
          bbar, nu, count, b1=b1, b2=b2, eps=hyper.eps))
      residual.append(None)
      mu_out.append(bbar)
      continue
    mu_out.append(optax.MaskedNode())
    if mask is None:
      direction.append(values.reshape(shape))
      residual.append(jnp.zeros((1,) + shape, jnp.float32))
    else:
      direction.append(masks.scatter_at(values, layout, mask.offsets, shape))
      residual.append(masks.set_at(sent[j], layout, mask.offsets,
                                   jnp.zeros_like(values))[None])
  return direction, residual, mu_out


def scape_local_adam(
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
    offset_bits: Union[str, int] = '32',
    weight_decay_mask: MaskOrFn = None,
) -> optax.GradientTransformationExtraArgs:
  """Per-worker Adam on SCAPE's wire, then weight decay and the learning rate.

  Same collectives and bytes per step as `scape` (Algorithm 1). Where the
  paper's algorithm trails AdamS at small scale, this mode comes within a
  few percent of it at the same bytes (docs/results.md, "SCAPE's modes"):
  use it at any density, and at d <= 0.02 also interleave the input
  embedding's chunks (`interleave_chunks`); use `scape` for the paper's
  algorithm. Call `update` inside `shard_map` with the worker's local
  gradients.

  Args:
    learning_rate: a float >= 0 or an optax schedule (None: no scaling).
    density: fraction of each compressed leaf sent per step, in (0, 1], or a
      `DensitySchedule`.
    b1, b2, eps, clip_norm, axis_name, compress, density_warmup_steps,
      mask_encoding, select, offset_bits: see `scale_by_scape_local_adam`.
    weight_decay: decoupled weight-decay strength, >= 0.
    weight_decay_mask: optional tree or callable of bools selecting the leaves
      that get weight decay.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  References:
    SCAPE paper, Algorithm 1 (the wire); docs/design.md.
  """
  return optax.chain(
      scale_by_scape_local_adam(
          density, b1=b1, b2=b2, eps=eps, clip_norm=clip_norm,
          axis_name=axis_name, compress=compress,
          density_warmup_steps=density_warmup_steps,
          mask_encoding=mask_encoding, select=select,
          offset_bits=offset_bits),
      _common.add_decayed_weights('scape_local_adam', weight_decay,
                                  weight_decay_mask),
      _common.scale_by_learning_rate('scape_local_adam', learning_rate),
  )


def scape_local_adam_stats(opt_state) -> dict:
  """`scape_stats` of the first `ScaleByScapeLocalAdamState`, or {}."""
  return _common.state_stats(opt_state, ScaleByScapeLocalAdamState,
                             ('density', 'residual_norm'))
