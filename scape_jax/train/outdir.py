"""The run's directory: one trainer at a time, the right shape, room to save.

`RunLock` holds an exclusive `fcntl.flock` on `out_dir/.scape-lock` for the
run's life. The kernel releases it when the process ends, however it ends
(`kill -9` included), so a lock is never stale; the file itself stays, with
the PID and host of its last holder. A second trainer on the same `out_dir`
fails at once with `RunLockedError`, naming the holder. On Linux, flock works
on local filesystems and on NFS (the client emulates it with NFS byte-range
locks, so it holds across hosts); on Lustre it needs the `flock` mount option
(with `localflock` it holds only within a host; with `noflock` it fails, and
the error says so). In multi-process runs process 0 holds it.

`check_shape` looks at `out_dir` before any work: what the run writes there
(`ckpt/`, `tb/`, `metrics.jsonl`, `loss.png`) must be of the right kind and
writable. `check_free_space` refuses a save that cannot fit, before orbax
starts writing it: a save that runs out of space part-way fails in orbax's
background threads, noisily. `lost_work` says what a failure cost: the last
finished checkpoint, and the steps since it.
"""

import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Optional

from scape_jax.train import config as config_lib

LOCK_NAME = '.scape-lock'
# What the run writes into out_dir, and the kind each must be.
_OUTPUTS = (('ckpt', 'directory', 'checkpoints'),
            ('tb', 'directory', 'TensorBoard events'),
            ('metrics.jsonl', 'file', 'metrics'),
            ('loss.png', 'file', 'loss plot'))
# flock errors that mean the filesystem has no locks (not a held lock).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputError(RuntimeError):
  """Writing into out_dir failed: a full disk, an I/O error, a lost mount."""


class RunLockedError(config_lib.ConfigError):
  """Another trainer holds the lock on out_dir."""


def strerror(e: OSError) -> str:
  """The OS's words for `e` ("No space left on device"), else its text."""
  return e.strerror or str(e)


class RunLock:
  """Context manager: an exclusive flock on `out_dir/.scape-lock`.

  With `hold=False` (processes other than 0) it does nothing.
  """

  def __init__(self, out_dir: str, *, hold: bool = True):
    self.path = os.path.join(out_dir, LOCK_NAME)
    self._out_dir = out_dir
    self._hold = hold
    self._fd: Optional[int] = None

  def acquire(self) -> None:
    """Takes the lock and writes this process's PID and host into it.

    Raises:
      RunLockedError: another process holds it.
      ConfigError: the lock file cannot be opened, or the filesystem has
        no locks.
    """
    if not self._hold or self._fd is not None:
      return
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      raise config_lib.ConfigError(
          f'out_dir={self._out_dir!r}: cannot open its lock file '
          f'{self.path} ({strerror(e)})') from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if isinstance(e, BlockingIOError):
        raise RunLockedError(self._held_message()) from None
      if e.errno in _NO_LOCKS:
        raise config_lib.ConfigError(
            f'out_dir={self._out_dir!r}: its filesystem has no file locks '
            f'(flock: {strerror(e)}), so two trainers could write into it '
            'at once: use a local or NFS directory (on Lustre, mount with '
            '-o flock)') from None
      raise config_lib.ConfigError(
          f'out_dir={self._out_dir!r}: cannot lock {self.path} '
          f'({strerror(e)})') from None
    self._fd = fd
    self._write_holder()

  def _write_holder(self) -> None:
    holder = {'pid': os.getpid(), 'host': socket.gethostname(),
              'since': datetime.datetime.now().astimezone().isoformat(
                  timespec='seconds')}
    data = (json.dumps(holder) + '\n').encode()
    try:
      os.ftruncate(self._fd, 0)
      os.pwrite(self._fd, data, 0)
    except OSError as e:
      self.release()
      raise OutputError(f'writing the lock file {self.path} failed: '
                        f'{strerror(e)}') from None

  def _held_message(self) -> str:
    try:
      with open(self.path, encoding='utf-8') as f:
        holder = json.loads(f.read() or 'null')
    except (OSError, ValueError):
      holder = None
    if isinstance(holder, dict):
      who = (f'PID {holder.get("pid")} on host {holder.get("host")} (since '
             f'{holder.get("since")})')
    else:
      who = 'a process that has not written its PID yet'
    return (f'out_dir={self._out_dir!r} is in use by another trainer: {who} '
            f'holds {self.path}. Wait for that run to end or stop it, or '
            'use another out_dir.')

  def release(self) -> None:
    """Releases the lock (the file stays: removing it would race)."""
    if self._fd is not None:
      fd, self._fd = self._fd, None
      os.close(fd)  # closing the only descriptor drops the flock

  def __enter__(self) -> 'RunLock':
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def _kind(path: str) -> str:
  if os.path.isdir(path):
    return 'a directory'
  if os.path.isfile(path):
    return 'a file'
  if not os.path.exists(path):
    return 'a broken symbolic link'
  return 'a special file'


def check_shape(out_dir: str) -> None:
  """Creates `out_dir`, or raises ConfigError naming what is wrong with it.

  Checked: `out_dir` can be created and written; each output already there
  is of its kind (`ckpt/` and `tb/` directories, `metrics.jsonl` and
  `loss.png` files) and writable. Nothing is changed but out_dir's creation.
  """
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise config_lib.ConfigError(
        f'out_dir={out_dir!r}: cannot create it ({strerror(e)})') from None
  if not os.access(out_dir, os.W_OK | os.X_OK):
    raise config_lib.ConfigError(
        f'out_dir={out_dir!r}: this user cannot write there')
  for name, kind, what in _OUTPUTS:
    path = os.path.join(out_dir, name)
    if not os.path.lexists(path):
      continue
    right = os.path.isdir(path) if kind == 'directory' else os.path.isfile(
        path)
    if not right:
      raise config_lib.ConfigError(
          f'{path} is {_kind(path)}, not a {kind}: the run writes its '
          f'{what} there. Move it away, or use another out_dir.')
    mode = os.W_OK | (os.X_OK if kind == 'directory' else 0)
    if not os.access(path, mode):
      raise config_lib.ConfigError(
          f'{path}: this user cannot write it (the run writes its {what} '
          'there)')


def check_free_space(directory: str, nbytes: int, what: str) -> None:
  """Raises OutputError unless `directory`'s filesystem has `nbytes` free.

  `what` names the write, e.g. 'saving step 20 to /run/ckpt'. A directory
  not made yet is on its nearest existing parent's filesystem.
  """
  existing = os.path.abspath(directory)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  try:
    stat = os.statvfs(existing)
  except OSError as e:
    raise OutputError(f'{what} failed: cannot read the free space of '
                      f'{directory} ({strerror(e)})') from None
  free = stat.f_bavail * stat.f_frsize
  if free < nbytes:
    raise OutputError(
        f'{what} failed: No space left on device (the checkpoint needs '
        f'about {nbytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free)')


def finished_steps(ckpt_dir: str) -> list[int]:
  """The steps with a finished checkpoint in `ckpt_dir`, without waiting
  for saves in flight (orbax renames a step's directory when complete)."""
  try:
    names = os.listdir(ckpt_dir)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and
                os.path.isdir(os.path.join(ckpt_dir, n)))


def lost_work(ckpt_dir: str, step: int) -> str:
  """What a failure after `step` cost, and how to go on."""
  steps = [s for s in finished_steps(ckpt_dir) if s <= step]
  if not steps:
    return (f'no checkpoint was saved, so the {step} steps of this run are '
            'lost; fix the cause and run the same command to start again')
  last = steps[-1]
  return (f'the last good checkpoint is {ckpt_dir}/{last}, so the '
          f'{step - last} steps since it are lost; fix the cause and run the '
          'same command to resume from it')
