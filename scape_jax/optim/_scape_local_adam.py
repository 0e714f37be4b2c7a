"""SCAPE variants 'local_adam', 'local_adams', 'local_adam_now',
'local_adam_meanv', 'local_adam_smoothv', 'local_adam_rotating',
'local_adam_debiased', 'local_adam_shrunk', 'local_adam_tempered',
'local_adam_slab', 'local_adam_leaky', 'local_adam_gain' and
'local_adam_rowshrunk': sparse updates with error feedback on the wire of
Algorithm 1.

Each worker runs Adam ('local_adam': v the moving average of g**2) or AdamS
('local_adams': v = b2 m_{t-1}**2 + (1 - b2) g**2, no state of its own) on
its own gradient of every compressed leaf (local, per-worker moments) and
keeps the updates it has not applied yet in its residual (error feedback on
the *update*, not on the first moment). Each step the payload is that
pending update at the mask in force, its mean over the workers is the step
there, and the next mask is the top-k of each worker's current update |u|
in its own chunk. 'local_adam_now' uses this step's mask, chosen from this
step's update before the exchange, which then waits for the mask
all-gather; 'local_adam_meanv' and 'local_adam_smoothv' are
'local_adam_now' whose v estimates the mean gradient's second moment
(`mean_v_direction`, `smooth_v_direction`). 'local_adam_rotating' is
'local_adam_smoothv' whose chunks change owner every step (worker n chooses
chunk (n + t) % N's mask at step t); 'local_adam_debiased',
'local_adam_shrunk', 'local_adam_tempered' and 'local_adam_slab' are
'local_adam_rotating' whose mask ranks by an estimate of the workers' mean
update from u and its noise: u**2 less that noise (`debiased_score`), or
the posterior mean under a normal prior (`shrunk_score`; with half the
noise, `tempered_score`) or a spike-and-slab one (`slab_score`).
'local_adam_leaky' is 'local_adam_shrunk' whose pending update decays by
`LEAK` per step. 'local_adam_gain' ranks by the shrunk mean update times
the pending update (`gain_score`); 'local_adam_rowshrunk' is
'local_adam_shrunk' with a prior per row (`row_shrunk_score`).
Leaves that are never compressed (norms, biases) take
Algorithm 1's dense path (m~ exchanged in full, AdamS's direction). The
masks, the payload and the collectives are Algorithm 1's, byte for byte.

It follows the sparse-update oracle of `docs/results.md` (`current`: the k
largest of this step's update move, by their pending update) with each
worker's own gradient in place of the mean gradient and, as SCAPE must, the
mask chosen one step before it is used. docs/design.md ("SCAPE variants
'local_adam', 'local_adams', 'local_adam_now'" and "SCAPE variants
'local_adam_meanv', 'local_adam_smoothv'", "SCAPE variants
'local_adam_rotating', 'local_adam_debiased', 'local_adam_shrunk'",
"SCAPE variant 'local_adam_slab'", "SCAPE variants 'local_adam_tempered',
'local_adam_leaky'", "SCAPE variants 'local_adam_gain',
'local_adam_rowshrunk'") say where they depart from the paper.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm import masks
from scape_jax.comm.collectives import varying
from scape_jax.optim import _common
from scape_jax.optim import _norms
from scape_jax.optim import _scape
from scape_jax.optim import _scape_clip


# The variants whose mask ranks by an estimate of the workers' mean update
# from u and its noise, not by u (`_SCORES` has each one's score).
_SCORED = ('local_adam_debiased', 'local_adam_shrunk', 'local_adam_tempered',
           'local_adam_slab', 'local_adam_leaky', 'local_adam_gain',
           'local_adam_rowshrunk')
# The variants whose score is a function of the pending update too.
_PENDING_SCORED = ('local_adam_gain',)
# The variants whose pending update decays by `LEAK` per step.
_LEAKY = ('local_adam_leaky',)
# What the pending update of a `_LEAKY` variant keeps of itself per step.
LEAK = 0.98
# The variants whose chunks change owner every step.
_ROTATING = ('local_adam_rotating',) + _SCORED
# The variants with a third moment, w, and `smooth_v_direction`.
SMOOTH_V = ('local_adam_smoothv',) + _ROTATING
# The variants whose mask is chosen in the step that uses it.
_THIS_STEP = ('local_adam_now', 'local_adam_meanv') + SMOOTH_V


def init_local_state(variant: str, params, plan, per_worker) -> tuple:
  """Each worker's moments of its own gradient, per compressed leaf: (m,)
  for 'local_adams', (m, v, w) for `SMOOTH_V` (w: the moving average of
  m^**2), else (m, v)."""
  zeros = [optax.MaskedNode() if layout is None else
           per_worker(jnp.zeros(p.shape, jnp.float32))
           for p, layout in zip(jax.tree.leaves(params), plan.layouts)]
  tree = plan.treedef.unflatten(zeros)
  count = 1 if variant == 'local_adams' else 3 if variant in SMOOTH_V else 2
  return (tree,) * count


def update(grads, state, level: int, *, plan, hyper, schedule):
  """One update of a `_scape_variants.LOCAL_OPTIMIZERS` variant at the k of
  `level`."""
  flat = plan.treedef.flatten_up_to
  grad_leaves = [g.astype(jnp.float32) for g in flat(grads)]
  if hyper.clip_norm:  # each worker clips its own gradient
    grad_leaves = _scape_clip.clip(grad_leaves, hyper.clip_norm)
  count = optax.safe_increment(state.count)
  sent, moments, current = _local_updates(grad_leaves, state, count, plan,
                                          hyper)
  k_levels = [None if layout is None else plan.k_per_level(j, hyper.levels)
              for j, layout in enumerate(plan.layouts)]
  k_now = [None if k is None else k[level] for k in k_levels]
  scores = mask_scores(current, hyper.axis_name)
  if hyper.variant in _THIS_STEP:  # this step's masks, from this step
    shift = (count % plan.num_workers if hyper.variant in _ROTATING
             else None)
    own_mask = _scape._next_own_masks(scores, plan, k_levels, level, level,
                                      hyper, shift)
    global_masks = _scape._exchange_masks(own_mask, plan, k_now, hyper,
                                          shift)
    if shift is not None:  # the state keeps chunk n's mask, as for the rest
      own_mask = _chunk_masks(own_mask, global_masks, hyper.axis_name)
  else:  # Algorithm 1's: chosen at the previous step
    global_masks = _scape._exchange_masks(flat(state.mask), plan, k_now,
                                          hyper)
    own_mask = _scape._next_own_masks(scores, plan, k_levels, level,
                                      schedule.level(state.count + 1), hyper)
  mean = _scape._exchange_payload(sent, plan, global_masks, hyper.axis_name)
  direction, residual, mu = _apply(mean, sent, global_masks, flat(state.mu),
                                   count, plan, hyper)

  vary = functools.partial(varying, axis_name=hyper.axis_name)
  per_worker = lambda x: optax.MaskedNode() if x is None else vary(x)
  new_state = state._replace(
      count=count,
      mu=plan.treedef.unflatten(mu),
      residual=plan.treedef.unflatten([per_worker(r) for r in residual]),
      mask=plan.treedef.unflatten([per_worker(o) for o in own_mask]),
      residual_norm=vary(_norms.global_norm(residual)[None]),
      density=jnp.asarray(hyper.levels[level], jnp.float32),
      local_state=tuple(plan.treedef.unflatten(
          [x if isinstance(x, optax.MaskedNode) else vary(x[None])
           for x in tree]) for tree in moments))
  direction = [d.astype(g.dtype) for d, g in zip(direction, flat(grads))]
  return plan.treedef.unflatten(direction), new_state


def _chunk_masks(own_mask: list, global_masks: list, axis_name) -> list:
  """Worker n's row (chunk n's bitmap) of each leaf's gathered masks; a
  leaf dense at this level keeps its (all-ones) mask."""
  worker = 0 if axis_name is None else jax.lax.axis_index(axis_name)
  return [own if g is None else
          jax.lax.dynamic_index_in_dim(g.words, worker, keepdims=True)
          for own, g in zip(own_mask, global_masks)]


def _local_updates(grad_leaves, state, count, plan, hyper) -> tuple:
  """(payload per leaf, the new local moments, the current update u or,
  for a `_SCORES` variant, the score its mask ranks by).

  A compressed leaf sends its pending update e + u (`LEAK` e + u for a
  `_LEAKY` variant), where u is the worker's own direction (`_local_step`);
  a dense leaf sends Algorithm 1's m~ = b1 m + (1 - b1) g in full (u: None).
  """
  b1 = hyper.b1
  flat = plan.treedef.flatten_up_to
  mu, pending = flat(state.mu), flat(state.residual)
  previous = [flat(tree) for tree in state.local_state]
  sent, moments, current = [], tuple([] for _ in previous), []
  for j, g in enumerate(grad_leaves):
    if plan.layouts[j] is None:
      sent.append(b1 * mu[j] + (1.0 - b1) * g)
      for tree in moments:
        tree.append(optax.MaskedNode())
      current.append(None)
      continue
    kept = pending[j][0]
    if hyper.variant in _LEAKY:
      kept = LEAK * kept
    new, u, score = _local_step(g, [x[j][0] for x in previous], kept, count,
                                plan.num_workers, hyper)
    sent.append(kept + u)
    for tree, x in zip(moments, new):
      tree.append(x)
    current.append(score)
  return sent, moments, current


def _local_step(g, previous: list, kept, count, num_workers: int,
                hyper) -> tuple:
  """(new moments, u, score): one worker's moments of one leaf from its
  gradient `g`, its direction u and what its mask ranks (u, or a `_SCORES`
  function of u, and for a `_PENDING_SCORED` variant of the pending update
  `kept` + u too), per variant (`init_local_state` has the moments).
  """
  b1, b2, eps = hyper.b1, hyper.b2, hyper.eps
  m = b1 * previous[0] + (1.0 - b1) * g
  g_v = second_moment_gradient(g, hyper.axis_name)
  if hyper.variant == 'local_adams':  # AdamS's v: no state of its own
    v = b2 * previous[0] * previous[0] + (1.0 - b2) * g_v * g_v
    u = _common.bias_corrected_direction(m, v, count, b1=b1, b2=b2, eps=eps)
    return (m,), u, u
  v = b2 * previous[1] + (1.0 - b2) * g_v * g_v
  c1, c2 = _common.bias_corrections(count, b1, b2)
  if hyper.variant == 'local_adam_meanv':
    u = mean_v_direction(m / c1, v / c2, num_workers, eps=eps)
    return (m, v), u, u
  if hyper.variant in SMOOTH_V:
    m_hat = m / c1
    w = b2 * previous[2] + (1.0 - b2) * m_hat * m_hat
    u = smooth_v_direction(m_hat, v / c2, w / c2, num_workers, b1=b1,
                           eps=eps)
    if hyper.variant not in _SCORES:
      return (m, v, w), u, u
    noise = mean_update_noise(v / c2, w / c2, num_workers, b1=b1, eps=eps)
    if hyper.variant in _PENDING_SCORED:
      return (m, v, w), u, _SCORES[hyper.variant](u, noise, kept + u)
    return (m, v, w), u, _SCORES[hyper.variant](u, noise)
  u = _common.bias_corrected_direction(m, v, count, b1=b1, b2=b2, eps=eps)
  return (m, v), u, u


# The two statistics a worker computes from its own gradient alone. They
# are functions so that the study can hand every worker the mean gradient's
# instead (bench/fidelity_information.py), to measure what the local view
# costs; nothing in the library replaces them.


def mask_scores(current: list, axis_name) -> list:
  """What each worker's next mask is the top-k of (per leaf, None where
  not compressed): its own current update."""
  del axis_name
  return current


def second_moment_gradient(g: jax.Array, axis_name) -> jax.Array:
  """The gradient whose square the local v averages: the worker's own."""
  del axis_name
  return g


def mean_v_direction(m_hat, v_hat, num_workers: int, *, eps):
  """'local_adam_meanv's direction m^ / (sqrt(v_mean) + eps) from one
  worker's bias-corrected moments m^, v^, where
  v_mean = m^**2 + max(v^ - m^**2, 0) / N estimates the second moment of
  the mean gradient over the N workers: m^**2 stands for the squared mean,
  v^ - m^**2 for the worker's own gradient variance, which the mean of N
  workers divides by N. With one worker v_mean = max(v^, m^**2): Adam's
  direction wherever v^ >= m^**2, and |u| capped at 1 elsewhere."""
  signal = m_hat * m_hat
  v_mean = signal + jnp.maximum(v_hat - signal, 0.0) / num_workers
  return m_hat / (jnp.sqrt(v_mean) + eps)


def smooth_v_direction(m_hat, v_hat, w_hat, num_workers: int, *, b1, eps):
  """'local_adam_smoothv's direction m^ / (sqrt(v_mean) + eps), v_mean
  from `smooth_v_mean`. Unlike `mean_v_direction`'s, this v_mean is a moving
  average, not a function of this step's m^, so |u| ranks a chunk by more
  than m^**2 / v^. With one worker v_mean = max(v^, w^).
  """
  v_mean = smooth_v_mean(v_hat, w_hat, num_workers, b1=b1)
  return m_hat / (jnp.sqrt(v_mean) + eps)


def smooth_v_mean(v_hat, w_hat, num_workers: int, *, b1):
  """The mean gradient's second moment, estimated from one worker's
  bias-corrected v^ and w^ (the moving average, rate b2, of m^**2).

  For a gradient of mean mu and per-worker variance s2, v^ ~ mu**2 + s2 and
  w^ ~ mu**2 + c s2 with c = (1 - b1) / (1 + b1), the variance a moving
  average of rate b1 keeps; so s2 ~ max(v^ - w^, 0) / (1 - c), and the
  mean gradient's second moment mu**2 + s2 / N is
  w^ + (1 / N - c) / (1 - c) * max(v^ - w^, 0), kept at least v^ / N (the
  steps at most sqrt(N) times Adam's).
  """
  c = (1.0 - b1) / (1.0 + b1)
  spread = jnp.maximum(v_hat - w_hat, 0.0)
  v_mean = w_hat + (1.0 / num_workers - c) / (1.0 - c) * spread
  return jnp.maximum(v_mean, v_hat / num_workers)


def debiased_score(u, noise):
  """What 'local_adam_debiased' ranks a chunk by: max(x, 0) + 1e-3 u**2,
  where x = u**2 - `noise` is an unbiased estimate of the square of the
  workers' mean update. x is clamped at 0 (a square is not negative), and
  the coordinates clamped there are ranked by u**2 with weight 1e-3. With
  one worker it ranks as |u| does.
  """
  return jnp.maximum(u * u - noise, 0.0) + 1e-3 * (u * u)


def shrunk_score(u, noise):
  """What 'local_adam_shrunk' ranks a chunk by: |u| / (tau2 + `noise`).

  Empirical Bayes: with the workers' mean update a priori N(0, tau2) over
  the leaf and u = mean + noise of variance `noise`, the posterior mean of
  the mean update is u tau2 / (tau2 + noise), and tau2 is estimated as
  mean(u**2) - mean(noise) over the leaf (at least 1e-12); the top-k of the
  posterior mean's magnitude is the top-k of this score. Unlike
  `debiased_score`, a coordinate's noisy |u| cannot outrank a quieter
  one's by its noise alone. With one worker it ranks as |u| does.
  """
  return jnp.abs(u) / (_leaf_prior_variance(u, noise) + noise)


# The fraction of `mean_update_noise` that `tempered_score` assumes.
TEMPER = 0.5


def tempered_score(u, noise):
  """What 'local_adam_tempered' ranks a chunk by: `shrunk_score` with the
  noise variance multiplied by `TEMPER` (1/2), in the posterior and in
  tau2's estimate alike: |u| / (tau2' + noise / 2), where
  tau2' = mean(u**2) - mean(noise) / 2.

  A milder discount of noisy coordinates than the posterior mean's. The
  constant was chosen by measurement (docs/design.md, "SCAPE variants
  'local_adam_tempered', 'local_adam_leaky'"), not derived. With one worker it ranks as |u|
  does.
  """
  return shrunk_score(u, TEMPER * noise)


def gain_score(u, noise, pending):
  """What 'local_adam_gain' ranks a chunk by: max(p_post * `pending`, 0),
  where p_post = u tau2 / (tau2 + `noise`) is `shrunk_score`'s posterior
  mean of the workers' mean update.

  To first order, in Adam's preconditioned metric, applying the pending
  update e + u at a coordinate lowers the loss by the mean update there
  times e + u: this score is that gain, with the mean update estimated by
  its posterior mean. Unlike a score of u alone, a coordinate whose
  update keeps its sign gains priority as its pending update grows with
  the steps it waits; one whose pending update now points against its
  update scores 0 (its ties fall to the lower offsets). With one worker
  p_post = u.
  """
  tau2 = _leaf_prior_variance(u, noise)
  return jnp.maximum(u * (tau2 / (tau2 + noise)) * pending, 0.0)


def row_shrunk_score(u, noise):
  """What 'local_adam_rowshrunk' ranks a chunk by: `shrunk_score` with the
  prior's variance estimated per row (over the last axis) instead of over
  the leaf: |u| / (tau2_row + `noise`), where
  tau2_row = mean(u**2) - mean(`noise`) over the row, at least 1e-12.

  A row of a kernel (one input feature; one token of an embedding) has its
  own scale of signal, so one prior per leaf shrinks the rows with much
  signal as hard as the rows with little. With one worker it ranks as |u|
  does.
  """
  return jnp.abs(u) / (_leaf_prior_variance(u, noise, axis=-1) + noise)


def _leaf_prior_variance(u, noise, axis=None):
  """tau2 = mean(u**2) - mean(`noise`) over the leaf (or, with `axis`, over
  that axis, kept for broadcasting), at least 1e-12: the variance of the
  workers' mean update, estimated by moments."""
  keep = axis is not None
  return jnp.maximum(jnp.mean(u * u, axis=axis, keepdims=keep) -
                     jnp.mean(noise, axis=axis, keepdims=keep), 1e-12)


# EM iterations `slab_score` fits its prior with.
SLAB_ITERATIONS = 5


def slab_score(u, noise):
  """What 'local_adam_slab' ranks a chunk by: the magnitude of the posterior
  mean of the workers' mean update under a spike-and-slab prior.

  Empirical Bayes as in `shrunk_score`, with a prior that has a spike: over
  the leaf the mean update is 0 with probability 1 - pi and N(0, t)
  with probability pi, and u is it plus noise of variance `noise`. pi and t
  are fitted to the leaf's u by `SLAB_ITERATIONS` steps of EM from pi = 1/2,
  t = 2 tau2 (`shrunk_score`'s tau2). The posterior mean is
  r u t / (t + noise), r the posterior probability of the slab: a large |u|
  is mostly signal (r near 1, shrunk by t / (t + noise) with t larger than
  tau2), a small one mostly noise. With pi = 1 the prior is
  `shrunk_score`'s normal; with one worker (no noise) it ranks as |u| does.
  """
  n = jnp.maximum(noise, 1e-12)
  u2 = u * u
  pi = jnp.asarray(0.5, jnp.float32)
  t = 2.0 * _leaf_prior_variance(u, noise)
  for _ in range(SLAB_ITERATIONS):
    r = _slab_probability(u2, n, pi, t)
    s = t / (t + n)  # the slab's posterior: mean s u, variance s n
    pi = jnp.clip(jnp.mean(r), 1e-4, 1.0)
    t = jnp.maximum(jnp.sum(r * (s * s * u2 + s * n)) /
                    jnp.maximum(jnp.sum(r), 1e-12), 1e-12)
  return _slab_probability(u2, n, pi, t) * jnp.abs(u) * t / (t + n)


def _slab_probability(u2, n, pi, t):
  """P(slab | u) for u**2 = `u2`: the sigmoid of the log-odds
  log(pi / (1 - pi)) + log N(u; 0, t + n) - log N(u; 0, n)."""
  logit = (jnp.log(pi) - jnp.log1p(-jnp.minimum(pi, 1.0 - 1e-6))
           + 0.5 * jnp.log(n / (t + n)) + 0.5 * u2 * (1.0 / n - 1.0 / (t + n)))
  return jax.nn.sigmoid(logit)


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
    mu_out.append(mu[j])  # unused (zero) on compressed leaves
    if mask is None:
      direction.append(values.reshape(shape))
      residual.append(jnp.zeros((1,) + shape, jnp.float32))
    else:
      direction.append(masks.scatter_at(values, layout, mask.offsets, shape))
      residual.append(masks.set_at(sent[j], layout, mask.offsets,
                                   jnp.zeros_like(values))[None])
  return direction, residual, mu_out


# The score of each `_SCORED` variant, a function of u and its noise
# (`mean_update_noise`).
_SCORES = {'local_adam_debiased': debiased_score,
           'local_adam_shrunk': shrunk_score,
           'local_adam_tempered': tempered_score,
           'local_adam_slab': slab_score,
           'local_adam_leaky': shrunk_score,
           'local_adam_gain': gain_score,
           'local_adam_rowshrunk': row_shrunk_score}
