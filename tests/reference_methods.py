"""Independent NumPy re-implementations of Radius and DeMo.

Written from the papers (radius.txt Algorithms 1-2, demo.txt Algorithm 1 and
Section 3.3) and the pinned choices in `shared/design/methods.md` /
`docs/design.md`, with plain loops over workers, leaves and chunks. They
share no code with `scape_jax`.
"""

import math
from fractions import Fraction

import numpy as np


def _f32(x):
  return np.asarray(x, np.float32)


class RadiusReference:
  """N simulated workers running Radius (AdamW update, shared masks)."""

  def __init__(self, params, compressed, n, *, density, interval, threshold,
               lr_fn, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, clip=None,
               index_radius=0):
    self.n, self.interval, self.threshold = n, interval, threshold
    self.lr_fn, self.b1, self.b2, self.eps, self.wd = lr_fn, b1, b2, eps, wd
    self.clip, self.r = clip, index_radius
    self.w = [_f32(p).copy() for p in params]
    self.m = [np.zeros_like(p) for p in self.w]
    self.v = [np.zeros_like(p) for p in self.w]
    self.k, self.sparse = [], []
    for p, c in zip(self.w, compressed):
      k = max(1, min(p.size, math.ceil(Fraction(repr(float(density))) *
                                       p.size)))
      self.k.append(k)
      self.sparse.append(c and min(p.size, k * (2 * index_radius + 1))
                         < p.size)
    # Masks as flat bool arrays (None: no selection yet / dense leaf).
    self.mask = [None] * len(self.w)
    self.e = [[np.zeros_like(p) if s else None
               for p, s in zip(self.w, self.sparse)] for _ in range(n)]
    self.t = 0
    self.kinds = []

  def kind(self, t):
    first = max(1, -(-self.threshold // self.interval)) * self.interval
    if t >= self.threshold and t >= 1 and t % self.interval == 0:
      return 'resample'
    return 'sparse' if t > first else 'dense'

  def _exchange(self, j, grads, kind):
    """The mean gradient of leaf j; updates the residuals."""
    if kind == 'sparse' and self.sparse[j]:
      sel = self.mask[j].reshape(self.w[j].shape) if self.mask[j] is not None \
          else np.zeros(self.w[j].shape, bool)
      mean = np.mean([grads[w][j] for w in range(self.n)], axis=0)
      for w in range(self.n):
        self.e[w][j] = self.e[w][j] + np.where(sel, 0, grads[w][j])
      return np.where(sel, mean, 0).astype(np.float32)
    if kind == 'resample' and self.sparse[j]:
      total = [grads[w][j] + self.e[w][j] for w in range(self.n)]
      for w in range(self.n):
        self.e[w][j] = np.zeros_like(self.w[j])
      return np.mean(total, axis=0).astype(np.float32)
    return np.mean([grads[w][j] for w in range(self.n)],
                   axis=0).astype(np.float32)

  def _select(self, j, u):
    order = np.argsort(-np.abs(u).ravel(), kind='stable')[:self.k[j]]
    sel = np.zeros(u.size, bool)
    for i in order:
      sel[max(0, i - self.r):i + self.r + 1] = True
    return sel

  def step(self, grads):
    """grads[w][j]: worker w's gradient of leaf j. Returns the clip norm."""
    self.t += 1
    t, kind = self.t, self.kind(self.t)
    self.kinds.append(kind)
    mean = [self._exchange(j, grads, kind) for j in range(len(self.w))]
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64)**2))
                         for g in mean))
    if self.clip and norm >= self.clip:
      mean = [g / norm * self.clip for g in mean]
    lr = float(self.lr_fn(t - 1))
    for j, g in enumerate(mean):
      self.m[j] = self.b1 * self.m[j] + (1 - self.b1) * g
      self.v[j] = self.b2 * self.v[j] + (1 - self.b2) * g * g
      mhat = self.m[j] / (1 - self.b1**t)
      vhat = self.v[j] / (1 - self.b2**t)
      u = mhat / (np.sqrt(vhat) + self.eps) + self.wd * self.w[j]
      if kind == 'resample' and self.sparse[j]:
        self.mask[j] = self._select(j, u)
      self.w[j] = _f32(self.w[j] - lr * u)
    return norm


def dct_matrix(n):
  """Orthonormal DCT-II, from its definition, in float64."""
  d = np.zeros((n, n))
  for k in range(n):
    scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
    for i in range(n):
      d[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
  return d


def chunk_side(n, limit):
  return max(d for d in range(1, min(n, limit) + 1) if n % d == 0) if n \
      else 1


def matrix_view(shape):
  if len(shape) == 0:
    return 1, 1
  if len(shape) == 1:
    return 1, shape[0]
  return int(np.prod(shape[:-1])), shape[-1]


class DemoReference:
  """N simulated workers running DeMo's signum variant."""

  def __init__(self, params, n, *, beta, chunk, topk, lr_fn, wd=0.1):
    self.n, self.beta, self.chunk, self.topk = n, beta, chunk, topk
    self.lr_fn, self.wd = lr_fn, wd
    self.w = [_f32(p).copy() for p in params]
    self.m = [[np.zeros(p.shape, np.float64) for p in self.w]
              for _ in range(n)]
    self.t = 0
    self.duplicates = 0  # coefficients sent by more than one worker
    self.singles = 0  # coefficients sent by exactly one worker

  def _blocks(self, shape):
    rows, cols = matrix_view(shape)
    s0, s1 = chunk_side(rows, self.chunk), chunk_side(cols, self.chunk)
    k = min(self.topk, s0 * s1)
    blocks = [(a, b) for a in range(rows // s0) for b in range(cols // s1)]
    return rows, cols, s0, s1, k, blocks

  def step(self, grads):
    self.t += 1
    lr = float(self.lr_fn(self.t - 1))
    for j, w in enumerate(self.w):
      rows, cols, s0, s1, k, blocks = self._blocks(w.shape)
      d0, d1 = dct_matrix(s0), dct_matrix(s1)
      sent = {blk: {} for blk in blocks}  # block -> index -> [values]
      for wk in range(self.n):
        m = self.beta * self.m[wk][j] + grads[wk][j]
        mat = m.reshape(rows, cols)
        for (a, b) in blocks:
          x = mat[a * s0:(a + 1) * s0, b * s1:(b + 1) * s1]
          coef = (d0 @ x @ d1.T).ravel()
          top = np.argsort(-np.abs(coef), kind='stable')[:k]
          kept = np.zeros_like(coef)
          kept[top] = coef[top]
          for i in top:
            sent[(a, b)].setdefault(int(i), []).append(coef[i])
          x -= d0.T @ kept.reshape(s0, s1) @ d1  # in place: m - q
        self.m[wk][j] = mat.reshape(w.shape)
      q = np.zeros((rows, cols))
      for (a, b), by_index in sent.items():
        coef = np.zeros(s0 * s1)
        for i, vals in by_index.items():
          coef[i] = np.mean(vals)
          self.duplicates += len(vals) > 1
          self.singles += len(vals) == 1
        q[a * s0:(a + 1) * s0, b * s1:(b + 1) * s1] = (
            d0.T @ coef.reshape(s0, s1) @ d1)
      update = np.sign(q).reshape(w.shape) + self.wd * w
      self.w[j] = _f32(w - lr * update)
