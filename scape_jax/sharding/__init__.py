"""The mesh, logical-axis rules, PartitionSpecs and parameter layouts.

`fcdp`, `FcdpOptions` and `Layout` wrap Flax modules and so need the
`[train]` extra; they are imported on first use, so that `import scape_jax`
needs only jax, optax and numpy.
"""

import importlib

from scape_jax.sharding.mesh import BATCH_AXES
from scape_jax.sharding.mesh import DATA
from scape_jax.sharding.mesh import FSDP
from scape_jax.sharding.mesh import FSDP_AXES
from scape_jax.sharding.mesh import MESH_AXES
from scape_jax.sharding.mesh import NODE
from scape_jax.sharding.mesh import REPLICA
from scape_jax.sharding.mesh import TENSOR
from scape_jax.sharding.mesh import make_mesh
from scape_jax.sharding.memory import available_memory_kinds
from scape_jax.sharding.memory import offload_memory_kinds
from scape_jax.sharding.memory import state_shardings
from scape_jax.sharding.placement import init_sharded
from scape_jax.sharding.placement import place
from scape_jax.sharding.placement import place_replicas
from scape_jax.sharding.specs import LOGICAL_RULES
from scape_jax.sharding.specs import param_partition_specs
from scape_jax.sharding.specs import state_partition_specs
from scape_jax.sharding.specs import with_replica_axis

__all__ = [
    'BATCH_AXES', 'DATA', 'FSDP', 'FSDP_AXES', 'FcdpOptions', 'LOGICAL_RULES',
    'Layout', 'MESH_AXES', 'NODE', 'REPLICA', 'TENSOR',
    'available_memory_kinds', 'fcdp', 'init_sharded', 'make_mesh',
    'offload_memory_kinds', 'param_partition_specs', 'place',
    'place_replicas', 'state_partition_specs', 'state_shardings',
    'with_replica_axis',
]

_NEEDS_FLAX = {'fcdp': ('scape_jax.sharding.fcdp', None),
               'FcdpOptions': ('scape_jax.sharding.fcdp', 'FcdpOptions'),
               'Layout': ('scape_jax.sharding.layout', 'Layout')}


def __getattr__(name):  # PEP 562: the Flax-backed names, imported on use.
  if name not in _NEEDS_FLAX:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  module, attr = _NEEDS_FLAX[name]
  module = importlib.import_module(module)
  return module if attr is None else getattr(module, attr)
