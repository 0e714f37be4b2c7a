"""PartitionSpecs of parameters (from logical axes) and of optimizer states.

Parameters carry logical axis names (`models.LOGICAL_AXES`); `LOGICAL_RULES`
maps them to mesh axes, as MaxText's logical-axis rules do. Optimizer states
are placed by `state_partition_specs`:

* the fields a state `NamedTuple` lists in its class attribute
  `PER_WORKER_FIELDS` differ per data-parallel worker and carry a leading
  worker axis: they are split over the data axis;
* subtrees shaped like the parameters (moments) get the parameters' specs;
* everything else (counts, statistics) is replicated.
"""

from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

from scape_jax.comm.axes import axis_names
from scape_jax.sharding.mesh import DATA, FSDP, FSDP_AXES, NODE, REPLICA

# Logical axis -> mesh axes under the fsdp layout: every weight is split over
# the fsdp group ('fsdp' x 'node') along its model dimension (MaxText's rule
# for 'embed').
LOGICAL_RULES = (('embed', FSDP_AXES),)


def _is_names(x) -> bool:
  return isinstance(x, tuple) and all(n is None or isinstance(n, str)
                                      for n in x)


def _entry(axes, sizes: dict):
  """A PartitionSpec entry for `axes`, leaving out axes of size 1."""
  axes = axes if isinstance(axes, tuple) else (axes,)
  kept = tuple(a for a in axes if sizes.get(a, 1) > 1)
  return kept[0] if len(kept) == 1 else (kept or None)


def param_partition_specs(abstract_params, logical_axes, *, fsdp: int = 1,
                          nodes: int = 1, rules: Sequence = LOGICAL_RULES):
  """The PartitionSpec of every parameter from its logical axis names.

  Args:
    abstract_params: a tree of arrays or `jax.ShapeDtypeStruct`s.
    logical_axes: the same tree with a tuple of logical names per leaf (one
      per dimension; None for an unnamed one).
    fsdp: the size of the whole fsdp group; 1 replicates every parameter.
    nodes: how many nodes it spans (the 'node' axis); 'fsdp' has the rest.
    rules: (logical name, mesh axes) pairs; the first dimension whose name
      has a rule is split (over those of its axes larger than 1).

  Returns:
    A tree of PartitionSpecs shaped like `abstract_params`.

  Raises:
    ValueError: a split dimension is not divisible by the axis size.
  """
  if fsdp == 1:
    return jax.tree.map(lambda _: P(), abstract_params)
  mapping = dict(rules)
  sizes = {NODE: nodes, FSDP: fsdp // nodes}
  paths = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  names = jax.tree.leaves(logical_axes, is_leaf=_is_names)
  if len(names) != len(paths):
    raise ValueError(f'logical_axes has {len(names)} leaves, the params '
                     f'{len(paths)}.')
  specs, problems = [], []
  for (path, x), leaf_names in zip(paths, names):
    spec = [None] * len(x.shape)
    for dim, name in enumerate(leaf_names):
      if name in mapping:
        if x.shape[dim] % fsdp:
          problems.append(
              f'{jax.tree_util.keystr(path)}: dimension {dim} ({name!r}) of '
              f'shape {tuple(x.shape)} is not divisible by mesh.fsdp={fsdp}')
        spec[dim] = _entry(mapping[name], sizes)
        break
    specs.append(P(*spec))
  if problems:
    raise ValueError('the fsdp layout cannot split these parameters:\n  '
                     + '\n  '.join(problems))
  return jax.tree.unflatten(jax.tree.structure(abstract_params), specs)


def _per_worker(node) -> tuple:
  return getattr(type(node), 'PER_WORKER_FIELDS', ())


def _shapes(tree):
  return jax.tree.map(lambda x: tuple(x.shape), tree)


def state_partition_specs(opt_state, axis_name: Optional[str] = DATA, *,
                          params: Any = None, param_specs: Any = None):
  """PartitionSpecs for an optimizer state (concrete or abstract).

  Args:
    opt_state: the state, as `tx.init` returns it outside `shard_map`.
    axis_name: the data-parallel axis that per-worker fields are split over
      (a str, a tuple of them, or None: not split).
    params: the (abstract) parameters; with `param_specs`, subtrees of the
      state shaped like them get `param_specs`.
    param_specs: the parameters' PartitionSpecs.

  Returns:
    A tree of PartitionSpecs with the structure of `opt_state`.

  Raises:
    ValueError: `axis_name` is not None, a str or a tuple of str, or
      `param_specs` shards a parameter and the state has
      per-worker fields (SCAPE's residual and masks, Radius's, DeMo's).
  """
  axis_names(axis_name, containers=(tuple,), allow_empty=False,
             where='state_partition_specs')
  ptree = None if params is None else jax.tree.structure(params)
  pshapes = None if params is None else _shapes(params)

  def mirrors_params(node) -> bool:
    if ptree is None or param_specs is None:
      return False
    try:
      return (jax.tree.structure(node) == ptree and
              _shapes(node) == pshapes)
    except (TypeError, AttributeError):
      return False

  def is_leaf(node) -> bool:
    return bool(_per_worker(node)) or mirrors_params(node)

  sharded = [s for s in jax.tree.leaves(
      param_specs, is_leaf=lambda x: isinstance(x, P)) if any(s)]

  def specs(node):
    if mirrors_params(node):
      return param_specs
    fields = _per_worker(node)
    if not fields:
      return jax.tree.map(lambda _: P(), node)
    if sharded:
      raise ValueError(
          f'{type(node).__name__} keeps per-worker fields {sorted(fields)} '
          'shaped like whole parameters, so the method needs replicated '
          f'parameters; param_specs shards some ({sharded[0]}). Pass '
          'param_specs=None, or use a dense method (AdamW, AdamS) on '
          'sharded parameters.')
    return node._replace(**{
        f: jax.tree.map(lambda _: P(axis_name) if f in fields else P(),
                        getattr(node, f)) for f in node._fields})

  return jax.tree.map(specs, opt_state, is_leaf=is_leaf)


def with_replica_axis(specs):
  """Prepends the 'replica' axis to every PartitionSpec of a tree."""
  return jax.tree.map(lambda s: P(REPLICA, *s), specs,
                      is_leaf=lambda x: isinstance(x, P))
