"""The exchange's building blocks: chunk masks, wire encodings, collectives.

`masks` holds the partitioned chunk layout, top-k selection and the wire
encodings of masks; `collectives` the dense exchange and helpers for
`shard_map`'s varying types. The optimizers in `scape_jax.optim` compose them.
"""
