"""Observability: JSONL + TensorBoard metrics, a loss plot, a progress bar.

`metrics.jsonl` holds one JSON object per `MetricsLogger.log` call::

  {"step": 100, "split": "train", "loss": 3.21, "lr": 0.0003}

Non-finite values are written as the strings "nan", "inf" and "-inf" so that
every line is strict JSON (`json.loads` in any language, `jq`); `read_jsonl`
turns them back into floats.

Every write that fails (a full disk, an I/O error) raises
`outdir.OutputError` naming the file. The file is only ever appended to, or
truncated in place on a resume (`_truncate_after`), never replaced.
"""

import json
import math
import os
import sys
import time
from typing import Any, Mapping, Optional

import tqdm

from scape_jax.train.outdir import OutputError, strerror

_NON_FINITE = {'nan': math.nan, 'inf': math.inf, '-inf': -math.inf}


def _encode_non_finite(value: float) -> float | str:
  if math.isfinite(value):
    return value
  return 'nan' if math.isnan(value) else ('inf' if value > 0 else '-inf')


class MetricsLogger:
  """Appends metrics to `out_dir/metrics.jsonl` and TensorBoard `out_dir/tb`.

  Create it with `enabled=False` on processes other than 0: it then writes
  nothing and creates no files. A run that resumes at step `start` passes
  `start`: the records of later steps, written before the run was cut off and
  about to be written again, are dropped first (TensorBoard: `purge_step`),
  and a record of step `start` itself is not written twice (rerunning a
  finished run evaluates its last step again).
  """

  def __init__(self, out_dir: str, *, enabled: bool = True,
               tensorboard: bool = True, start: Optional[int] = None):
    self.out_dir = out_dir
    self.enabled = enabled
    self.path = os.path.join(out_dir, 'metrics.jsonl')
    self._file = None
    self._tb = None
    self._start, self._logged_at_start = start, set()
    if not enabled:
      return
    try:
      os.makedirs(out_dir, exist_ok=True)
      if start is not None and os.path.exists(self.path):
        self._logged_at_start = _truncate_after(self.path, start)
      self._file = open(self.path, 'a', encoding='utf-8')
    except OSError as e:
      raise OutputError(f'writing {self.path} failed: {strerror(e)}') from None
    if tensorboard:
      self._tb = _EventFile(os.path.join(out_dir, 'tb'),
                            purge_step=None if start is None else start + 1)

  def log(self, step: int, metrics: Mapping[str, Any],
          prefix: str = 'train') -> None:
    """Records scalar `metrics` (floats, numpy/jax scalars) at `step`."""
    if not self.enabled:
      return
    if step == self._start and prefix in self._logged_at_start:
      return  # already in the file, from before the resume
    reserved = {'step', 'split'} & set(metrics)
    if reserved:
      raise ValueError(f'metric names {sorted(reserved)} are reserved')
    values = {key: None if value is None else float(value)
              for key, value in metrics.items()}  # None: not known
    record = {'step': int(step), 'split': prefix}
    record.update({k: v if v is None else _encode_non_finite(v)
                   for k, v in values.items()})
    try:
      self._file.write(json.dumps(record, allow_nan=False) + '\n')
      self._file.flush()
    except OSError as e:
      raise OutputError(f'writing {self.path} failed: {strerror(e)}') from None
    if self._tb is not None:  # the JSONL line keeps NaN and inf
      # wall_time: seconds since 1970, which TensorBoard's float32 scalars
      # round to the same value for minutes; elapsed_s is plotted instead.
      self._tb.scalars(int(step), {
          f'{prefix}/{k}': v for k, v in values.items()
          if v is not None and math.isfinite(v) and k != 'wall_time'})

  def close(self) -> None:
    """Closes the files; raises OutputError if their last bytes fail."""
    file, self._file = self._file, None
    tb, self._tb = self._tb, None
    try:
      if file is not None:
        try:
          file.close()
        except OSError as e:
          raise OutputError(f'writing {self.path} failed: '
                            f'{strerror(e)}') from None
    finally:
      if tb is not None:
        tb.close()

  def __enter__(self) -> 'MetricsLogger':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _decode_non_finite(value: Any) -> Any:
  return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Reads a metrics.jsonl file; "nan"/"inf" strings become floats again.

  A truncated last line (a crash mid-write) is skipped.
  """
  records = []
  with open(path, encoding='utf-8') as f:
    lines = f.read().split('\n')
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if number == len(lines):  # No newline yet: a half-written last line.
        continue
      raise
    records.append({k: (v if k == 'split' else _decode_non_finite(v))
                    for k, v in record.items()})
  return records


def _truncate_after(path: str, step: int) -> set:
  """Keeps the lines of `path` whose step is <= `step`, in place; returns
  the splits that have a record at `step`.

  The kept lines are usually a prefix of the file (a resume drops the
  lines of the steps after its checkpoint): then the file is only
  truncated. Otherwise (a half-written line of a run that was cut off,
  followed by lines) the kept lines are written over the file's start.
  """
  with open(path, 'r+', encoding='utf-8', newline='') as f:
    lines = f.read().split('\n')
    kept, at_step = [], set()
    for line in filter(str.strip, lines):
      try:
        record = json.loads(line)
        if record['step'] <= step:
          kept.append(line + '\n')
        if record['step'] == step:
          at_step.add(record.get('split'))
      except (json.JSONDecodeError, KeyError, TypeError):
        pass  # a half-written line of the run that was cut off
    text = ''.join(kept)
    if '\n'.join(lines)[:len(text)] != text:
      f.seek(0)
      f.write(text)
      f.flush()
    f.truncate(len(text.encode('utf-8')))
  return at_step


class _EventFile:
  """TensorBoard scalars, written and flushed at once on the caller's
  thread (tensorboardX's SummaryWriter writes on a thread of its own, whose
  failures would be printed there and lost to the caller)."""

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    from tensorboardX import event_file_writer  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    self._event_pb2 = event_pb2
    self._logdir = logdir
    self._writer = None
    try:
      os.makedirs(logdir, exist_ok=True)
      self._writer = event_file_writer.EventsWriter(
          os.path.join(logdir, 'events'))
      if purge_step is not None:  # TensorBoard hides later steps' events
        self._writer.write_event(event_pb2.Event(
            step=purge_step, file_version='brain.Event:2'))
        self._writer.write_event(event_pb2.Event(
            step=purge_step, session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))
      self._writer.flush()
    except OSError as e:
      self._failed(e)

  def _failed(self, e: OSError):
    raise OutputError(f'writing TensorBoard events into {self._logdir} '
                      f'failed: {strerror(e)}') from None

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    try:
      for tag, value in values.items():
        self._writer.write_event(self._event_pb2.Event(
            wall_time=time.time(), step=step,
            summary=summary.scalar(tag, value)))
      self._writer.flush()
    except OSError as e:
      self._failed(e)

  def close(self) -> None:
    writer, self._writer = self._writer, None
    if writer is not None:
      try:
        writer.close()
      except OSError as e:
        self._failed(e)


def plot_loss(metrics_jsonl: str, png_path: str, *, log_y: bool = False,
              key: str = 'loss') -> None:
  """Plots train `key` vs step as a line and eval `key` as markers.

  Raises:
    OutputError: the plot cannot be written.
  """
  # Imported here, at the end of a run: matplotlib's import is a fifth of
  # the trainer's. A `Figure` without pyplot: no backend, no global state.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  records = read_jsonl(metrics_jsonl)
  fig = Figure(figsize=(8, 5))
  ax = fig.subplots()
  for split, style in (('train', dict(lw=1.0)),
                       ('eval', dict(marker='o', ls='--', ms=4))):
    points = sorted((r['step'], r[key]) for r in records
                    if r.get('split') == split and key in r)
    if points:
      steps, values = zip(*points)
      ax.plot(steps, values, label=f'{split} {key}', **style)
  ax.set_xlabel('step')
  ax.set_ylabel(key)
  if log_y:
    ax.set_yscale('log')
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend()
  fig.tight_layout()
  try:
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=100)
  except OSError as e:
    raise OutputError(f'writing the loss plot {png_path} failed: '
                      f'{strerror(e)}') from None


class Progress:
  """A tqdm bar on a terminal; prints nothing when stdout is not a TTY."""

  def __init__(self, total: int, initial: int = 0):
    self._bar = None
    if sys.stdout.isatty():
      self._bar = tqdm.tqdm(total=total, initial=initial, file=sys.stdout,
                            dynamic_ncols=True)

  def update(self, n: int = 1, **postfix: Any) -> None:
    if self._bar is None:
      return
    if postfix:
      self._bar.set_postfix(
          {k: (f'{float(v):.4g}' if _is_number(v) else v)
           for k, v in postfix.items()}, refresh=False)
    self._bar.update(n)

  def set_loss(self, loss: float) -> None:
    """Shows `loss` beside the bar."""
    if self._bar is not None:
      self._bar.set_postfix(loss=f'{loss:.4g}')

  def write(self, line: str) -> None:
    """Prints `line` on its own terminal line, above the bar."""
    if self._bar is None:
      print(line, flush=True)
    else:
      tqdm.tqdm.write(line, file=sys.stdout)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _is_number(value: Any) -> bool:
  try:
    float(value)
  except (TypeError, ValueError):
    return False
  return not isinstance(value, str)
