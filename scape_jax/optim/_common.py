"""What every optimizer here shares: defaults, type aliases, checks, bias
correction, and the per-worker state helpers of the methods that exchange
themselves.

Defaults follow the SCAPE paper's Llama-500M run (design note, section 1).
"""

import functools
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scape_jax.comm import axes, masks, topk
from scape_jax.comm.collectives import varying

B1 = 0.9  # Decay rate of the first moment.
B2 = 0.95  # Weight of the previous first moment squared (AdamS) / second moment.
EPS = 1e-8  # Added to the denominator of the direction.
WEIGHT_DECAY = 0.1  # Decoupled weight decay.
CLIP_NORM = 1.0  # Global-norm clip of the (mean) gradient.

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
# A tree of bools shaped like the params, or a callable `params -> tree`, in
# the style of optax's `mask` arguments.
MaskOrFn = Union[Any, Callable[[optax.Params], Any], None]


def _check(where: str, name: str, value, ok, allowed: str) -> None:
  """Raises ValueError unless `ok(float(value))`; traced values pass.

  Hyperparameters may be arrays (`optax.inject_hyperparams`); a traced one
  cannot be checked here.
  """
  if isinstance(value, jax.core.Tracer):
    return
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not (math.isfinite(number) and ok(number)):
    raise ValueError(f'{where}: {name}={value!r} must be {allowed}.')


def _is_number(value) -> bool:
  """Whether `value` is a real scalar: a Python or NumPy number (not a bool
  or a string) or a scalar array of an integer or float dtype (traced ones
  included, as `optax.inject_hyperparams` passes them)."""
  if isinstance(value, (bool, np.bool_, str, bytes)):
    return False
  if isinstance(value, numbers.Real):
    return True
  dtype = getattr(value, 'dtype', None)
  return (getattr(value, 'shape', None) == () and dtype is not None
          and (jnp.issubdtype(dtype, jnp.floating)
               or jnp.issubdtype(dtype, jnp.integer)))


def check_scalar_or_schedule(where: str, name: str, value, ok,
                             allowed: str) -> None:
  """Raises ValueError unless `value` is a schedule (a callable of the step)
  or a number with `ok(float(value))` (traced numbers pass)."""
  if callable(value):
    return
  allowed = f'{allowed}, or an optax schedule (a callable of the step)'
  if not _is_number(value):
    raise ValueError(f'{where}: {name}={value!r} must be {allowed}.')
  _check(where, name, value, ok, allowed)


def scale_by_learning_rate(where: str, learning_rate: ScalarOrSchedule
                           ) -> optax.GradientTransformation:
  """`optax.scale_by_learning_rate` of a checked learning rate: a number
  >= 0, a schedule, or None (no scaling, as in optax)."""
  if learning_rate is not None:
    check_scalar_or_schedule(where, 'learning_rate', learning_rate,
                             lambda x: x >= 0.0, 'a finite number >= 0')
  return optax.scale_by_learning_rate(learning_rate)


def check_transformation(where: str, name: str, tx) -> None:
  """Raises TypeError unless `tx` has callable `init` and `update`, as an
  `optax.GradientTransformation` has."""
  if not (callable(getattr(tx, 'init', None))
          and callable(getattr(tx, 'update', None))):
    raise TypeError(f'{where}: {name}={tx!r} must be an optax '
                    'GradientTransformation (with init and update).')


def check_betas(where: str, b1: float, b2: float) -> None:
  """Raises ValueError unless b1 and b2 are in [0, 1)."""
  for name, value in (('b1', b1), ('b2', b2)):
    check_decay(where, name, value)


def check_moments(where: str, b1: float, b2: float, eps: float,
                  clip_norm: Optional[float] = None) -> None:
  """Raises ValueError unless b1, b2 are in [0, 1), eps > 0 and clip_norm
  (None: no clip) >= 0."""
  check_betas(where, b1, b2)
  check_eps(where, eps)
  if clip_norm is not None:
    check_non_negative(where, 'clip_norm', clip_norm)


def check_decay(where: str, name: str, value: float) -> None:
  """Raises ValueError unless a decay rate is in [0, 1)."""
  _check(where, name, value, lambda x: 0.0 <= x < 1.0, 'in [0, 1)')


def check_eps(where: str, eps: float) -> None:
  """Raises ValueError unless eps is finite and > 0 (0 divides 0 by 0),
  also in float32 (the state's dtype: a smaller eps rounds to 0 there)."""
  tiny = float(np.finfo(np.float32).tiny)
  _check(where, 'eps', eps, lambda x: x >= tiny,
         f'finite and >= {tiny:.3g} (smaller is 0 in float32)')


def check_non_negative(where: str, name: str, value: float) -> None:
  _check(where, name, value, lambda x: x >= 0.0, 'finite and >= 0')


def check_static(where: str, name: str, value) -> None:
  """Raises ValueError if `value` is an array: it fixes shapes or programs.

  `optax.inject_hyperparams` turns every numeric argument into an array
  unless it is listed in `static_args`.
  """
  if isinstance(value, jax.Array):
    raise ValueError(
        f'{where}: {name} must be a Python number, got an array '
        f'{jax.typeof(value)}: it fixes shapes or compiled programs. With '
        f'optax.inject_hyperparams, list {name!r} in static_args.')


def check_int(where: str, name: str, value, low: int,
              high: Optional[int] = None, why: str = '') -> None:
  """Raises ValueError unless `value` is an integer in [low, high]."""
  check_static(where, name, value)
  ok = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        and value >= low and (high is None or value <= high))
  if not ok:
    allowed = (f'an integer >= {low}' if high is None else
               f'an integer in [{low}, {high}]')
    raise ValueError(f'{where}: {name}={value!r} must be {allowed}{why}.')


def add_decayed_weights(where: str, weight_decay, mask: MaskOrFn = None,
                        name: str = 'weight_decay_mask'
                        ) -> optax.GradientTransformation:
  """`optax.add_decayed_weights`, the decoupled weight decay of the aliases,
  after checking that `weight_decay` >= 0 (a traced value passes); its init
  refuses a `mask` tree that is not a prefix of the params, by `name`."""
  check_non_negative(where, 'weight_decay', weight_decay)
  tx = optax.add_decayed_weights(weight_decay, mask)
  if mask is None:
    return tx

  def init_fn(params):
    check_prefix(where, name, mask(params) if callable(mask) else mask,
                 params)
    return tx.init(params)

  return optax.GradientTransformation(init_fn, tx.update)


def check_prefix(where: str, name: str, prefix, tree, is_leaf=None) -> None:
  """Raises ValueError, naming `name` and both structures, unless the
  optax-style mask tree `prefix` is a tree prefix of `tree`."""
  try:
    jax.tree.map(lambda *_: None, prefix, tree, is_leaf=is_leaf)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'{where}: the {name} tree {jax.tree.structure(prefix)} is not a '
        f'prefix of the params {jax.tree.structure(tree)}.') from e


def unfoldable_one(count: jax.Array) -> jax.Array:
  """fp32 1 computed from an optimizer's step count (never negative), which
  XLA cannot fold. Multiplying or dividing by it is exact, and makes an
  expression that XLA neither shares with another nor simplifies away:
  used to choose what XLA stores once and what it computes again."""
  return jnp.where(count >= 0, 1.0, 2.0).astype(jnp.float32)


def bias_corrections(count, b1, b2) -> tuple:
  """(1 - b1^t, 1 - b2^t) in float32 for step t = count."""
  t = count.astype(jnp.float32)
  return (1.0 - jnp.asarray(b1, jnp.float32) ** t,
          1.0 - jnp.asarray(b2, jnp.float32) ** t)


def bias_corrected_direction(mu, nu, count, *, b1, b2, eps):
  """`(mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t)) + eps)` for step t = count.

  `mu` and `nu` are trees (or lists) of the same structure.
  """
  c1, c2 = bias_corrections(count, b1, b2)
  return jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)


def leaf_flags(where: str, name: str, params, tree_or_fn: MaskOrFn,
               default: Callable[[jax.Array], bool]) -> list:
  """One bool per leaf of `params` from an optax-style mask argument.

  Args:
    where: the caller, for error messages.
    name: the argument's name, for error messages.
    params: the parameter tree (arrays or shapes).
    tree_or_fn: a tree of bools shaped like `params`, a callable
      `params -> tree`, or None.
    default: the flag of a leaf when `tree_or_fn` is None.

  Returns:
    A list of Python bools in `jax.tree.leaves(params)` order.
  """
  leaves, treedef = jax.tree.flatten(params)
  if tree_or_fn is None:
    return [bool(default(p)) for p in leaves]
  tree = tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn
  try:
    flags = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'{where}: the {name} tree does not match the params: expected a '
        f'tree of bools with structure {treedef}, got '
        f'{jax.tree.structure(tree)}.') from e
  for flag in flags:
    if not isinstance(flag, (bool, np.bool_)):
      raise ValueError(f'{where}: {name} entries must be bools, got {flag!r}.')
  return [bool(f) for f in flags]


def axis_context(where: str, axis_name: Union[None, str, tuple]) -> tuple:
  """(N, local) for an optimizer that exchanges over `axis_name`.

  `local` means a bound axis (inside `shard_map`) or no axis: per-worker
  state then has a leading size 1. Outside `shard_map`, `init` may run under
  `jax.set_mesh(mesh)`; then `local` is False and per-worker state has a
  leading size N (the global view).

  Args:
    where: the caller ('radius init', ...), for error messages.
    axis_name: the data-parallel mesh axis (or a tuple of axes, flattened),
      or None for a single worker.
  """
  names = axes.axis_names(axis_name, containers=(tuple,), allow_empty=False,
                         where=where)
  if not names:
    return 1, True
  try:
    return jax.lax.axis_size(axis_name), True
  except NameError:
    pass
  mesh = jax.sharding.get_abstract_mesh()
  if (where.endswith('init') and not mesh.empty and
      all(n in mesh.axis_names for n in names)):
    return math.prod(mesh.shape[n] for n in names), False
  raise ValueError(
      f'{where}: axis_name={axis_name!r} is not bound. Call update inside '
      f'jax.shard_map over a mesh with a {axis_name!r} axis (init also works '
      'under jax.set_mesh(mesh)), or pass axis_name=None for a single '
      'worker.')


def per_worker(x: jax.Array, leading: int, axis_name: Optional[str],
               local: bool) -> jax.Array:
  """`x` with a leading worker axis of size `leading`, typed per worker."""
  x = jnp.broadcast_to(x, (leading,) + x.shape)
  return varying(x, axis_name) if local else x


def check_per_worker_state(where: str, norm: jax.Array) -> None:
  """Raises unless a per-worker state field has the local leading size 1."""
  if norm.shape[:1] != (1,):
    raise ValueError(
        f'{where}: per-worker state has leading size {norm.shape[:1]}, '
        'expected 1. Pass the state through shard_map with '
        'in_specs=scape_jax.state_partition_specs(state).')


def passes_empty_trees(update_fn: Callable) -> Callable:
  """`update_fn` that returns a tree with no array leaves, and the state,
  unchanged.

  `optax.masked` and `optax.multi_transform` hand a transformation only
  `MaskedNode`s when no parameter is selected for it, and optax's own
  transformations then do nothing. So do the methods here: no collective is
  issued, and every worker sees the same empty tree.
  """

  @functools.wraps(update_fn)
  def wrapped(updates, state, params=None, **extra_args):
    if not jax.tree.leaves(updates):
      return updates, state
    return update_fn(updates, state, params, **extra_args)

  return wrapped


def state_stats(opt_state, state_type: type, fields: Sequence[str]) -> dict:
  """`fields` of the first `state_type` inside `opt_state` (a method's
  statistics for the metrics), or {} if it holds none."""
  is_state = lambda x: isinstance(x, state_type)  # noqa: E731
  for s in jax.tree.leaves(opt_state, is_leaf=is_state):
    if is_state(s):
      return {f: getattr(s, f) for f in fields}
  return {}


def at_density_level(step: Callable[..., Any], density_level,
                     levels: Sequence[float], scheduled_level):
  """`step(level)` at the trainer's static `density_level` if given, else at
  `scheduled_level` (traced) through a `lax.switch` over every level. A
  range `(first, last)` of sparse levels is one program:
  `step(first, live=level)`, its buffers sized for `first` (the largest k
  of the range) and `scheduled_level`, clamped to the range, in force.

  Raises:
    ValueError: `density_level` is not an integer in 0..len(levels) - 1
      (a float such as 0.5 was truncated to a level), nor a range
      (first, last) with 1 <= first <= last <= len(levels) - 1.
  """
  if isinstance(density_level, tuple):
    whole = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                for x in density_level)
    if not (whole and len(density_level) == 2
            and 1 <= density_level[0] <= density_level[1] < len(levels)):
      raise ValueError(f'scape: density_level={density_level!r}; a range '
                       'of levels is (first, last) with 1 <= first <= last '
                       f'<= {len(levels) - 1} (levels {levels}).')
    first, last = (int(x) for x in density_level)
    return step(first, live=jnp.clip(scheduled_level, first, last))
  if density_level is not None:
    whole = (isinstance(density_level, (int, np.integer))
             and not isinstance(density_level, bool))
    if not (whole and 0 <= density_level < len(levels)):
      raise ValueError(f'scape: density_level={density_level!r}; allowed: '
                       f'an integer in 0..{len(levels) - 1} (levels '
                       f'{levels}).')
    return step(int(density_level))
  if len(levels) == 1:
    return step(0)
  return jax.lax.switch(scheduled_level, [functools.partial(step, i)
                                          for i in range(len(levels))])


def compress_except(parts: Union[str, Sequence[str]],
                    where: str = 'compress_except', matrices=None):
  """A `compress` for SCAPE that sends whole, besides the leaves of rank < 2
  (norms, biases), every leaf whose path (`jax.tree_util.keystr`) contains
  one of `parts` (e.g. ['embed_tokens', 'lm_head'], or one str: one part).
  A part that matches no leaf is a ValueError naming it and `where`.
  `matrices`, a callable `params -> tree of bools`, says which leaves have
  rank >= 2 where ndim does not (`models.matrices`: a scanned model's
  stacked norm scales are not matrices). None when neither is given."""
  named = leaves_named(parts, where)
  if named is None and matrices is None:
    return None

  def compress(tree):
    ranked = (jax.tree.map(lambda x: x.ndim >= 2 and x.size > 0, tree)
              if matrices is None else matrices(tree))
    if named is None:
      return ranked
    return jax.tree.map(lambda r, n: bool(r) and not n, ranked, named(tree))

  return compress


def leaves_named(parts: Union[str, Sequence[str]], where: str):
  """A callable tree -> tree of bools: True where the leaf's path
  (`jax.tree_util.keystr`) contains one of `parts`; None if `parts` holds no
  non-empty string. A part that matches no leaf is a ValueError naming it
  and `where`. A str is one part, not a sequence of one-letter parts;
  anything but a str or a list or tuple of str is a ValueError."""
  if isinstance(parts, str):
    parts = [parts]
  elif not (isinstance(parts, (list, tuple))
            and all(isinstance(p, str) for p in parts)):
    raise ValueError(f'{where}: parts={parts!r} must be a str or a list or '
                     'tuple of str (parts of parameter paths).')
  parts = [p.strip() for p in parts if p.strip()]
  if not parts:
    return None

  def named(tree):
    paths = [jax.tree_util.keystr(path) for path, _ in
             jax.tree_util.tree_flatten_with_path(tree)[0]]
    unmatched = [p for p in parts if not any(p in path for path in paths)]
    if unmatched:
      raise ValueError(f'{where}: {unmatched} match no parameter path; the '
                       f'paths are {paths}')
    return jax.tree_util.tree_map_with_path(
        lambda path, x: any(p in jax.tree_util.keystr(path) for p in parts),
        tree)

  return named


def next_chunk_masks(chunk_of: Callable, layouts, k_levels, level: int,
                     next_level, select: str) -> list:
  """Each compressed leaf's next own chunk mask, uint32[1, w] (None where
  `layouts[j]` is None): the top-k of |scores| over the chunk
  `chunk_of(j)` = (scores, num_valid), all leaves in one
  `topk.chunks_topk_words` call (the radix selects take them in one set of
  passes). `k_levels[j][level]` (static) is the top-k width; levels never
  increase, so the next step's k (`next_level`, traced) is a prefix of it.
  A leaf dense at every level, or at a static `next_level` (an int), gets
  all ones, with no search compiled."""
  least = (lambda k: k[next_level]) if isinstance(next_level, int) else min
  chosen = [j for j, layout in enumerate(layouts)
            if layout is not None and least(k_levels[j]) < layout.chunk_size]
  out = [None if layout is None or j in chosen else masks.ones_words(
      layout.chunk_size, (1,)) for j, layout in enumerate(layouts)]
  chunks = [chunk_of(j) for j in chosen]
  words = topk.chunks_topk_words(
      [x for x, _ in chunks], [n for _, n in chunks],
      [k_levels[j][level] for j in chosen],
      [jnp.asarray(k_levels[j], jnp.int32)[next_level] for j in chosen],
      select=select)
  for j, w in zip(chosen, words):
    out[j] = w[None]
  return out
