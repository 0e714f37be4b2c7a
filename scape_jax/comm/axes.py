"""The mesh axis names, in one place: every collective runs over one of them.

    ('replica', 'data', 'fsdp', 'tensor')

* `replica`: groups that hold their own parameters between synchronisations
  (DiLoCo/Pier); size 1 for every other method.
* `data`: data-parallel workers; the optimizers' own exchange runs over it.
* `fsdp`: parameters and optimizer state split over it (ZeRO-3 style).
* `tensor`: reserved.

The mesh itself is built by `scape_jax.sharding.make_mesh`.
"""

REPLICA = 'replica'
DATA = 'data'
FSDP = 'fsdp'
TENSOR = 'tensor'
MESH_AXES = (REPLICA, DATA, FSDP, TENSOR)
BATCH_AXES = (REPLICA, DATA, FSDP)  # the batch dimension is split over these
