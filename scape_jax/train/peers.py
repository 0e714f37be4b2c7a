"""Multi-process runs: a lost peer becomes this process's own message.

JAX's coordination service (run by process 0) answers a process that has
sent no heartbeat for its heartbeat timeout by aborting every other process
with a C++ stack trace (SIGABRT, exit code 134); a collective with a dead
peer fails sooner with gloo's error (CPU), or waits (GPU). `train.py` runs
a `PeerWatch` on every process: a thread that writes a heartbeat (a counter)
into the service's key-value store every `POLL_S` seconds and reads the
others'. A process whose counter has not moved for `heartbeat_timeout`
seconds (`train.py --heartbeat-timeout`, default 60; JAX's own is set
`JAX_MARGIN_S` longer, so that the watch speaks first) is lost; once a
collective has failed (gloo's "Connection reset by peer" when a peer died),
after `FAILED_WINDOW_S`. The watch then stops this process with one line
naming the lost one and exit code `EXIT_PEER_LOST` (4). A process that ends
on purpose (done, an error, a signal) first says so (`PeerWatch.leaving`);
one that ends with an error the others do not share stops them as well,
after `GRACE_S`.

The limit: if process 0 itself dies, the service dies with it, and JAX's
client in every other process aborts at once, before this watch can speak.
"""

import os
import sys
import threading
import time
from typing import Callable, Optional

EXIT_PEER_LOST = 4
HEARTBEAT_TIMEOUT_S = 60  # the default of train.py --heartbeat-timeout
JAX_MARGIN_S = 30  # JAX's heartbeat timeout is the watch's plus this
POLL_S = 1.0  # how often the watch beats and looks at the others' beats
FAILED_WINDOW_S = 5.0  # a silence that is a loss once a collective failed
GRACE_S = 10.0  # for this process to stop on its own after a peer's error
# Process 0's wait, after the others announced their exits, for them to end
# (on a loaded host a process may take this long between its announcement
# and its exit; ended by the service's end, it aborts with a stack trace).
EXIT_MARGIN_S = 1.0
_BEAT = 'scape_jax/beat/'  # + process index: its heartbeat counter
_EXIT = 'scape_jax/exit/'  # + process index: the exit code it ends with


def _client():
  """JAX's coordination client of this process (jax.distributed)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError('jax.distributed is not initialized')
  return client


class PeerWatch:
  """Stops this process, with a message, when another one is lost.

  Args:
    me: this process's index.
    count: the number of processes.
    heartbeat_timeout: seconds of silence after which a process is lost.
    client: JAX's coordination client (default: this process's).
    poll_s: seconds between two heartbeats.
    grace_s: how long a peer's error exit may precede this process's own.
    exit: called with (message, exit code) to stop the process.
  """

  def __init__(self, me: int, count: int, *,
               heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, client=None,
               poll_s: float = POLL_S, grace_s: float = GRACE_S,
               exit: Optional[Callable[[str, int], None]] = None):  # pylint: disable=redefined-builtin
    self._me, self._count = me, count
    self._timeout = heartbeat_timeout
    self._client = client if client is not None else _client()
    self._poll_s, self._grace_s = poll_s, grace_s
    self._exit = exit or _print_and_exit
    self._stop = threading.Event()
    self._failed = threading.Event()  # a collective failed: be quick
    self._beats = 0
    now = time.monotonic()
    self._heard = {p: (None, now) for p in range(count)}  # (beat, when)
    self._seen_error = {}  # peer -> when its error exit was first seen
    self._unreachable_since = None
    self._thread = threading.Thread(target=self._run, name='scape-peer-watch',
                                    daemon=True)

  def start(self) -> 'PeerWatch':
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive() and (
        threading.current_thread() is not self._thread):
      self._thread.join()

  def _run(self) -> None:
    while not self._stop.wait(self._poll_s):
      verdict = self.check()
      if verdict is not None and not self._stop.is_set():
        self._leave(EXIT_PEER_LOST)
        self._exit(verdict, EXIT_PEER_LOST)
        return

  def _exchange(self) -> Optional[tuple[dict, dict]]:
    """Beats; ({process: its beat}, {process: announced exit code}), or
    None while the service does not answer."""
    self._beats += 1
    try:
      self._client.key_value_set(f'{_BEAT}{self._me}', str(self._beats),
                                 allow_overwrite=True)
      beats, exits = ({int(key.rsplit('/', 1)[-1]): int(value) for key, value
                       in self._client.key_value_dir_get(prefix)}
                      for prefix in (_BEAT, _EXIT))
    except Exception:  # pylint: disable=broad-except
      return None  # any RPC failure: the service is unreachable
    return beats, exits

  def check(self) -> Optional[str]:
    """Beats once; the message this process must stop with, or None."""
    now = time.monotonic()
    state = self._exchange()
    if state is None:
      self._unreachable_since = self._unreachable_since or now
      if now - self._unreachable_since < self._window():
        return None
      return (f'process 0 of {self._count} is lost: the coordination '
              'service it runs has not answered for '
              f'{now - self._unreachable_since:.0f} s')
    self._unreachable_since = None
    beats, exits = state
    for peer in range(self._count):
      if peer == self._me:
        continue
      last, when = self._heard[peer]
      if beats.get(peer) != last:
        self._heard[peer] = beats.get(peer), now
      code = exits.get(peer)
      if code is None and now - self._heard[peer][1] > self._window():
        return (f'process {peer} of {self._count} is lost: no heartbeat for '
                f'{now - self._heard[peer][1]:.0f} s (killed, crashed, or '
                'its host is down or out of reach)')
      if code:  # an error exit; one all share ends this process too
        first = self._seen_error.setdefault(peer, now)
        if now - first >= self._grace_s:
          return (f'process {peer} of {self._count} stopped with exit code '
                  f'{code} (its log says why)')
    return None

  def _window(self) -> float:
    return FAILED_WINDOW_S if self._failed.is_set() else self._timeout

  def settle(self) -> None:
    """After a failed collective, which a lost peer may have caused: waits
    until a silent peer would count as lost, so that the message names it
    (the watch ends the process) rather than the collective's error."""
    self._failed.set()
    deadline = time.monotonic() + FAILED_WINDOW_S + 3 * self._poll_s
    while self._thread.is_alive() and time.monotonic() < deadline:
      time.sleep(0.1)

  def _announce(self, code: int) -> bool:
    try:
      self._client.key_value_set(f'{_EXIT}{self._me}', str(code),
                                 allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      return False  # the service is gone: nobody is left to tell
    return True

  def leaving(self, code: int) -> None:
    """Stops watching and announces this process's exit code (see
    `_leave`)."""
    self.stop()
    self._leave(code)

  def _leave(self, code: int) -> None:
    """Announces `code`. Process 0, whose exit ends the service and with it
    every other process (JAX aborts them), then waits for the others that
    are still beating to announce theirs (up to `grace_s` + 5 s), and
    `EXIT_MARGIN_S` more for them to end after announcing; with code 0
    JAX's shutdown barrier waits for them instead."""
    if not self._announce(code) or self._me != 0 or code == 0:
      return
    deadline = time.monotonic() + self._grace_s + 5
    while time.monotonic() < deadline:
      state = self._exchange()
      if state is None:
        return
      now = time.monotonic()
      beats, exits = state
      waiting = [p for p in range(1, self._count) if p not in exits and (
          self._heard[p][0] != beats.get(p) or
          now - self._heard[p][1] < FAILED_WINDOW_S)]
      for p in waiting:
        if self._heard[p][0] != beats.get(p):
          self._heard[p] = beats.get(p), now
      if not waiting:
        time.sleep(EXIT_MARGIN_S)
        return
      time.sleep(0.2)


def _print_and_exit(message: str, code: int) -> None:
  """Prints the message and ends the process at once (from the watch's
  thread: the main thread may wait in a collective that never returns)."""
  sys.stdout.flush()
  print(f'error: {message}; stopping this process too (exit code {code}). '
        'Run the same command on every host to resume from the last '
        'checkpoint.', file=sys.stderr, flush=True)
  os._exit(code)  # pylint: disable=protected-access
