"""Processes decide together before they enter a collective.

In a multi-process run every collective needs every process. A process that
decides alone (its config differs, it cannot read its data or its shard of
a checkpoint) goes one way while the others wait for it in a collective, and
the job hangs with no message. Each function here all-gathers one small
array, so every process sees every verdict and raises the same kind of
error at the same point. With one process they cost nothing.
"""

import collections
import os
import socket
import zlib
from typing import Any, Callable, Optional

import jax
import numpy as np

from scape_jax.sharding import mesh as sharding_mesh
from scape_jax.train import config as config_lib

# Keys that may differ between processes: per-host paths.
PER_HOST_KEYS = ('data.data_dir',)
# Names a process's host for `nodes_are_hosts` in place of its host name.
HOST_VAR = 'SCAPE_HOST'


def _all_gather(x: np.ndarray) -> np.ndarray:
  """Every process's `x`, stacked along a new first axis."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x))


def raise_together(error: Optional[Exception], what: str,
                   kind: type = config_lib.ConfigError) -> None:
  """Raises on every process if any process has an `error`.

  Call it on every process at the same point. The process with the error
  raises it; the others raise `kind` naming the processes that failed, so
  that all of them take the same branch (exit, or try an older checkpoint).

  Args:
    error: this process's error, or None.
    what: what was being done, for the others' message.
    kind: the exception class the other processes raise.
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  failed = np.flatnonzero(_all_gather(np.int32(error is not None)))
  if error is not None:
    raise error
  if failed.size:
    raise kind(f'{what} failed on process{"es" if failed.size > 1 else ""} '
               f'{", ".join(map(str, failed))} (its log says why)')


def together(fn: Callable[[], Any], what: str, kind: type,
             catch: tuple = ()) -> Any:
  """Runs `fn` on every process; if it fails on any, raises on every one.

  An exception of `kind` or `catch` from `fn` is shared through
  `raise_together` (one of `catch` that is not a `kind` is raised as `kind`
  with its message). `fn` itself must not enter a collective.

  Returns:
    What `fn` returned.
  """
  result, error = None, None
  try:
    result = fn()
  except (kind, *catch) as e:  # pylint: disable=broad-except
    error = e if isinstance(e, kind) else kind(f'{what}: {e}')
    if error is not e:
      error.__cause__ = e
  raise_together(error, what, kind)
  return result


def same_config(cfg: config_lib.Config) -> None:
  """Raises ConfigError on every process if the processes' configs differ.

  Processes started with different settings (a stale override on one host,
  another `steps`) would compute different programs and wait for each other
  forever; their replicated parameters drift apart before that. Keys in
  `PER_HOST_KEYS` may differ.
  """
  if jax.process_count() == 1:
    return
  flat = {k: v for k, v in sorted(config_lib.flatten(config_lib.to_dict(cfg)).items())
          if k not in PER_HOST_KEYS}
  digests = np.array([zlib.crc32(repr(v).encode()) for v in flat.values()],
                     np.uint32)
  gathered = _all_gather(digests)
  differ = [k for k, column in zip(flat, gathered.T)
            if (column != column[0]).any()]
  if differ:
    raise config_lib.ConfigError(
        'the processes were started with different configs; these keys '
        f'differ: {", ".join(differ)}. Give every process the same config '
        f'(only {", ".join(PER_HOST_KEYS)} may differ).')


def shared_dir(path: str, what: str) -> None:
  """Raises ConfigError on every process unless all of them see one `path`.

  Checkpoints are written by every process into one directory, so out_dir
  must be on a filesystem every host shares. The same path string on hosts
  with their own disks (or a relative path from other working directories)
  would leave each host a part of each checkpoint, and no host a checkpoint
  it can restore. Process 0 writes a random token into `path`; every process
  must read back the same token.

  Args:
    path: an existing directory.
    what: the option that named it, for the message.
  """
  if jax.process_count() == 1:
    return
  marker = os.path.join(path, '.scape-shared-check')
  token = np.frombuffer(os.urandom(16), np.uint8)
  error = None
  if jax.process_index() == 0:
    try:
      with open(marker + '.tmp', 'wb') as f:
        f.write(token.tobytes())
      os.replace(marker + '.tmp', marker)
    except OSError as e:
      error = config_lib.ConfigError(f'{what}={path!r}: cannot write there '
                                     f'({e.strerror})')
  raise_together(error, f'writing into {what}')  # process 0 has written
  try:
    expected = _all_gather(token)[0].tobytes()
    try:
      with open(marker, 'rb') as f:
        seen = f.read()
    except OSError:
      seen = None
    if seen != expected:
      error = config_lib.ConfigError(
          f'{what}={path!r} (here {os.path.abspath(path)!r}) is not the '
          'directory process 0 writes: it must be on a filesystem every '
          'host shares, under the same path (an absolute path; every '
          'process writes its part of each checkpoint there)')
    raise_together(error, f'checking that {what} is shared')
  finally:  # every process has read it
    if jax.process_index() == 0:
      os.remove(marker)


def nodes_are_hosts(mesh: jax.sharding.Mesh, nodes: int) -> None:
  """Raises ConfigError on every process unless each node of the mesh's fsdp
  groups is one host's devices and its nodes are other hosts (`mesh.nodes`
  > 1 in a multi-process run; a single process simulates its nodes).

  A process's host is its host name, or `$SCAPE_HOST` where set (processes
  on one machine that stand for several nodes, e.g. in network namespaces).
  """
  if jax.process_count() == 1 or nodes == 1:
    return
  name = zlib.crc32(os.environ.get(HOST_VAR, socket.gethostname()).encode())
  hosts = _all_gather(np.array([name], np.uint32))[:, 0]
  problem = sharding_mesh.node_problem(
      mesh.devices, lambda device: int(hosts[device.process_index]))
  if problem:
    per_host = collections.Counter(int(hosts[d.process_index])
                                   for d in mesh.devices.flat)
    raise config_lib.ConfigError(
        f'mesh.nodes={nodes}: {problem}. Devices per host in this job: '
        f'{sorted(set(per_host.values()))}; set mesh.fsdp / mesh.nodes to '
        'the devices of one host (the mesh takes devices process by '
        'process).')
