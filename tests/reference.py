"""Independent NumPy re-implementations of AdamS and SCAPE (Algorithm 1).

Written from `docs/design.md` sections 1-2 with plain loops over workers and
chunks; they share no code with `scape_jax`.
"""

import math
from fractions import Fraction

import numpy as np


def adams_reference(params, grads_seq, *, lr_fn, b1=0.9, b2=0.95, eps=1e-8,
                    wd=0.1):
  """Runs AdamS; yields the params (list of arrays) after every step."""
  w = [p.astype(np.float32).copy() for p in params]
  m = [np.zeros_like(p) for p in w]
  for t, grads in enumerate(grads_seq, start=1):
    lr = np.float32(lr_fn(t - 1))
    for j, g in enumerate(grads):
      m_prev = m[j]
      m[j] = b1 * m_prev + (1 - b1) * g
      v = b2 * m_prev**2 + (1 - b2) * g**2
      u = (m[j] / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
      w[j] = w[j] - lr * (u + wd * w[j])
    yield [x.copy() for x in w]


def k_of(density, chunk):
  return max(1, min(chunk, math.ceil(Fraction(repr(float(density))) * chunk)))


class ScapeReference:
  """N simulated workers running Algorithm 1 with partitioned chunk masks.

  variant='fresh' (docs/design.md, "Variant fresh"): a coordinate whose
  previous first moment is zero takes AdamS's first step, as if its moment
  had started at this step.

  variant='carry' (docs/design.md, "Variants carry and carry_v"): outside
  the mask the first moment decays to b1 m_{t-1} instead of being zeroed,
  and each worker's residual keeps m~ - b1 m_{t-1}; 'carry_v' also keeps v,
  which outside the mask stays at its last value; 'carry_vi' is 'carry_v'
  whose masks are the top-k of |m~ - b1 m_{t-1}|.

  variant='stale' (docs/design.md, "Variant stale"): Algorithm 1 whose step
  at a coordinate of the mask is scaled by min(s, 1/density), s the steps
  since that coordinate last took one.

  variant='local' (docs/design.md, "Variant local"): each worker's residual
  outside the mask is b1 m~ instead of m~; 'local_stale' also scales the
  step as 'stale' does.
  """

  def __init__(self, params, compressed, n, *, density, lr_fn, b1=0.9,
               b2=0.95, eps=1e-8, wd=0.1, clip=None, variant='faithful'):
    assert variant in ('faithful', 'fresh', 'carry', 'carry_v',
                       'carry_vi', 'stale', 'local', 'local_stale'), variant
    self.variant = variant
    self.n, self.density, self.lr_fn = n, density, lr_fn
    self.b1, self.b2, self.eps, self.wd, self.clip = b1, b2, eps, wd, clip
    self.w = [p.astype(np.float32).copy() for p in params]
    self.compressed = list(compressed)
    self.m = [np.zeros_like(p) for p in self.w]
    self.v = [np.zeros_like(p) for p in self.w]
    self.age = [np.zeros_like(p) for p in self.w]  # 'stale'
    self.e = [[np.zeros_like(p) for p in self.w] for _ in range(n)]
    # Global mask per leaf over the padded flat index space; M_0 = all ones.
    self.chunk = [-(-p.size // n) for p in self.w]
    self.mask = [np.ones(c * n, bool) for c in self.chunk]
    self.t = 0

  def _refresh(self, j, mts, shift=0):
    """Union over workers of each worker's top-k in its own chunk of |m~^n|:
    chunk (n + shift) % N for worker n."""
    c, size = self.chunk[j], self.w[j].size
    k = k_of(self.density, c)
    new = np.zeros(c * self.n, bool)
    for n in range(self.n):
      own = (n + shift) % self.n
      flat = np.zeros(c * self.n, np.float32)
      flat[:size] = np.abs(mts[n][j]).reshape(-1)
      score = flat[own * c:(own + 1) * c].copy()
      positions = np.arange(own * c, (own + 1) * c)
      score[positions >= size] = -1.0  # padding goes last
      order = np.argsort(-score, kind='stable')[:k]
      new[own * c + order] = True
    return new

  def step(self, worker_grads):
    """worker_grads[n][j]: worker n's gradient of leaf j; returns ||gbar||."""
    self.t += 1
    t, b1, b2 = self.t, self.b1, self.b2
    mts = [[b1 * self.m[j] + (1 - b1) * worker_grads[n][j] + self.e[n][j]
            for j in range(len(self.w))] for n in range(self.n)]
    new_masks, gbar, bbar, in_ms = [], [], [], []
    for j, p in enumerate(self.w):
      size = p.size
      if self.compressed[j]:
        in_m = self.mask[j][:size].reshape(p.shape)
        scores = mts
        if self.variant == 'carry_vi':  # the innovation m~ - b1 m_{t-1}
          scores = [[x - b1 * self.m[i] for i, x in enumerate(mt)]
                    for mt in mts]
        new_masks.append(self._refresh(j, scores))
      else:
        in_m = np.ones(p.shape, bool)
        new_masks.append(None)
      b = self._exchange(j, in_m, mts)
      if self.variant in ('carry', 'carry_v', 'carry_vi'):
        kept = (b1 * self.m[j]).astype(np.float32)
        b = np.where(in_m, b, kept)
        for n in range(self.n):
          self.e[n][j] = np.where(in_m, self.e[n][j],
                                  mts[n][j] - kept).astype(np.float32)
      bbar.append(b)
      in_ms.append(in_m)
      gbar.append(np.where(in_m, (b - b1 * self.m[j]) / (1 - b1), 0))
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64)**2)) for g in gbar))
    if self.clip:
      if norm > self.clip:
        gbar = [g * np.float32(self.clip / norm) for g in gbar]
    lr = np.float32(self.lr_fn(t - 1))
    for j in range(len(self.w)):
      v = b2 * self.m[j]**2 + (1 - b2) * gbar[j]**2
      if self.variant in ('carry_v', 'carry_vi'):  # v frozen outside the mask
        v = np.where(in_ms[j], v, self.v[j])
      self.v[j] = v
      restarted = self.m[j] == 0
      self.m[j] = bbar[j]
      u = (self.m[j] / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + self.eps)
      if self.variant == 'fresh':  # AdamS's first step: m/|m| after both
        first = np.sign(bbar[j]) / (1 + self.eps * (1 - b1**t) /
                                    np.maximum(np.abs(bbar[j]), 1e-38))
        u = np.where(restarted, first, u)
      if self.variant in ('stale', 'local_stale'):
        u = u * np.minimum(self.age[j] + 1, np.float32(1 / self.density))
        self.age[j] = np.where(in_ms[j], 0, self.age[j] + 1).astype(
            np.float32)
      self.w[j] = (self.w[j] - lr * (u + self.wd * self.w[j])).astype(
          np.float32)
      if self.compressed[j]:
        self.mask[j] = new_masks[j]
    return norm

  def _exchange(self, j, in_m, mts):
    """The mean of the workers' m~ at M; sets their residuals e^n of leaf j."""
    payloads = []
    for n in range(self.n):
      payloads.append(np.where(in_m, mts[n][j], 0).astype(np.float32))
      kept = (self.b1 * mts[n][j] if self.variant.startswith('local') else
              mts[n][j])
      self.e[n][j] = np.where(in_m, 0, kept).astype(np.float32)
    return np.mean(np.stack(payloads), axis=0, dtype=np.float32)

  def chunk_mask(self, j, n):
    """Worker n's own chunk mask of leaf j (bool[c]), as used next step."""
    c = self.chunk[j]
    return self.mask[j][n * c:(n + 1) * c]


class LocalAdamReference(ScapeReference):
  """N simulated workers running SCAPE's variant 'local_adam' or, with
  `adams`, 'local_adams', with `now`, 'local_adam_now', with `now` and
  `mean_v`, 'local_adam_meanv', with `now` and `smooth_v`,
  'local_adam_smoothv', with `now`, `smooth_v` and `rotate`,
  'local_adam_rotating', and with `score='debiased'`, `'shrunk'`,
  `'tempered'` or `'slab'` too, 'local_adam_debiased', 'local_adam_shrunk',
  'local_adam_tempered' or 'local_adam_slab', with `score='shrunk'` and
  `leak` (the pending update kept per step) 'local_adam_leaky', and with
  `score='gain'` 'local_adam_gain', or `score='rowshrunk'`
  'local_adam_rowshrunk' (docs/design.md):
  each worker clips its own gradient and runs Adam (AdamS:
  v = b2 m_{t-1}**2 + (1 - b2) g**2) on it per compressed leaf; its residual holds the updates not applied yet;
  the step at M is the mean of the workers' pending updates there, the next
  chunk masks the top-k of each worker's current update. Leaves that are
  not compressed take Algorithm 1's dense AdamS."""

  def __init__(self, params, compressed, n, adams=False, now=False,
               mean_v=False, smooth_v=False, rotate=False, score=None,
               informed=None, leak=None, **kwargs):
    super().__init__(params, compressed, n, **kwargs)
    self.adams, self.now, self.mean_v = adams, now, mean_v
    self.smooth_v, self.rotate, self.score = smooth_v, rotate, score
    self.leak = leak
    # The study's informed runs (bench/fidelity_information.py): 'mask',
    # masks from the workers' mean current update; 'v', v from the mean
    # (clipped) gradient.
    self.informed = informed
    self.m_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]
    self.v_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]
    self.w_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]

  def step(self, worker_grads):
    self.t += 1
    t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
    grads = []
    for g in worker_grads:
      norm = math.sqrt(sum(float(np.sum(x.astype(np.float64)**2)) for x in g))
      scale = self.clip / norm if self.clip and norm > self.clip else 1.0
      grads.append([(x * np.float32(scale)).astype(np.float32) for x in g])
    lr = np.float32(self.lr_fn(t - 1))
    c1, c2 = 1 - b1**t, 1 - b2**t
    for j, p in enumerate(self.w):
      if not self.compressed[j]:  # Algorithm 1's dense leaf
        bbar = np.mean([b1 * self.m[j] + (1 - b1) * g[j] for g in grads],
                       axis=0, dtype=np.float32)
        gbar = (bbar - b1 * self.m[j]) / (1 - b1)
        v = b2 * self.m[j]**2 + (1 - b2) * gbar**2
        self.m[j] = bbar
        u = (bbar / c1) / (np.sqrt(v / c2) + eps)
      else:
        pending, current = [], []
        g_mean = np.mean([g[j] for g in grads], axis=0, dtype=np.float32)
        for n, g in enumerate(grads):
          previous = self.m_local[n][j]**2 if self.adams else self.v_local[n][j]
          g_v = g_mean if self.informed == 'v' else g[j]
          self.m_local[n][j] = b1 * self.m_local[n][j] + (1 - b1) * g[j]
          self.v_local[n][j] = b2 * previous + (1 - b2) * g_v**2
          m_hat = self.m_local[n][j] / c1
          v_hat = self.v_local[n][j] / c2
          if self.mean_v:  # the mean gradient's second moment, estimated
            v_hat = m_hat**2 + np.maximum(v_hat - m_hat**2, 0) / self.n
          if self.smooth_v:  # ... from a moving average of m_hat**2
            self.w_local[n][j] = b2 * self.w_local[n][j] + (1 - b2) * m_hat**2
            w_hat = self.w_local[n][j] / c2
            c = (1 - b1) / (1 + b1)
            v_mean = w_hat + (1 / self.n - c) / (1 - c) * np.maximum(
                v_hat - w_hat, 0)
            v_hat = np.maximum(v_mean, v_hat / self.n)
          now = m_hat / (np.sqrt(v_hat) + eps)
          score = now
          if self.score:  # the variance of now around the workers' mean
            s2 = np.maximum(self.v_local[n][j] / c2 - w_hat, 0) / (1 - c)
            noise = c * (1 - 1 / self.n) * s2 / (np.sqrt(v_hat) + eps)**2
          if self.score == 'tempered':  # 'shrunk' assuming half the noise
            noise = np.float32(0.5) * noise
          if self.score == 'debiased':  # now**2 less it, clamped at 0
            score = (np.maximum(now**2 - noise, 0) +
                     np.float32(1e-3) * now**2)
          if self.score in ('shrunk', 'tempered'):  # |posterior mean|
            tau2 = max(float(np.mean(now.astype(np.float64)**2) -
                             np.mean(noise.astype(np.float64))), 1e-12)
            score = np.abs(now) / (np.float32(tau2) + noise)
          if self.score == 'rowshrunk':  # ... with a prior per row
            tau2 = np.maximum(
                np.mean(now.astype(np.float64)**2, axis=-1, keepdims=True) -
                np.mean(noise.astype(np.float64), axis=-1, keepdims=True),
                1e-12)
            score = np.abs(now) / (tau2.astype(np.float32) + noise)
          if self.score == 'slab':  # ... under a spike-and-slab prior
            score = slab_posterior_mean(now, noise)
          kept = self.e[n][j]
          if self.leak is not None:
            kept = np.float32(self.leak) * kept
          pending.append((kept + now).astype(np.float32))
          if self.score == 'gain':  # posterior mean times the pending update
            tau2 = max(float(np.mean(now.astype(np.float64)**2) -
                             np.mean(noise.astype(np.float64))), 1e-12)
            posterior = now * (np.float32(tau2) / (np.float32(tau2) + noise))
            score = np.maximum(posterior * pending[-1], 0).astype(np.float32)
          current.append([score if i == j else None
                          for i in range(len(self.w))])
        if self.informed == 'mask':
          mean = np.mean([c[j] for c in current], axis=0, dtype=np.float32)
          current = [[mean if i == j else None for i in range(len(self.w))]
                     ] * self.n
        if self.now and t > 1:  # this step's mask (step 1 is dense)
          # 'local_adam_rotating': worker n ranks chunk (n + t) % N.
          self.mask[j] = self._refresh(j, current,
                                       t % self.n if self.rotate else 0)
        in_m = self.mask[j][:p.size].reshape(p.shape)
        for n in range(self.n):
          self.e[n][j] = np.where(in_m, 0, pending[n]).astype(np.float32)
        u = np.where(in_m, np.mean(pending, axis=0, dtype=np.float32), 0)
        if not self.now:
          self.mask[j] = self._refresh(j, current)
      self.w[j] = (self.w[j] - lr * (u + self.wd * self.w[j])).astype(
          np.float32)


def slab_posterior_mean(u, noise, iterations=5):
  """|E[mean update | u]| per coordinate in float64, under the prior
  'mean update = 0 w.p. 1 - pi, ~ N(0, t) w.p. pi' with pi and t fitted to
  u ~ mean update + N(0, noise) by EM from pi = 1/2, t = 2 (mean(u**2) -
  mean(noise)); pi is kept in [1e-4, 1]."""
  u, n = u.astype(np.float64), np.maximum(noise.astype(np.float64), 1e-12)

  def slab(pi, t):  # P(slab | u) by Bayes' rule on the two normal densities
    log_slab = np.log(pi) - 0.5 * np.log(t + n) - 0.5 * u**2 / (t + n)
    log_spike = np.log1p(-min(pi, 1 - 1e-6)) - 0.5 * np.log(n) - 0.5 * u**2 / n
    return 1 / (1 + np.exp(np.clip(log_spike - log_slab, -700, 700)))

  pi, t = 0.5, 2 * max(np.mean(u**2) - np.mean(noise), 1e-12)
  for _ in range(iterations):
    r, s = slab(pi, t), t / (t + n)
    pi = min(max(np.mean(r), 1e-4), 1.0)
    t = max(np.sum(r * (s * s * u**2 + s * n)) / max(np.sum(r), 1e-12), 1e-12)
  return (slab(pi, t) * np.abs(u) * t / (t + n)).astype(np.float32)


def lora_reference(x, kernel, bias, lora_a, lora_b, scale, cotangent):
  """A LoRA layer y = x W + b + scale (x A) B and, for the loss sum(y * g),
  the gradients of A and B (written out by the chain rule):

    dA = scale * x^T (g B^T),   dB = scale * (x A)^T g.
  """
  x, g = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)
  a, b = np.asarray(lora_a, np.float64), np.asarray(lora_b, np.float64)
  y = x @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
  y = y + scale * (x @ a) @ b
  return y, scale * x.T @ (g @ b.T), scale * (x @ a).T @ g
