"""What the local variants lack on eight workers, measured (study only).

`inform(kind)` hands every worker one statistic of the *mean* gradient in
place of its own, through a dense all-reduce that Algorithm 1's wire does
not have (the runs' byte counts leave it out):

  'mask': each worker's next mask is the top-k of the mean over the workers
    of their current updates, not of its own current update;
  'v': Adam's v averages the square of the mean of the workers' (clipped)
    gradients, not of the worker's own.

The rest of the rule is the variant's ('local_adam_now', or
'local_adam_smoothv' for 'mask': `fidelity.INFORMED`). A run that closes
the gap with one of these says that what the workers miss is that
statistic; a rule on Algorithm 1's wire has only the k exchanged values per
chunk to estimate it from. Each study run is its own process, so `inform`
replaces the statistic of `scape_jax.optim._scape_local_adam` for the whole
process.
"""

import jax

from scape_jax.optim import _scape_local_adam


def _pmean(x, axis_name):
  return x if axis_name is None else jax.lax.pmean(x, axis_name)


def _mean_scores(current: list, axis_name) -> list:
  return [None if c is None else _pmean(c, axis_name) for c in current]


# kind -> (the `_scape_local_adam` function it replaces, its replacement).
REPLACEMENTS = {
    'mask': ('mask_scores', _mean_scores),
    'v': ('second_moment_gradient', _pmean),
}


def inform(kind: str) -> None:
  """Gives every worker the mean gradient's statistic `kind` (see above)."""
  if kind not in REPLACEMENTS:
    raise ValueError(f'inform: kind={kind!r}; allowed: '
                     f'{", ".join(REPLACEMENTS)}.')
  name, replacement = REPLACEMENTS[kind]
  setattr(_scape_local_adam, name, replacement)
