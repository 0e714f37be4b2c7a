"""The run's compiled train-step programs, the first before step 1 and the
rest in the background.

A method whose update takes static arguments runs several programs (SCAPE:
one per density level of its warmup, or with `shared_warmup` one for the
sparse levels before the last; Radius: its dense, sparse and resample
steps; DiLoCo and Pier: inner and sync steps). Compiling them all before
the first step kept a run's devices idle for minutes (docs/benchmarks.md,
"Time to the first step"). `StepPrograms.start` compiles the program of
the first update, and submits the others to one background thread in the
order the run reaches them; the loop waits for a program only if it
arrives before its compile has finished, and that wait is not counted in
the step times (`take_waited`). The programs are the same: the numbers are
bit for bit those of compiling them all first.

`compile_cache` points JAX's persistent compilation cache at the run's
`compile_cache` directory, so that a restart loads its programs instead of
compiling them again (docs/benchmarks.md, "Time to the first step").
"""

import concurrent.futures
import contextlib
import os
import time
from typing import Callable, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

from scape_jax import analysis
from scape_jax.train.config import Config, ConfigError
from scape_jax.train.program import Program, program_key


@contextlib.contextmanager
def compile_cache(cfg: Config):
  """Context manager: JAX's persistent compilation cache in the run's
  directory (`cfg.compile_cache`) while it is open, the previous setting
  afterwards. Yields the directory in use.

  JAX keys each entry by the program, the compiler and its flags, and the
  devices; only process 0 writes, and an entry that cannot be read is
  compiled again (with a warning).

  Raises:
    ConfigError: the path exists and is not a directory.
  """
  previous = jax.config.jax_compilation_cache_dir
  if cfg.compile_cache == 'auto' and previous:
    yield previous  # the process's own (JAX_COMPILATION_CACHE_DIR)
    return
  name = 'xla_cache' if cfg.compile_cache == 'auto' else cfg.compile_cache
  path = os.path.join(cfg.out_dir, os.path.expanduser(name))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(
        f'compile_cache={cfg.compile_cache!r}: {path} is not a directory; '
        "give a directory for JAX's compilation cache, or 'auto'.")
  cc.set_cache_dir(path)
  cc.reset_cache()  # JAX opens its cache once, at the first compile
  try:
    yield path
  finally:
    cc.set_cache_dir(previous)
    cc.reset_cache()


class StepPrograms:
  """Compiles each distinct train-step program once (e.g. one per SCAPE level).

  A program is keyed by the method's static update arguments for the update
  after `count` updates: the optimizer's count, which a skipped step does
  not advance (`guard.InFlightSteps.updates_before`).
  """

  def __init__(self, program: Program, cache_dir: Optional[str] = None):
    self._program = program
    self._cache_dir = cache_dir  # named in `start`'s line
    self._futures = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='compile')
    self._waited = 0.0

  def key(self, count: int) -> tuple:
    """The program of the update after `count`: its sorted static args."""
    return program_key(self._program, count)

  def _compile(self, count: int) -> tuple:
    exe = self._program.compile_step(count)
    return exe, analysis.collectives_from_hlo(exe.as_text())

  def submit(self, count: int) -> concurrent.futures.Future:
    """The future of the update after `count`'s program (compiled in the
    background thread, once)."""
    key = self.key(count)
    if key not in self._futures:  # (called from the loop's thread only)
      self._futures[key] = self._pool.submit(self._compile, count)
    return self._futures[key]

  def __call__(self, count: int):
    """(executable, bytes sent per device) for the update after `count`;
    waits for its compile if it is still running."""
    future = self.submit(count)
    t = time.perf_counter()
    exe, cols = future.result()
    self._waited += time.perf_counter() - t
    return exe, analysis.bytes_sent(cols)

  def take_waited(self) -> float:
    """Seconds spent waiting for compiles since the last call."""
    waited, self._waited = self._waited, 0.0
    return waited

  def first_counts(self, start: int, end: int) -> dict:
    """{program key: the first of the counts start..end-1 that runs it}."""
    firsts = {}
    for count in range(start, end):
      firsts.setdefault(self.key(count), count)
    return firsts

  def start(self, start: int, end: int,
            say: Optional[Callable[[str], None]] = None) -> float:
    """Compiles the program of the update after `start` now and queues the
    others that the updates after start..end-1 use; returns the seconds to
    the first program (0 when there is none). `say` (None: silent) gets one
    line before and one after."""
    firsts = sorted(self.first_counts(start, end).values())
    if not firsts:  # a finished run, rerun: nothing to compile
      return 0.0
    t = time.perf_counter()
    if say:
      rest = (f', then {len(firsts) - 1} more in the background while it '
              'trains' if len(firsts) > 1 else '')
      cache = (f'; compile cache {self._cache_dir}' if self._cache_dir
               else '')
      say(f'compiling the train step: {len(firsts)} program'
          f'{"s" if len(firsts) > 1 else ""} ({_keys(self, firsts)}), the '
          f'first now{rest}{cache}')
    for count in firsts:
      self.submit(count)
    self.submit(firsts[0]).result()
    seconds = time.perf_counter() - t
    if say:
      say(f'compiled the first program in {seconds:.1f} s')
    return seconds

  def runs(self, start: int, end: int) -> list:
    """[(static arguments, updates it ran, collectives)] of each program
    the updates after start..end-1 ran, in the order the run reached them
    (each waits for its compile)."""
    steps = {}
    for count in range(start, end):
      steps[self.key(count)] = steps.get(self.key(count), 0) + 1
    return [(key, n, self.collectives(count)) for (key, n), count in zip(
        steps.items(), self.first_counts(start, end).values())]

  def collectives(self, count: int):
    self(count)
    return self._futures[self.key(count)].result()[1]

  def close(self) -> None:
    """Drops the compiles not started yet; a running one finishes."""
    self._pool.shutdown(wait=False, cancel_futures=True)


def _keys(programs: StepPrograms, counts: list) -> str:
  """The programs' static arguments, e.g. 'density_level=0..7'."""
  keys = [programs.key(c) for c in counts]
  if not keys or not keys[0]:
    return 'no static arguments'
  if len(keys[0]) == 1 and all(len(k) == 1 for k in keys):
    name = keys[0][0][0]
    return f'{name}=' + ','.join(str(k[0][1]) for k in keys)
  return '; '.join(', '.join(f'{n}={v}' for n, v in k) for k in keys)
