"""An independent NumPy re-implementation of DiLoCo/Pier with AdamW inside.

Written from `shared/design/methods.md` (DiLoCo / Pier) and Pier's
Algorithms 1-2 with plain loops over groups and workers; it shares no code
with `scape_jax`.
"""

import numpy as np


class AdamW:
  """optax.adamw on one copy of the parameters (a list of arrays)."""

  def __init__(self, params, lr, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
    self.m = [np.zeros_like(p) for p in params]
    self.v = [np.zeros_like(p) for p in params]
    self.t = 0

  def step(self, params, grads):
    self.t += 1
    out = []
    for j, (p, g) in enumerate(zip(params, grads)):
      self.m[j] = self.b1 * self.m[j] + (1 - self.b1) * g
      self.v[j] = self.b2 * self.v[j] + (1 - self.b2) * g * g
      m_hat = self.m[j] / (1 - self.b1**self.t)
      v_hat = self.v[j] / (1 - self.b2**self.t)
      u = m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * p
      out.append(p - self.lr * u)
    return out


def diloco_reference(params, grads, *, sync_every, lazy_steps, warmup,
                     mu_of, outer_lr_of, lr, mu0=0.9):
  """Yields (groups' params, M, theta_old) after every step t = 1, 2, ...

  Args:
    params: the starting parameters (a list of arrays).
    grads: grads[t - 1][g][w] = worker w of group g's gradient (a list).
    sync_every: r.
    lazy_steps: L; steps t <= L average the gradient over every worker.
    warmup: accumulate M every r lazy steps.
    mu_of, outer_lr_of: t -> the outer momentum and learning rate.
    lr: the inner AdamW learning rate.
    mu0: the warmup momentum.
  """
  groups = len(grads[0])
  theta = [[p.astype(np.float64) for p in params] for _ in range(groups)]
  adam = [AdamW(params, lr) for _ in range(groups)]
  old = [p.astype(np.float64) for p in params]
  momentum = [np.zeros_like(p) for p in old]
  for t, per_group in enumerate(grads, start=1):
    lazy = t <= lazy_steps
    everyone = [np.mean([w[j] for grp in per_group for w in grp], axis=0)
                for j in range(len(params))]
    for g in range(groups):
      mean = everyone if lazy else [
          np.mean([w[j] for w in per_group[g]], axis=0)
          for j in range(len(params))]
      theta[g] = adam[g].step(theta[g], mean)
    if lazy:
      if warmup and t % sync_every == 0:  # Algorithm 1, lines 4-7
        momentum = [mu0 * m + (x - o) for m, x, o in zip(momentum, theta[0],
                                                         old)]
        old = list(theta[0])
      elif t == lazy_steps:  # the switch: theta_old is the model here
        old = list(theta[0])
    elif t % sync_every == 0:  # Algorithm 2, lines 10-21
      delta = [np.mean([theta[g][j] - old[j] for g in range(groups)], axis=0)
               for j in range(len(params))]
      mu, olr = mu_of(t), outer_lr_of(t)
      momentum = [mu * m + d for m, d in zip(momentum, delta)]
      new = [o + olr * (mu * m + d) for o, m, d in zip(old, momentum, delta)]
      theta = [list(new) for _ in range(groups)]
      old = list(new)
    yield ([list(x) for x in theta], list(momentum), list(old))
