"""Methods that wrap an inner optimizer and synchronise every few steps.

They run on the replica layout (`scape_jax.sharding`): each replica group
holds its own parameters between synchronisations.
"""
