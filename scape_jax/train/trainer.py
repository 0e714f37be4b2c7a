"""The train loop. It delegates: setup to `program` and `_DataFeed`, resuming
to `resume`, saving to `_Saver`, logging to `_Reporter`, compiling to
`StepPrograms`, the steps in flight and the non-finite watch to
`guard.InFlightSteps`, signals to `preemption.StopSignals`.

`train(cfg)` runs (or resumes) the run in `cfg.out_dir`, holding its lock
(`outdir.RunLock`), and returns a summary. It raises `guard.DivergedError`
after `cfg.max_bad_steps` non-finite steps in a row,
`preemption.Interrupted` after saving on SIGTERM/SIGINT, and
`outdir.OutputError` when a write into out_dir fails (saying how many steps
since the last good checkpoint are lost).
"""

import math
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax import analysis
from scape_jax import hf
from scape_jax.train import agreement
from scape_jax.train import banner
from scape_jax.train import config as config_lib
from scape_jax.train import guard
from scape_jax.train import outdir
from scape_jax.train import preemption
from scape_jax.train import resume
from scape_jax.train import step as step_lib
from scape_jax.train.checkpoint import Checkpointer
from scape_jax.train.metrics import MetricsLogger, Progress, plot_loss
from scape_jax.train import flops as flops_lib
from scape_jax.train import program as program_lib
from scape_jax.train.compiled import StepPrograms, compile_cache
from scape_jax.train.program import Program, build_program


class _DataFeed:
  """The prepared corpus, the train iterator and the eval batches."""

  def __init__(self, cfg: config_lib.Config, program: Program):
    from scape_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
    self._program = program
    data_dir = _prepare_data(cfg)
    self.iterator, local_eval = agreement.together(
        lambda: self._open(cfg, data_dir), 'reading the data',
        prepare_lib.CorpusError, catch=(config_lib.ConfigError, OSError))
    self.eval_batches = [self._global(b) for b in local_eval]

  def _open(self, cfg: config_lib.Config, data_dir: str) -> tuple:
    """(train iterator, this process's eval batches); no collectives."""
    from scape_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    from scape_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
    try:
      meta = prepare_lib.load_meta(data_dir)
    except FileNotFoundError as e:
      raise prepare_lib.CorpusError(
          f'{e}' + (' (process 0 prepared it: with several hosts, data_dir '
                    'must be on a shared filesystem or prepared on every '
                    'host)' if jax.process_count() > 1 else '')) from e
    if jax.process_index() == 0:
      _check_tokenizer(cfg.data, meta, data_dir)
    self.tokenizer = {'spec': meta.get('tokenizer'),
                      'sha256': meta.get('tokenizer_sha256')}
    if meta['vocab_size'] > self._program.model_cfg.vocab_size:
      raise config_lib.ConfigError(program_lib.vocab_problem(
          cfg, meta['vocab_size'], self._program.model_cfg.vocab_size))
    d, rank, ranks = cfg.data, jax.process_index(), jax.process_count()
    try:
      return (pipeline.train_iterator(
          data_dir, seq_len=d.seq_len, global_batch_size=d.batch_size,
          seed=cfg.seed, process_index=rank, process_count=ranks),
              pipeline.eval_batches(
                  data_dir, seq_len=d.seq_len, batch_size=d.batch_size,
                  num_batches=cfg.eval_batches, process_index=rank,
                  process_count=ranks))
    except ValueError as e:  # a corpus too small for these settings
      raise prepare_lib.CorpusError(f'data.corpus {d.corpus!r}: {e}') from e

  def _global(self, local: dict) -> dict:
    sharding = self._program.batch_sharding()
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local.items()}

  def next(self) -> dict:
    return self._global(next(self.iterator))


def _check_tokenizer(d: config_lib.DataConfig, meta: dict,
                     data_dir: str) -> None:
  """Raises ConfigError unless the corpus was made with `d.tokenizer`.

  The model learns the corpus's ids, and the export writes `d.tokenizer`
  beside it: the two must be one tokenizer.
  """
  from scape_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  made_with, digest = meta.get('tokenizer'), meta.get('tokenizer_sha256')
  if made_with == 'synthetic':  # random ids: no text to tokenize
    return
  try:
    ours = tokenizer_lib.fingerprint(d.tokenizer)
  except OSError:  # no such file: not the corpus's tokenizer either
    ours = None
  if not prepare_lib.made_with(meta, d.tokenizer, ours):
    raise config_lib.ConfigError(
        f'the corpus in {data_dir!r} was tokenized with {made_with!r}'
        f'{"" if digest is None else f" (sha256 {digest[:12]}...)"}, but '
        f'data.tokenizer is {d.tokenizer!r}: set --config.data.tokenizer to '
        'the tokenizer the corpus was prepared with')


def _prepare_data(cfg: config_lib.Config) -> str:
  """Prepares the corpus once (on process 0) and returns its directory.

  Every process waits for process 0 here, and all stop if it failed.
  """
  from scape_jax.data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  d = cfg.data
  tok_name = os.path.splitext(os.path.basename(d.tokenizer))[0]
  name = os.path.basename(os.path.normpath(d.corpus))
  data_dir = d.data_dir or os.path.join(prepare_lib.cache_dir(), 'data',
                                        f'{name}-{tok_name}')
  prepared = os.path.exists(os.path.join(d.corpus, 'meta.json'))
  if prepared:
    data_dir = d.corpus  # an already prepared directory

  def prepare():
    if jax.process_index() != 0:
      return
    if prepared:
      if d.data_dir and not resume.same_path(d.data_dir, d.corpus):
        raise prepare_lib.CorpusError(
            f'data.data_dir={d.data_dir!r} is not used: data.corpus='
            f'{d.corpus!r} is a prepared corpus, read where it is; drop '
            'data.data_dir, or set data.corpus to the text it was made from')
      return
    if d.corpus != 'synthetic':
      held = None if d.data_dir else prepare_lib.held_corpus(data_dir)
      ours = prepare_lib.describe(d.corpus)
      # (a path is a directory corpus; another text a built-in one, whose
      # description may change between versions of the same corpus)
      if held not in (None, ours) and (os.path.isabs(held) or
                                       os.path.isabs(ours)):
        raise prepare_lib.CorpusError(
            f'{data_dir!r}, the default data dir for data.corpus='
            f'{d.corpus!r}, holds the corpus prepared from {held}: set '
            'data.data_dir to a directory of its own')
      prepare_lib.prepare(d.corpus, d.tokenizer, data_dir)  # idempotent
    elif not os.path.exists(os.path.join(data_dir, 'meta.json')):
      prepare_lib.make_synthetic_corpus(data_dir, num_tokens=1 << 18)

  agreement.together(prepare, 'preparing the data', prepare_lib.CorpusError,
                     catch=(OSError,))
  return data_dir


def _fetch(metrics: dict) -> dict:
  """Device scalars (or per-worker vectors, averaged) -> Python floats.

  A per-worker vector spans every process's devices; its mean is computed on
  the devices (replicated) so that each process can read it.
  """
  return {k: float(jax.device_get(jnp.mean(v) if jnp.ndim(v) else v))
          for k, v in metrics.items()}


class _Reporter:
  """Holds each step's device metrics until the next log line, then writes
  them (JSONL, TensorBoard, stdout, progress bar).

  Per step: loss, lr, grad_norm, comm_bytes, tokens_seen, the method's
  statistics. Over the log interval, on its last step only: step_ms and
  tokens_per_s (its mean), mfu (None where the device's peak is unknown),
  elapsed_s (since the run started), eta_s and peak_memory_bytes (None
  where the devices do not say).
  """

  def __init__(self, cfg: config_lib.Config, program: Program, start: int,
               updates: int):
    self._cfg, self._program = cfg, program
    self._updates = updates  # applied before the next step to be logged
    self.leader = jax.process_index() == 0
    self.logger = MetricsLogger(cfg.out_dir, enabled=self.leader,
                                start=start)
    self._bar = Progress(cfg.steps, initial=start) if self.leader else None
    self._tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    devices = program.mesh.devices.flat
    self._peak = flops_lib.peak_flops(devices[0].device_kind,
                                      cfg.peak_tflops * 1e12)
    self._flops_per_token = flops_lib.train_flops_per_token(
        program_lib.param_count(program), program.model_cfg.n_layers,
        program.model_cfg.d_model, cfg.data.seq_len)
    self._pending = []
    self._in_a_row = 0  # skipped steps in a row up to the last fetched
    self.history = []
    self.skipped_steps = 0  # non-finite steps whose update was skipped
    self.last_step = start  # the last step recorded
    self._started = time.perf_counter()
    self.restart_clock()

  def restart_clock(self) -> None:
    self._t0 = time.perf_counter()

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (an eval, a save) out of the next line's tok/s."""
    self._t0 += seconds

  def record(self, step: int, metrics: dict) -> None:
    self._pending.append((step, metrics))
    self.last_step = step
    if self._bar:
      self._bar.update(1)

  def flush(self) -> None:
    """Fetches the pending metrics and writes one log line."""
    if not self._pending:
      return
    fetched = [(s, _fetch(x)) for s, x in self._pending]
    elapsed = max(time.perf_counter() - self._t0, 1e-9)
    wall_time = time.time()  # when the last pending step had finished
    self._pending = []
    for s, x in fetched:  # the learning rate of the update the step made
      x['lr'] = float(self._program.method.learning_rate(self._updates))
      x['tokens_seen'] = s * self._tokens_per_step
      self._updates += x['skipped'] == 0
      self._in_a_row = self._in_a_row + 1 if x['skipped'] else 0
      if x['skipped']:  # in step order with the step lines
        self._say_skipped(s, x)
      if s == fetched[-1][0]:
        x.update(self._interval(s, elapsed, len(fetched)))
      self.logger.log(s, dict(x, wall_time=wall_time))
      self.history.append(x['loss'])
    s, x = fetched[-1]
    if self.leader and not x['skipped']:
      self._bar.write(_step_line(s, x))
    if self.leader:
      self._bar.set_loss(x['loss'])
    self.restart_clock()

  def _interval(self, step: int, seconds: float, steps: int) -> dict:
    """The log interval's figures, on its last step."""
    tps = self._tokens_per_step * steps / seconds
    step_s = seconds / steps
    return {'step_ms': 1e3 * step_s, 'tokens_per_s': tps,
            'mfu': flops_lib.mfu(tps, self._flops_per_token, self._peak,
                                 self._program.mesh.devices.size),
            'elapsed_s': time.perf_counter() - self._started,
            'eta_s': (self._cfg.steps - step) * step_s,
            'peak_memory_bytes': _peak_memory(self._program)}

  def _say_skipped(self, step: int, metrics: dict) -> None:
    """Prints the line of a step whose update was skipped (non-finite)."""
    if self.leader:
      self._bar.write(
          f'step {step:6d} | loss {metrics["loss"]:.4g} | grad '
          f'{metrics["grad_norm"]:.4g}: not finite, update skipped '
          f'({self._in_a_row} in a row; the run stops at max_bad_steps='
          f'{self._cfg.max_bad_steps})')

  def eval(self, step: int, loss: float) -> None:
    ppl = math.exp(min(loss, 50))
    self.logger.log(step, {'loss': loss, 'perplexity': ppl}, prefix='eval')
    if self.leader:
      self._bar.write(f'step {step:6d} | eval loss {loss:.4f} | ppl '
                      f'{ppl:.2f}')

  def close(self) -> None:
    if self._bar:
      self._bar.close()
    self.logger.close()


def _step_line(step: int, x: dict) -> str:
  """One log line: the step's numbers and its interval's."""
  mfu = '' if x['mfu'] is None else f' | MFU {100 * x["mfu"]:.1f}%'
  memory = ('' if x['peak_memory_bytes'] is None else
            f' | mem {x["peak_memory_bytes"] / 2**30:.2f} GiB')
  return (f'step {step:6d} | loss {x["loss"]:.4f} | lr {x["lr"]:.2e} | '
          f'grad {x["grad_norm"]:.3f} | {x["step_ms"]:.1f} ms/step | '
          f'{x["tokens_per_s"]:,.0f} tok/s{mfu} | '
          f'{x["comm_bytes"] / 2**20:.3f} MiB/step | '
          f'{_duration(x["elapsed_s"])} elapsed, ETA '
          f'{_duration(x["eta_s"])}{memory}')


def _duration(seconds: float) -> str:
  minutes, s = divmod(int(round(seconds)), 60)
  hours, m = divmod(minutes, 60)
  return f'{hours}h{m:02d}m' if hours else f'{m}m{s:02d}s'


def _peak_memory(program: Program) -> Optional[int]:
  """The largest peak bytes in use of this process's devices, or None
  where they do not report it (the CPU)."""
  peaks = []
  for device in program.mesh.local_devices:
    stats = device.memory_stats() or {}
    if 'peak_bytes_in_use' in stats:
      peaks.append(stats['peak_bytes_in_use'])
  return max(peaks) if peaks else None


class _Saver:
  """Saves the train state with the data position and the config."""

  def __init__(self, cfg: config_lib.Config, ckpt: Checkpointer, feed,
               config_history: list, mesh: jax.sharding.Mesh):
    self._cfg, self._ckpt, self._feed = cfg, ckpt, feed
    self._history = config_history
    self._mesh = resume.mesh_sizes(mesh)
    # The base model's config.json (build_program has just read it): an
    # export then needs no model.init_from directory.
    self._init_from = (hf.read_config(cfg.model.init_from)
                       if cfg.model.init_from else None)

  @property
  def directory(self) -> str:
    return self._ckpt.directory

  def __call__(self, step: int, params, opt_state, skipped: int) -> None:
    self._ckpt.save(step, {'params': params, 'opt': opt_state},
                    {'data': self._feed.iterator.get_state(),
                     'skipped_steps': skipped,
                     'config': config_lib.to_dict(self._cfg),
                     'config_history': self._history,
                     'tokenizer': self._feed.tokenizer,
                     'mesh': self._mesh,
                     **({'init_from_config': self._init_from}
                        if self._init_from is not None else {})})


def _checkpoint_due(cfg: config_lib.Config, done: int) -> bool:
  return bool(cfg.ckpt_every and done % cfg.ckpt_every == 0) or (
      done == cfg.steps)


def _summarize(cfg, reporter: _Reporter, start: int,
               eval_loss: Optional[float], compile_s: float) -> dict:
  history = reporter.history
  summary = {'steps': cfg.steps, 'start_step': start,
             'first_program_s': compile_s,
             'skipped_steps': reporter.skipped_steps,
             'first_loss': history[0] if history else None,
             'final_loss': history[-1] if history else None,
             'eval_loss': eval_loss, 'losses': history}
  if reporter.leader:
    png = os.path.join(cfg.out_dir, 'loss.png')
    try:
      plot_loss(reporter.logger.path, png)
    except outdir.OutputError as e:
      raise outdir.OutputError(f'{e}; the run itself is done, its last '
                               f'checkpoint saved (step {cfg.steps})') from e
    if history:
      print(f'done: {cfg.steps} steps, loss {history[0]:.3f} -> '
            f'{history[-1]:.3f}, eval loss {eval_loss:.3f} (ppl '
            f'{math.exp(min(eval_loss, 50)):.2f}); metrics '
            f'{reporter.logger.path}, plot {png}')
  return summary


def train(cfg: config_lib.Config, devices=None, *,
          allow_config_change: bool = False) -> dict:
  """Trains (or resumes) the run in `cfg.out_dir`; returns a summary.

  Args:
    cfg: the run's config.
    devices: the devices of the mesh (default: all).
    allow_config_change: resume even if keys that change the computation
      differ from the checkpoint's config (`resume.check_config`).

  Raises:
    outdir.RunLockedError: another trainer holds out_dir's lock.
    outdir.OutputError: a write into out_dir failed.
  """
  agreement.same_config(cfg)
  agreement.together(lambda: outdir.check_shape(cfg.out_dir),
                     'checking out_dir', config_lib.ConfigError)
  agreement.shared_dir(cfg.out_dir, 'out_dir')
  with outdir.RunLock(cfg.out_dir, hold=jax.process_index() == 0) as lock:
    agreement.together(lock.acquire, 'locking out_dir',
                       config_lib.ConfigError, catch=(outdir.OutputError,))
    with compile_cache(cfg) as cache_dir:
      return _train(cfg, devices, allow_config_change, cache_dir)


def _train(cfg: config_lib.Config, devices, allow_config_change: bool,
           cache_dir: Optional[str]) -> dict:
  """`train` once out_dir is checked and locked."""
  program = build_program(cfg, devices)
  agreement.nodes_are_hosts(program.mesh, cfg.mesh.nodes)
  program_lib.print_notes(program)
  feed = _DataFeed(cfg, program)
  ckpt = Checkpointer(os.path.join(cfg.out_dir, 'ckpt'),
                      max_to_keep=cfg.keep_checkpoints)
  leader = jax.process_index() == 0
  resumed = resume.restore_or_init(cfg, program, ckpt, feed.iterator,
                                   allow_config_change,
                                   say=print if leader else None)
  start = resumed.start
  updates = start - resumed.skipped  # the optimizer's count at `start`
  reporter = _Reporter(cfg, program, start, updates)
  if start and leader:
    print(f'resumed from {cfg.out_dir}/ckpt step {start}')
  programs = StepPrograms(program, cache_dir)
  if leader:
    print(banner.banner(cfg, program), flush=True)
  compile_s = programs.start(updates, cfg.steps, say=(
      lambda line: print(line, flush=True)) if leader else None)
  if updates < cfg.steps:
    reporter.logger.log(start, {
        'first_program_s': compile_s,
        'programs': len(programs.first_counts(updates, cfg.steps))},
                        prefix='compile')
    if leader:
      _print_collectives(programs, updates)
  # A signal after the last step (final eval, the wait for the last save)
  # is held too: the run finishes and saves; a second one kills at once.
  with preemption.StopSignals() as signals:
    try:
      try:
        last_eval = _loop(cfg, program, programs, feed, reporter, resumed,
                          _Saver(cfg, ckpt, feed, resumed.config_history,
                                 program.mesh),
                          signals)
      finally:
        programs.close()
        try:
          ckpt.close()  # raises a save's failure (checkpoint.SaveError)
        finally:
          reporter.close()
    except outdir.OutputError as e:  # a full disk, an I/O error
      raise outdir.OutputError(
          f'{e}; {outdir.lost_work(ckpt.directory, reporter.last_step)}'
      ) from e
  if leader and updates < cfg.steps:
    print('bytes each device sent per step, by program:\n' +
          banner.bytes_table(programs.runs(updates, cfg.steps)))
  return _summarize(cfg, reporter, start, last_eval, compile_s)


def _print_collectives(programs: StepPrograms, start: int) -> None:
  """The collectives of the first program (the others compile while the
  run trains; `--dry-run` prints the steady state's)."""
  key = programs.key(start)
  label = (f' ({", ".join(f"{k}={v}" for k, v in key)})' if key else '')
  print(f'collectives of the train step{label}, per device per step:')
  print(analysis.format_table(programs.collectives(start)))


def _loop(cfg, program: Program, programs: StepPrograms, feed: _DataFeed,
          reporter: _Reporter, resumed: resume.Resumed, save: _Saver,
          signals: preemption.StopSignals) -> float:
  """Steps `resumed.start`..`cfg.steps`; returns the last eval loss."""
  params, opt_state = resumed.params, resumed.opt_state
  evaluate = step_lib.make_eval_step(program.apply_fn, program.layout)

  def eval_loss() -> float:
    return float(np.mean([float(evaluate(params, b))
                          for b in feed.eval_batches]))

  in_flight = guard.InFlightSteps(cfg.max_bad_steps,
                                  skipped_before=resumed.skipped)
  last_eval = None
  reporter.restart_clock()
  for step in range(resumed.start, cfg.steps):
    try:
      # The program of the optimizer's count, not of the step number: a
      # skipped step does not advance the count (guard.py).
      fn, nbytes = programs(in_flight.updates_before(step, programs.key))
      reporter.exclude(programs.take_waited())  # a compile, not a step
      params, opt_state, metrics = fn(params, opt_state, feed.next())
      done = step + 1
      # Copies: the next step donates (and deletes) the state's buffers.
      stats = jax.tree.map(jnp.copy, program.method.stats(opt_state))
      reporter.record(done, dict(metrics, comm_bytes=nbytes, **stats))
      in_flight.push(done, metrics)
      signum = signals.requested()
      saving = _checkpoint_due(cfg, done) or signum is not None
      if saving:
        in_flight.drain()  # a checkpoint only of steps known finite
    except guard.DivergedError:
      reporter.flush()
      raise
    skipped_now = in_flight.skipped != reporter.skipped_steps
    reporter.skipped_steps = in_flight.skipped
    # Before a save: a resume starts after its lines. At a skipped step:
    # its line comes at once, in order with the step lines.
    if (done % cfg.log_every == 0 or done == cfg.steps or saving or
        skipped_now):
      reporter.flush()
    if cfg.eval_every and done % cfg.eval_every == 0:
      jax.block_until_ready(params)  # the steps' own time stays theirs
      t = time.perf_counter()
      last_eval = eval_loss()
      reporter.eval(done, last_eval)
      reporter.exclude(time.perf_counter() - t)
    if saving:
      t = time.perf_counter()
      save(done, params, opt_state, in_flight.skipped_in_all)
      reporter.exclude(time.perf_counter() - t)
    if signum and done < cfg.steps:
      raise preemption.Interrupted(signum, done, (
          f'{preemption.name(signum)} received: stopped after step {done} '
          f'and saved {save.directory}/{done}; run the same command to '
          'resume from there'))
  if last_eval is None or (cfg.eval_every and cfg.steps % cfg.eval_every):
    last_eval = eval_loss()
    reporter.eval(cfg.steps, last_eval)
  return last_eval
