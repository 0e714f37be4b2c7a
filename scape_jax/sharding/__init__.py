"""The mesh, logical-axis rules, PartitionSpecs and parameter layouts."""

from scape_jax.sharding import fcdp
from scape_jax.sharding.fcdp import FcdpOptions
from scape_jax.sharding.layout import Layout
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
from scape_jax.sharding.specs import LOGICAL_RULES
from scape_jax.sharding.specs import param_partition_specs
from scape_jax.sharding.specs import state_partition_specs
from scape_jax.sharding.specs import with_replica_axis

__all__ = [
    'BATCH_AXES', 'DATA', 'FSDP', 'FSDP_AXES', 'FcdpOptions', 'LOGICAL_RULES',
    'Layout', 'MESH_AXES', 'NODE', 'REPLICA', 'TENSOR',
    'available_memory_kinds', 'fcdp', 'init_sharded', 'make_mesh',
    'offload_memory_kinds', 'param_partition_specs', 'place',
    'state_partition_specs', 'state_shardings', 'with_replica_axis',
]
