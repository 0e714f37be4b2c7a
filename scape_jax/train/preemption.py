"""SIGTERM and SIGINT stop the run after the current step, with a checkpoint.

Preemptible clusters (SLURM, Kubernetes, spot VMs) send SIGTERM and allow a
grace period; a user presses Ctrl-C (SIGINT). Either signal, caught by
`StopSignals`, only sets a flag: the train loop finishes the step in flight,
saves a checkpoint and raises `Interrupted`, and `train.py` exits with the
conventional code 128 + signal number (143 for SIGTERM, 130 for SIGINT). The
same command then resumes from that checkpoint. A second signal stops the
process at once, the way it would have without the handler.

With several processes, each process may see the signal at another step.
`requested()` then agrees through a small all-gather, so that all stop
after the same step.
"""

import signal
import threading
from typing import Optional

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
  """The run stopped on a signal after saving a checkpoint at `step`."""

  def __init__(self, signum: int, step: int, message: str):
    super().__init__(message)
    self.signum = signum
    self.step = step

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


class StopSignals:
  """Context manager: SIGTERM/SIGINT request a stop instead of killing.

  Outside the main thread (where Python cannot install handlers) it does
  nothing and `requested()` stays None.
  """

  def __init__(self, signals=SIGNALS):
    self._signals = signals
    self._previous = {}
    self._received: Optional[int] = None

  def __enter__(self) -> 'StopSignals':
    if threading.current_thread() is threading.main_thread():
      for signum in self._signals:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    self._restore()

  def _restore(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self._received is not None:  # the second signal: the old behaviour
      self._restore()
      signal.raise_signal(signum)
      return
    self._received = signum

  def requested(self) -> Optional[int]:
    """The signal number if a stop was requested (on any process), else None.

    With several processes every process must call it at the same step.
    """
    received = self._received or 0
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      received = int(np.max(multihost_utils.process_allgather(
          np.int32(received))))
    return received or None


def name(signum: int) -> str:
  return signal.Signals(signum).name
