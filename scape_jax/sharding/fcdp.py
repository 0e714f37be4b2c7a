"""Per-unit parameter gathers: ZeRO-3, and FCDP's three cuts in its traffic.

Under the fsdp layout each worker holds a 1/F shard of every parameter
(F = 'node' x 'fsdp'). `UnitGather` is the models' parameter hook
(`models.layers.run_unit`): it runs one unit (the embedding, a block, the
output head) under `jax.checkpoint` with its parameters all-gathered from
the shards right before the unit runs, so at most one unit's full
parameters are live. With no switch on this is ZeRO-3: the policy lets no
gathered value be saved for the backward pass, so the backward pass gathers
each unit again, and the transpose of the gather reduce-scatters the
gradients. FCDP (Fully Cached Data Parallel, `shared/papers/fcdp.txt`) adds
three switches, each usable alone (`FcdpOptions`):

* `host_cache` (FCDP-Sched): the gathered value is named `CACHED` with
  `checkpoint_name` and offloaded to 'pinned_host' memory by the checkpoint
  policy (`save_and_offload_only_these_names`); the backward pass reads it
  back from host memory instead of gathering it over the network again.
* `hierarchical`: the gather runs in two steps, over 'node' (inter-node)
  and then over 'fsdp' (intra-node), and its transpose is the matching
  two-step reduce-scatter. With `host_cache`, the value cached is the
  node-level shard (1/(F/nodes) of the parameter, the paper's intra-node
  shard): the backward pass loads it from host memory and rebuilds the full
  parameter with an intra-node all-gather, so the host holds one copy per
  node instead of one per device.
* `lora_aware` (FCDP-Comm): with LoRA, the frozen base weights are kept in
  host memory already gathered (replicated, or split over 'fsdp' only when
  hierarchical) from the start of the run: they are gathered when the run
  initialises or restores them, never in a step. A unit copies them to the
  device (and, hierarchical, all-gathers them within the node); only the
  adapters are gathered and reduce-scattered over the network every step.

Activations follow the model's `remat`: with it nothing else is saved for
the backward pass; without it every matmul output is saved
(`dots_saveable`) and the cheap element-wise work is recomputed. No value
computed from a gathered weight is ever saved on the device, so a unit's
weights do not outlive it (the ZeRO-3 memory bound).
"""

import dataclasses
from typing import Any, Callable, Optional

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from scape_jax import models
from scape_jax.sharding.mesh import FSDP, FSDP_AXES, NODE

CACHED = 'fcdp_cached'  # checkpoint name of the gathered values kept on host
HOST = 'pinned_host'  # memory kind of the cache
DEVICE = 'device'


@dataclasses.dataclass(frozen=True)
class FcdpOptions:
  """The three FCDP switches (module doc); all False is plain ZeRO-3."""
  host_cache: bool = False
  hierarchical: bool = False
  lora_aware: bool = False

  @property
  def uses_host(self) -> bool:
    return self.host_cache or self.lora_aware


def check_memory_kinds(devices, kinds=(HOST, DEVICE)) -> None:
  """Raises ValueError naming the memory kinds `devices` have if one of
  `kinds` is missing."""
  have = {m.kind for m in devices[0].addressable_memories()}
  missing = [k for k in kinds if k not in have]
  if missing:
    raise ValueError(
        f'FCDP keeps its cache in memory kind {missing[0]!r}, which the '
        f'{devices[0].platform} devices do not have; their memory kinds: '
        f'{", ".join(sorted(have))}. Turn off fcdp.host_cache and '
        'fcdp.lora_aware on this backend.')


# XLA's CPU compiler drops the optimization barriers that `jax.checkpoint`
# puts around rematerialised values (pass 'cse_barrier_expander'), and CSE
# then merges each backward-pass re-gather into its forward gather: the CPU
# program would keep every gathered weight alive from the forward to the
# backward pass. GPU and TPU compilers keep the barriers. Per-unit layouts
# compile with that pass off on the CPU, so that the CPU program gathers,
# frees and gathers again as the accelerator's does.
_CPU_OPTIONS = {'xla_disable_hlo_passes': 'cse_barrier_expander'}


def compiler_options(device) -> Optional[dict]:
  """XLA options for per-unit gathers on `device`'s platform (None: none)."""
  return dict(_CPU_OPTIONS) if device.platform == 'cpu' else None


def split_dim(spec: P) -> Optional[int]:
  """The dimension a PartitionSpec splits over the fsdp axes, if any."""
  for dim, entry in enumerate(spec):
    axes = entry if isinstance(entry, tuple) else (entry,)
    if any(a in FSDP_AXES for a in axes):
      return dim
  return None


def cache_spec(spec: P, hierarchical: bool) -> P:
  """Where a frozen weight lives under `lora_aware`: replicated, or split
  over 'fsdp' only (node-level shards) when hierarchical."""
  dim = split_dim(spec)
  if dim is None:
    return spec
  entries = list(spec)
  entries[dim] = FSDP if hierarchical else None
  return P(*entries)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _all_gather(x, axes, dim: int):
  return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


@dataclasses.dataclass(frozen=True)
class UnitGather:
  """The models' parameter hook for the fsdp layout (module doc).

  Attributes:
    options: the FCDP switches.
    axes: the fsdp mesh axes with more than one device ('node', 'fsdp').
    rules: logical axis name -> mesh axes (`specs.LOGICAL_RULES`): a
      variable's first dimension with a rule is the split one.
    lora: the model has LoRA adapters; its other parameters are frozen.
  """
  options: FcdpOptions
  axes: tuple
  rules: tuple
  lora: bool = False

  def __call__(self, fn: Callable[..., Any], modules: tuple, args: tuple,
               remat: bool) -> Any:
    splits = [nnx.split(m) for m in modules]
    graphdefs = [g for g, _ in splits]

    def unit(states, args):
      full = [jax.tree.map(self._full, s, is_leaf=_is_variable)
              for s in states]
      return fn(*[nnx.merge(g, s) for g, s in zip(graphdefs, full)], *args)

    return jax.checkpoint(unit, policy=self.policy(remat))(
        [s for _, s in splits], args)

  def policy(self, remat: bool):
    """Cached values offloaded to host, other gathered values recomputed,
    activations as `remat` says (module doc)."""
    named = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[CACHED],
        offload_src=DEVICE, offload_dst=HOST)
    activations = (jax.checkpoint_policies.nothing_saveable if remat else
                   jax.checkpoint_policies.dots_saveable)

    def policy(prim, *args, **params):
      if prim.name == 'name':  # checkpoint_name
        return named(prim, *args, **params)
      return activations(prim, *args, **params)

    return policy

  def _dim(self, variable: nnx.Variable) -> Optional[int]:
    names = variable.get_metadata().get(models.layers.SHARDING_KEY) or ()
    mapping = dict(self.rules)
    for dim, name in enumerate(names):
      if name in mapping:
        return dim
    return None

  def _frozen(self, variable: nnx.Variable) -> bool:
    return self.lora and not isinstance(variable, nnx.LoRAParam)

  def _full(self, variable: nnx.Variable) -> nnx.Variable:
    value, dim = variable.get_value(), self._dim(variable)
    if self._frozen(variable) and self.options.lora_aware:
      value = self._from_host_cache(value, dim)
    elif dim is not None:
      value = self._gather(value, dim)
    return variable.replace(value)

  def _from_host_cache(self, value, dim: Optional[int]):
    """A frozen weight: host -> device, and the intra-node gather if it is
    kept as node-level shards. Recomputed (reloaded) in the backward pass."""
    value = jax.device_put(value, jax.memory.Space.Device)
    if dim is not None and self.options.hierarchical and FSDP in self.axes:
      value = _all_gather(value, FSDP, dim)
    return value

  def _cache(self, value):
    return checkpoint_name(value, CACHED) if self.options.host_cache else value

  def _gather(self, value, dim: int):
    if not self.options.hierarchical:
      return self._cache(_all_gather(value, self.axes, dim))
    if NODE in self.axes:
      value = _all_gather(value, NODE, dim)  # inter-node
    value = self._cache(value)
    if FSDP in self.axes:
      value = _all_gather(value, FSDP, dim)  # intra-node
    return value
