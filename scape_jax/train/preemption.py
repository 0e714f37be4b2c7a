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

Outside the train loop (setup: preparing the data, restoring, compiling;
and after it) no step is lost by stopping at once, and `train.py` does so
within `StopAtOnce`: a thread woken by the signal (`signal.set_wakeup_fd`,
so even while the main thread is in a long compile) prints one line and
ends the process with exit code 128 + the signal's number.
"""

import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

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


def stopped_at_once(signum: int) -> str:
  """The line of a stop outside the train loop."""
  return (f'stopped: {name(signum)} received: stopped at once; the same '
          'command resumes from the last checkpoint')


def _stop_in_thread(signum, frame) -> None:
  """The Python handler within `StopAtOnce`: its thread acts, not this."""
  del signum, frame


class StopAtOnce:
  """Context manager: SIGTERM and SIGINT end the process at once, with one
  line (`stopped_at_once`) and exit code 128 + the signal's number, unless
  another handler (`StopSignals`, in the train loop) has taken over.

  `before_exit(code)`, if set, runs first (a multi-process run announces
  its exit: `peers.PeerWatch.leaving`). Outside the main thread it does
  nothing.
  """

  def __init__(self, signals=SIGNALS):
    self._signals = signals
    self.before_exit: Optional[Callable[[int], None]] = None
    self._previous = {}
    self._previous_fd = None
    self._sockets = None
    self._thread = None
    self._stopping = threading.Event()

  def __enter__(self) -> 'StopAtOnce':
    if threading.current_thread() is not threading.main_thread():
      return self
    self._sockets = socket.socketpair()
    for end in self._sockets:
      end.setblocking(False)
    self._sockets[0].setblocking(True)  # the thread's end
    self._previous = {signum: signal.signal(signum, _stop_in_thread)
                      for signum in self._signals}
    self._previous_fd = signal.set_wakeup_fd(self._sockets[1].fileno(),
                                             warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._wait, daemon=True,
                                    name='scape-stop-at-once')
    self._thread.start()
    return self

  def _wait(self) -> None:
    while True:
      try:
        data = self._sockets[0].recv(64)
      except OSError:
        return
      if not data:  # closed by __exit__
        return
      for signum in data:
        if signal.getsignal(signum) is _stop_in_thread:
          self._stop(signum)

  def _stop(self, signum: int) -> None:
    self._stopping.set()
    code = 128 + signum
    sys.stdout.flush()  # the line first: process 0's exit may end this one
    print(stopped_at_once(signum), file=sys.stderr, flush=True)
    if self.before_exit is not None:
      self.before_exit(code)
    os._exit(code)  # pylint: disable=protected-access

  def yield_to_a_stop(self, timeout_s: float = 60) -> None:
    """Waits (up to `timeout_s`) for a stop in progress to end the process:
    the main thread's own way out (an error from a collective that the
    stop broke) must not race it."""
    if self._stopping.is_set():
      self._thread.join(timeout_s)

  def __exit__(self, *exc_info) -> None:
    if self._thread is None:
      return
    signal.set_wakeup_fd(self._previous_fd)
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._sockets[1].close()  # wakes the thread: end of file
    self._thread.join()
    self._sockets[0].close()
    self._thread = None


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
