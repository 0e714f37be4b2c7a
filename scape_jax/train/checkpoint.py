"""Orbax checkpoints of a sharded train state plus JSON extras.

Layout: `directory/<step>/` holds three orbax items:

* `state`: the pytree of arrays (`StandardSave`: OCDBT + zarr via tensorstore),
* `extras`: a JSON object (config, data iterator state, ...),
* `checksums`: a JSON manifest with, per leaf (keyed by `jax.tree_util.keystr`),
  its shape, dtype and two 32-bit checksums of its bits, and the sha256 of the
  extras (so that a changed data position is caught like a changed array).

Orbax writes each step into a temporary directory and renames it when
complete, so an interrupted save never looks like a finished step (orbax
ignores the leftovers). Orbax detects truncated files and garbled OCDBT
metadata/B-tree nodes, but not garbled bytes inside large array values (they
are stored without a checksum), and it silently casts when the requested
dtype differs from the stored one. The manifest closes both holes: `restore`
checks structure, shapes and dtypes against it before reading, and the
checksums of the restored arrays (and the extras) after. `save` refuses a
state with a NaN or an infinity unless asked (`allow_non_finite=True`).

The checksums are computed on device (a jitted, sharding-agnostic uint32
reduction; integer addition wraps, so the result does not depend on the
sharding or on the reduction order): one read of the state per save/restore.
"""

from collections.abc import Mapping
import hashlib
import json
import logging
import os
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from scape_jax.train import agreement
from scape_jax.train import outdir

PyTree = Any

_ITEMS = ('state', 'extras', 'checksums')
_MANIFEST_VERSION = 2  # 2: adds 'extras_sha256'; version 1 is still read.
_MAX_LISTED = 8  # Problems listed in one error message.
# Room a save needs beyond its arrays' bytes and 10% (OCDBT's index, the
# JSON items, orbax's metadata): a tiny model's checkpoint holds ~1.2x them.
_METADATA_BYTES = 1 << 20


class CheckpointError(RuntimeError):
  """A checkpoint is missing, corrupt, incompatible or already exists."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files are damaged: unreadable or not what was saved."""


class SaveError(CheckpointError, outdir.OutputError):
  """A save failed (a full disk, an I/O error): nothing of it is kept."""


class _ReadOnlyNotice(logging.Filter):
  """Drops orbax's warning 'Given directory is read only': restoring opens
  the directory read-only on purpose, so that nothing there is written."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Given directory is read only')


class _BackgroundErrors(logging.Filter):
  """Drops orbax's error records (with their tracebacks): a save that fails
  in orbax's background threads logs the same cause several times, and
  `Checkpointer.wait` raises it as one `SaveError`; a failing restore
  raises too."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and
                f'{os.sep}orbax{os.sep}' in record.pathname)


logging.getLogger('absl').addFilter(_ReadOnlyNotice())
logging.getLogger('absl').addFilter(_BackgroundErrors())


# ----------------------------------------------------------------------------
# Checksums.


def _has_checksum(dtype: Any) -> bool:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  dtype = np.dtype(dtype)
  return dtype == np.bool_ or (
      dtype.kind != 'c' and jax.dtypes.itemsize_bits(dtype) in (8, 16, 32, 64))


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words (one per element; two for 64 bits)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if bits == 32 or bits == 64:  # 64 bits: a trailing axis of two words.
    return lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(x, jnp.dtype(f'uint{bits}')).astype(
      jnp.uint32)


def _on_device(x: jax.Array) -> jax.Array:
  """`x`, copied to device memory if it lives in host memory (FCDP's cache,
  DiLoCo's outer state): arithmetic needs its operands in one memory space."""
  if getattr(jax.typeof(x), 'memory_space', None) == jax.memory.Space.Host:
    return jax.device_put(x, jax.memory.Space.Device)
  return x


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """[sum(w), sum(w * (2i + 1))] mod 2**32 over the words w, i = flat index.

  The weights are odd, so changing any single word changes both sums.
  """
  w = _words(x)
  index, stride = jnp.zeros(w.shape, jnp.uint32), 1
  for axis in reversed(range(w.ndim)):
    index += lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(
        stride % 2**32)
    stride *= w.shape[axis]
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32),
                    jnp.sum(w * (2 * index + 1), dtype=jnp.uint32)])


@jax.jit
def _leaf_summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(checksum, all entries finite) of one leaf, in one read of it."""
  x = _on_device(x)
  finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.bool_(True))
  return _leaf_checksum(x), finite


def _checksums(leaves: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  """`_leaf_summary` of every leaf: one small program per shape, dtype and
  sharding, which a state's same-shape leaves share (jit's cache), where
  one program of the whole list compiled every leaf apart at a run's first
  save. Each is waited for before the next: with many sharded programs in
  flight, XLA:CPU aborted (as with train steps, `guard`)."""
  return [jax.block_until_ready(_leaf_summary(x)) for x in leaves]


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _nbytes(x: Any) -> int:
  """The bytes of `x`'s values (all shards of a global array, once)."""
  return int(np.prod(x.shape)) * x.dtype.itemsize


def _extras_sha256(extras: Mapping[str, Any]) -> str:
  canonical = json.dumps(extras, sort_keys=True, separators=(',', ':'))
  return hashlib.sha256(canonical.encode()).hexdigest()


def _manifest(state: PyTree, extras: Mapping[str, Any] | None = None
              ) -> tuple[dict[str, Any], list[str]]:
  """The manifest (shape, dtype and checksum, None if unsupported, of every
  leaf; the extras' sha256) and the keys of leaves with non-finite entries."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  entries, summed = {}, []
  for path, x in leaves:
    entry = {'shape': None, 'dtype': None, 'checksum': None}
    if _is_array(x):
      entry['shape'], entry['dtype'] = list(x.shape), str(x.dtype)
      if _has_checksum(x.dtype):
        summed.append((jax.tree_util.keystr(path), entry, x))
    entries[jax.tree_util.keystr(path)] = entry
  results = jax.device_get(_checksums([x for _, _, x in summed]))
  non_finite = []
  for (key, entry, _), (checksum, finite) in zip(summed, results):
    entry['checksum'] = [int(v) for v in checksum]
    if not finite:
      non_finite.append(key)
  manifest = {'version': _MANIFEST_VERSION, 'leaves': entries}
  if extras is not None:
    manifest['extras_sha256'] = _extras_sha256(extras)
  return manifest, non_finite


def _well_formed(manifest: Any) -> bool:
  """Whether `manifest` has the layout `_manifest` writes (valid JSON of
  another shape would fail later with an AttributeError)."""
  keys = {'shape', 'dtype', 'checksum'}
  leaves = manifest.get('leaves') if isinstance(manifest, dict) else None
  return isinstance(leaves, dict) and all(
      isinstance(e, dict) and keys <= e.keys() and
      (e['shape'] is None or isinstance(e['shape'], list))
      for e in leaves.values())


def _limit(problems: list[str]) -> str:
  more = len(problems) - _MAX_LISTED
  shown = problems[:_MAX_LISTED]
  if more > 0:
    shown.append(f'... and {more} more')
  return '\n  '.join([''] + shown)


def _check_compatible(manifest: dict[str, Any], abstract: PyTree,
                      partial: bool = False) -> list[str]:
  """Structure/shape/dtype differences between the manifest and `abstract`.

  With `partial`, leaves of the checkpoint that `abstract` lacks are fine.
  """
  saved = manifest['leaves']
  wanted = {jax.tree_util.keystr(p): x
            for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  problems = [f'{k}: in abstract_state, not in the checkpoint'
              for k in wanted if k not in saved]
  problems += [f'{k}: in the checkpoint, not in abstract_state'
               for k in saved if k not in wanted and not partial]
  for key in wanted.keys() & saved.keys():
    entry, x = saved[key], wanted[key]
    if entry['shape'] is None or not hasattr(x, 'shape'):
      continue
    if list(x.shape) != entry['shape'] or str(x.dtype) != entry['dtype']:
      problems.append(f'{key}: checkpoint has {entry["dtype"]}'
                      f'{tuple(entry["shape"])}, abstract_state wants '
                      f'{x.dtype}{tuple(x.shape)}')
  return sorted(problems)


def _check_sums(manifest: dict[str, Any], state: PyTree) -> list[str]:
  """Leaves of the restored `state` whose checksums differ from the saved."""
  actual = _manifest(state)[0]['leaves']
  return [f'{k}: checksum mismatch (data garbled)'
          for k, entry in sorted(manifest['leaves'].items())
          if entry['checksum'] is not None and k in actual
          and actual[k]['checksum'] is not None
          and actual[k]['checksum'] != entry['checksum']]


# ----------------------------------------------------------------------------
# Checkpointer.


def _first_line(e: BaseException, limit: int = 300) -> str:
  """'Type: first line' of the innermost cause of `e` (tensorstore's own
  message is more useful than orbax's wrappers, which dump a whole spec)."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e).strip().split('\n', 1)[0]
  text = text if len(text) <= limit else text[:limit] + '...'
  return f'{type(e).__name__}: {text}'


class Checkpointer:
  """Saves and restores (state, extras) per step under one directory.

  All processes must call `save`/`restore`/`latest_step` together; orbax does
  the cross-process coordination. Saves are asynchronous: `save` returns once
  the arrays are copied to host memory; `wait` blocks until written.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3):
    if max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1, got {max_to_keep}')
    self.directory = os.path.abspath(directory)
    self.max_to_keep = max_to_keep
    self._writer: ocp.CheckpointManager | None = None

  def _write_manager(self) -> ocp.CheckpointManager:
    if self._writer is None:
      # A save killed part-way leaves a tmp directory; the first save of the
      # next run removes them (they are never a checkpoint).
      options = ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep,
                                             create=True,
                                             cleanup_tmp_directories=True)
      self._writer = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=_ITEMS)
    return self._writer

  def _read_manager(self) -> ocp.CheckpointManager | None:
    """A fresh read-only view of the directory; None if it does not exist."""
    self.wait()
    if not os.path.isdir(self.directory):
      return None
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0,
        save_root_metadata=False)  # No barrier, nothing written.
    return ocp.CheckpointManager(self.directory, options=options,
                                 item_names=_ITEMS)

  def all_steps(self) -> list[int]:
    """Steps with a finished checkpoint, ascending (waits for pending saves)."""
    if self._writer is not None:
      self.wait()
      self._writer.reload()
      return sorted(self._writer.all_steps())
    manager = self._read_manager()
    return [] if manager is None else sorted(manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest finished step, or None (waits for pending saves)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: PyTree,
           extras: Mapping[str, Any] | None = None, *,
           allow_non_finite: bool = False) -> None:
    """Starts saving `state` and JSON `extras` as `step`; never overwrites.

    Raises:
      CheckpointError: the step exists, extras are not JSON-serializable or
        the state holds a NaN or an infinity (unless `allow_non_finite`).
      SaveError: the state does not fit in the free space, or orbax failed
        to start the save (`wait` raises a failure while writing).
    """
    extras = dict(extras or {})
    try:
      json.dumps(extras)
    except (TypeError, ValueError) as e:
      raise CheckpointError(f'extras for step {step} are not JSON-serializable:'
                            f' {_first_line(e)}') from e
    manager = self._write_manager()
    steps = self.all_steps()  # Waits for the previous save, re-lists steps.
    if step in steps:
      raise CheckpointError(f'checkpoint step {step} already exists in '
                            f'{self.directory} (steps: {steps}); refusing to '
                            'overwrite')
    manifest, non_finite = _manifest(state, extras)
    if non_finite and not allow_non_finite:
      raise CheckpointError(f'refusing to save step {step}: non-finite values '
                            f'(NaN or inf) in{_limit(non_finite)}')
    self._check_space(step, state)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              extras=ocp.args.JsonSave(extras),
                              checksums=ocp.args.JsonSave(manifest))
    try:
      manager.save(step, args=args, force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise SaveError(f'saving step {step} to {self.directory} failed: '
                      f'{_first_line(e)}') from e

  def _check_space(self, step: int, state: PyTree) -> None:
    """Raises SaveError on every process unless the state's bytes fit in
    the free space (orbax would fail part-way, in its threads)."""
    nbytes = sum(_nbytes(x) for x in jax.tree.leaves(state) if _is_array(x))
    nbytes += nbytes // 10 + _METADATA_BYTES  # orbax's files beside the data
    what = f'saving step {step} to {self.directory}'

    def check():
      try:
        outdir.check_free_space(self.directory, nbytes, what)
      except outdir.OutputError as e:
        raise SaveError(str(e)) from None

    agreement.together(check, f'checking the free space for {what}',
                       SaveError)

  def _open(self, step: int | None) -> tuple[ocp.CheckpointManager, int, str]:
    """(read manager, step, description) of an existing finished step."""
    manager = self._read_manager()
    if manager is None:
      raise CheckpointError(f'checkpoint directory {self.directory} does not '
                            'exist')
    steps = sorted(manager.all_steps())
    if step is None and not steps:
      raise CheckpointError(f'no checkpoints in {self.directory}')
    step = steps[-1] if step is None else step
    if step not in steps:
      raise CheckpointError(f'no checkpoint for step {step} in '
                            f'{self.directory}; steps there: {steps}')
    return manager, step, (
        f'checkpoint {os.path.join(self.directory, str(step))}')

  @staticmethod
  def _read(manager, step: int, where: str, **items) -> Any:
    """Restores the named JSON items of `step`; any failure is corruption."""
    try:
      return manager.restore(step, args=ocp.args.Composite(**{
          name: ocp.args.JsonRestore() for name in items}))
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(
          f'{where} is corrupt: cannot read its {" and ".join(items.values())}'
          f': {_first_line(e)}') from e

  def _manifest_of(self, manager, step: int, where: str) -> dict[str, Any]:
    manifest = self._read(manager, step, where,
                          checksums='checksum manifest').checksums
    if not _well_formed(manifest):
      raise CorruptCheckpointError(f'{where} is corrupt: malformed checksum '
                                   f'manifest {manifest!r:.200}')
    return manifest

  @staticmethod
  def _check_extras(manifest, extras, where: str) -> dict[str, Any]:
    extras = dict(extras or {})
    want = manifest.get('extras_sha256')  # None: a version 1 manifest
    if want is not None and _extras_sha256(extras) != want:
      raise CorruptCheckpointError(
          f'{where} is corrupt: its extras (data position, config) differ '
          'from what was saved (sha256 mismatch)')
    return extras

  def read_extras(self, step: int | None) -> tuple[int, dict[str, Any]]:
    """(step, extras) of `step` (None: the latest), checked, without the state.

    Raises:
      CheckpointError: no such directory/step.
      CorruptCheckpointError: the extras or the manifest are damaged.
    """
    manager, step, where = self._open(step)
    manifest = self._manifest_of(manager, step, where)
    extras = self._read(manager, step, where, extras='extras').extras
    return step, self._check_extras(manifest, extras, where)

  def restore(self, step: int | None, abstract_state: PyTree, *,
              partial: bool = False) -> tuple[PyTree, dict[str, Any]]:
    """Restores (state, extras) of `step` (None: the latest).

    Args:
      step: the step to restore, or None for the latest.
      abstract_state: pytree of `jax.ShapeDtypeStruct` with shardings; the
        restored arrays get these shardings. Shapes and dtypes must match.
      partial: `abstract_state` may name only part of the saved tree (e.g.
        `{'params': ...}`); only that part is read.

    Returns:
      The restored state and extras.

    Raises:
      CheckpointError: no such directory/step, or a checkpoint whose
        structure, shapes or dtypes differ from `abstract_state`.
      CorruptCheckpointError: a damaged checkpoint.
    """
    manager, step, where = self._open(step)
    manifest = self._manifest_of(manager, step, where)
    problems = _check_compatible(manifest, abstract_state, partial)
    if problems:
      raise CheckpointError(f'{where} does not match abstract_state:'
                            f'{_limit(problems)}')
    if partial:
      state_args = ocp.args.PyTreeRestore(
          abstract_state, partial_restore=True,
          restore_args=ocp.checkpoint_utils.construct_restore_args(
              abstract_state))
    else:
      state_args = ocp.args.StandardRestore(abstract_state)

    def read():
      try:
        return manager.restore(step, args=ocp.args.Composite(
            state=state_args, extras=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        raise CorruptCheckpointError(f'{where} is corrupt or unreadable: '
                                     f'{_first_line(e)}') from e

    # A process reads only its own shards: all must agree before the
    # checksums' collective, or all go on to an older step together.
    restored = agreement.together(read, f'reading {where}',
                                  CorruptCheckpointError)
    problems = _check_sums(manifest, restored.state)
    if problems:
      raise CorruptCheckpointError(f'{where} is corrupt:{_limit(problems)}')
    return restored.state, self._check_extras(manifest, restored.extras, where)

  def set_aside(self, step: int) -> str:
    """Moves step `step` out of the directory, into `<directory>.corrupt/`.

    Nothing is deleted: the files stay for inspection, and the step number
    is free to be saved again. Call it on every process (process 0 moves).

    Returns:
      The new path of the step.
    """
    self.wait()
    target = os.path.join(f'{self.directory}.corrupt', str(step))
    suffix = 0
    while os.path.exists(target if not suffix else f'{target}-{suffix}'):
      suffix += 1
    target = target if not suffix else f'{target}-{suffix}'
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices(f'checkpoint {step} set aside')
    if self._writer is not None:
      self._writer.reload()
    return target

  def wait(self) -> None:
    """Blocks until pending saves are written (and old steps pruned)."""
    if self._writer is None:
      return
    try:
      self._writer.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise SaveError(f'saving to {self.directory} failed: '
                      f'{_first_line(e)}') from e

  def close(self) -> None:
    """Waits for pending saves and releases orbax resources."""
    try:
      self.wait()
    finally:
      if self._writer is not None:
        self._writer.close()
        self._writer = None

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
