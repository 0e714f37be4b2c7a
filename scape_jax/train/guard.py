"""Steps in flight: how far the host runs ahead, and the non-finite watch.

JAX dispatches train steps asynchronously, so a loop that does not read a
result runs ahead of the devices. `InFlightSteps` bounds that: before a new
step is dispatched, the step `depth` places back is waited for. Each step's
`skipped` flag (see `step.make_train_step`) is read as the step completes,
in step order, to count non-finite steps; `max_bad_steps` in a row raise
`DivergedError`.

Why the bound is needed, not only nice: XLA's CPU client (PjRtCpuClient)
runs a program with collectives on all local devices at once, each on a
thread of one pool of max(cores, devices) threads, so that on a small
machine every thread of the pool takes part. It also limits each device to
32 computations in flight by blocking the thread that enqueues the 33rd,
and that is a thread of the same pool. With more than about 32 steps
dispatched ahead (e.g. `log_every=100` and nothing read in between), one
pool thread waits for a slot on device k while device k's oldest step waits
for a pool thread, and the other devices wait in that step's all-reduce:
XLA aborts after its collective timeout ("Expected 8 threads to join the
rendezvous, but only 7 of them arrived on time"), or hangs forever with the
timeout raised. A bound of two steps still lets the host prepare step t+1
while step t runs, and stays far from that limit on every backend.

The steps in flight also decide which update a new step applies. A skipped
step leaves the optimizer's state as it was, its count included, so its
schedules (learning rate, SCAPE's density, Radius's step kinds, DiLoCo's
phases) follow the updates applied, not the steps run. The program a step
runs is chosen by the same count (`updates_before`), which is exact only
once the steps still in flight are known: where one of them being skipped
would change the program, the new step waits for them.
"""

import collections
from typing import Callable, Hashable, Optional

import jax

# Steps dispatched but not yet waited for: the host prepares the next step
# while one runs; any value well under 32 avoids the CPU deadlock above.
MAX_STEPS_IN_FLIGHT = 2


class DivergedError(RuntimeError):
  """Too many consecutive train steps had a non-finite loss or update."""


class InFlightSteps:
  """Bounds the dispatched steps and counts non-finite ones as they finish.

  Args:
    max_bad_steps: consecutive skipped steps that raise `DivergedError`.
    depth: steps that may be in flight.
    on_skip: called as `on_skip(step, metrics, in_a_row)` for each skipped
      step, in step order, with the step's metrics on the host.
    skipped_before: steps skipped before this run started (a resumed run's
      checkpoint records them).
  """

  def __init__(self, max_bad_steps: int, depth: int = MAX_STEPS_IN_FLIGHT,
               on_skip: Optional[Callable[[int, dict, int], None]] = None,
               skipped_before: int = 0):
    if depth < 1:
      raise ValueError(f'depth must be >= 1, got {depth}')
    self._max_bad = max_bad_steps
    self._depth = depth
    self._on_skip = on_skip
    self._queue = collections.deque()
    self._skipped_before = skipped_before
    self.in_a_row = 0  # consecutive skipped steps up to the last finished
    self.skipped = 0  # skipped steps of this run in all
    self.finished = None  # the last finished step

  @property
  def skipped_in_all(self) -> int:
    """Finished steps skipped since the run's first step, resumes included."""
    return self._skipped_before + self.skipped

  def updates_before(self, step: int, key: Callable[[int], Hashable]) -> int:
    """The updates applied before 0-based step `step`: the optimizer's count
    when the step runs, i.e. `step` less the steps skipped before it.

    `key(count)` names the program of the update after `count` updates.
    While steps are in flight their skips are unknown; if any of them
    being skipped would change the key, this waits for them first (so
    only near a schedule's boundaries), else it returns the count on the
    assumption that none is.
    """
    count = step - self.skipped_in_all
    if any(key(c) != key(count) for c in range(count - len(self._queue),
                                               count)):
      self.drain()
      count = step - self.skipped_in_all
    return count

  def push(self, step: int, metrics: dict) -> None:
    """Records dispatched `step`; waits for older steps beyond the depth."""
    self._queue.append((step, metrics))
    while len(self._queue) > self._depth:
      self._finish()

  def drain(self) -> None:
    """Waits for every dispatched step (e.g. before a checkpoint)."""
    while self._queue:
      self._finish()

  def _finish(self) -> None:
    step, metrics = self._queue.popleft()
    flag = jax.block_until_ready(metrics['skipped'])  # every device done
    self.finished = step
    if not float(flag):
      self.in_a_row = 0
      return
    self.in_a_row += 1
    self.skipped += 1
    if self._on_skip is not None:
      self._on_skip(step, {k: float(jax.device_get(v)) for k, v in
                           metrics.items() if k in ('loss', 'grad_norm')},
                    self.in_a_row)
    if self.in_a_row >= self._max_bad:
      self._queue.clear()
      first = step - self.in_a_row + 1
      raise DivergedError(
          f'training diverged: steps {first}..{step} ({self.in_a_row} in a '
          f'row, max_bad_steps={self._max_bad}) had a non-finite loss '
          f'or gradient norm. Each was skipped, so the parameters (and '
          f'any checkpoint saved since) are those after step {first - 1}. '
          'Resume from the last checkpoint with a lower optimizer.lr (or '
          'clip_norm) and --allow-config-change, or raise max_bad_steps.')
