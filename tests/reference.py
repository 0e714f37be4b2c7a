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
  """N simulated workers running Algorithm 1 with partitioned chunk masks."""

  def __init__(self, params, compressed, n, *, density, lr_fn, b1=0.9,
               b2=0.95, eps=1e-8, wd=0.1, clip=None):
    self.n, self.density, self.lr_fn = n, density, lr_fn
    self.b1, self.b2, self.eps, self.wd, self.clip = b1, b2, eps, wd, clip
    self.w = [p.astype(np.float32).copy() for p in params]
    self.compressed = list(compressed)
    self.m = [np.zeros_like(p) for p in self.w]
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
    new_masks, gbar, bbar = [], [], []
    for j, p in enumerate(self.w):
      size = p.size
      if self.compressed[j]:
        in_m = self.mask[j][:size].reshape(p.shape)
        new_masks.append(self._refresh(j, mts))
      else:
        in_m = np.ones(p.shape, bool)
        new_masks.append(None)
      b = self._exchange(j, in_m, mts)
      bbar.append(b)
      gbar.append(np.where(in_m, (b - b1 * self.m[j]) / (1 - b1), 0))
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64)**2)) for g in gbar))
    if self.clip:
      if norm > self.clip:
        gbar = [g * np.float32(self.clip / norm) for g in gbar]
    lr = np.float32(self.lr_fn(t - 1))
    for j in range(len(self.w)):
      v = b2 * self.m[j]**2 + (1 - b2) * gbar[j]**2
      self.m[j] = bbar[j]
      u = (self.m[j] / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + self.eps)
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
      self.e[n][j] = np.where(in_m, 0, mts[n][j]).astype(np.float32)
    return np.mean(np.stack(payloads), axis=0, dtype=np.float32)

  def chunk_mask(self, j, n):
    """Worker n's own chunk mask of leaf j (bool[c]), as used next step."""
    c = self.chunk[j]
    return self.mask[j][n * c:(n + 1) * c]


class LocalAdamReference(ScapeReference):
  """N simulated workers running `scape_local_adam` (docs/design.md):
  each worker clips its own gradient and runs Adam on it per compressed
  leaf, with v replaced by an estimate of the mean gradient's second moment
  from v and w (the moving average of m^**2); its residual holds the
  updates not applied yet; at step t worker n ranks chunk (n + t) % N of
  its current update u by the posterior mean of the workers' mean update,
  |u| / (tau2 + noise), and that mask is used in the same step (step 1 is
  dense); the step at M is the mean of the workers' pending updates there.
  Leaves that are not compressed take Algorithm 1's dense AdamS."""

  def __init__(self, params, compressed, n, **kwargs):
    super().__init__(params, compressed, n, **kwargs)
    self.m_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]
    self.v_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]
    self.w_local = [[np.zeros_like(p) for p in self.w] for _ in range(n)]

  def _clipped(self, worker_grads):
    grads = []
    for g in worker_grads:
      norm = math.sqrt(sum(float(np.sum(x.astype(np.float64)**2)) for x in g))
      scale = self.clip / norm if self.clip and norm > self.clip else 1.0
      grads.append([(x * np.float32(scale)).astype(np.float32) for x in g])
    return grads

  def _score(self, n, j, c1, c2):
    """Worker n's current update of leaf j and its mask score."""
    b1, b2, eps = self.b1, self.b2, self.eps
    m_hat = self.m_local[n][j] / c1
    v_hat = self.v_local[n][j] / c2
    self.w_local[n][j] = b2 * self.w_local[n][j] + (1 - b2) * m_hat**2
    w_hat = self.w_local[n][j] / c2
    c = (1 - b1) / (1 + b1)
    spread = np.maximum(v_hat - w_hat, 0)
    v_mean = np.maximum(w_hat + (1 / self.n - c) / (1 - c) * spread,
                        v_hat / self.n)
    now = m_hat / (np.sqrt(v_mean) + eps)
    noise = c * (1 - 1 / self.n) * (spread / (1 - c)) / (
        np.sqrt(v_mean) + eps)**2
    tau2 = max(float(np.mean(now.astype(np.float64)**2) -
                     np.mean(noise.astype(np.float64))), 1e-12)
    return now, np.abs(now) / (np.float32(tau2) + noise)

  def step(self, worker_grads):
    self.t += 1
    t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
    grads = self._clipped(worker_grads)
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
        for n, g in enumerate(grads):
          self.m_local[n][j] = b1 * self.m_local[n][j] + (1 - b1) * g[j]
          self.v_local[n][j] = b2 * self.v_local[n][j] + (1 - b2) * g[j]**2
          now, score = self._score(n, j, c1, c2)
          pending.append((self.e[n][j] + now).astype(np.float32))
          current.append([score if i == j else None
                          for i in range(len(self.w))])
        if t > 1:  # this step's mask (step 1 is dense); chunk (n + t) % N
          self.mask[j] = self._refresh(j, current, t % self.n)
        in_m = self.mask[j][:p.size].reshape(p.shape)
        for n in range(self.n):
          self.e[n][j] = np.where(in_m, 0, pending[n]).astype(np.float32)
        u = np.where(in_m, np.mean(pending, axis=0, dtype=np.float32), 0)
      self.w[j] = (self.w[j] - lr * (u + self.wd * self.w[j])).astype(
          np.float32)


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
