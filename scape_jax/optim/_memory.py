"""Memory spaces inside an update: state offloaded to host memory.

A state leaf placed in host memory (`scape_jax.sharding.state_shardings`
with `offload=`) reaches `update` typed in `jax.memory.Space.Host`.
Arithmetic needs its operands on the device, so `to_device` copies such
leaves there, one by one, and `like` returns each new value to the memory
space its old value came from: the state leaves the step where it was, the
compiled step's input and output buffers share one memory kind (donation
aliases them), and the numbers are those of the non-offloaded run.
"""

import jax


def on_host(x) -> bool:
  """Whether `x` (inside jit) lives in host memory."""
  return getattr(jax.typeof(x), 'memory_space', None) == jax.memory.Space.Host


def to_device(tree):
  """The host-resident leaves of `tree` copied to device memory."""
  return jax.tree.map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x)
      else x, tree)


def like(new, old):
  """`new` with each leaf in the memory space of the same leaf of `old`."""
  return jax.tree.map(
      lambda n, o: jax.device_put(n, jax.memory.Space.Host)
      if on_host(o) and not on_host(n) else n, new, old)
