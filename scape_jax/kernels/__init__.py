"""Pallas kernels, one file per op.

Each file holds the kernel (refs in, refs out), a public wrapper taking
`interpret=` and a pure-jnp `*_reference`, as in JAX's own
`jax/experimental/pallas/ops/gpu/rms_norm.py`.
"""
