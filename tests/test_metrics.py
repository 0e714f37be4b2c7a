"""Tests for scape_jax.metrics."""

import glob
import io
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from scape_jax.train import metrics


def test_jsonl_and_tensorboard(tmp_path):
  out = str(tmp_path / 'run')
  with metrics.MetricsLogger(out) as logger:
    logger.log(1, {'loss': jnp.float32(3.5), 'lr': np.float64(1e-4)})
    logger.log(2, {'loss': 3.0, 'grad_norm': float('nan')})
    logger.log(2, {'loss': 3.25, 'ppl': math.inf}, prefix='eval')
  lines = (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
  assert len(lines) == 3
  first = json.loads(lines[0])  # Strict JSON: no NaN/Infinity tokens.
  assert first == {'step': 1, 'split': 'train', 'loss': 3.5, 'lr': 1e-4}
  assert json.loads(lines[1])['grad_norm'] == 'nan'
  records = metrics.read_jsonl(os.path.join(out, 'metrics.jsonl'))
  assert math.isnan(records[1]['grad_norm'])
  assert records[2]['split'] == 'eval' and records[2]['ppl'] == math.inf
  events = glob.glob(os.path.join(out, 'tb', 'events.out.tfevents.*'))
  assert events and os.path.getsize(events[0]) > 0


def test_appends_across_loggers(tmp_path):
  for step in (1, 2):
    logger = metrics.MetricsLogger(str(tmp_path), tensorboard=False)
    logger.log(step, {'loss': 1.0})
    logger.close()
  assert [r['step'] for r in metrics.read_jsonl(
      str(tmp_path / 'metrics.jsonl'))] == [1, 2]
  assert not (tmp_path / 'tb').exists()


def test_read_jsonl_skips_half_written_last_line(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "split": "train", "loss": 2.0}\n{"step": 2, "sp')
  assert metrics.read_jsonl(str(path)) == [
      {'step': 1, 'split': 'train', 'loss': 2.0}]


def test_disabled_writes_nothing(tmp_path):
  out = tmp_path / 'rank1'
  logger = metrics.MetricsLogger(str(out), enabled=False)
  logger.log(1, {'loss': 1.0})
  logger.close()
  assert not out.exists()


def test_plot_loss(tmp_path):
  with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as logger:
    for step in range(0, 50, 5):
      logger.log(step, {'loss': 5.0 / (step + 1)})
      if step % 20 == 0:
        logger.log(step, {'loss': 6.0 / (step + 1)}, prefix='eval')
  png = tmp_path / 'plots' / 'loss.png'
  metrics.plot_loss(str(tmp_path / 'metrics.jsonl'), str(png), log_y=True)
  data = png.read_bytes()
  assert data.startswith(b'\x89PNG') and len(data) > 1000


def test_progress_silent_without_tty(monkeypatch, capsys):
  fake = io.StringIO()  # StringIO.isatty() is False.
  monkeypatch.setattr('sys.stdout', fake)
  bar = metrics.Progress(total=10, initial=2)
  bar.update(1, loss=jnp.float32(2.5), note='x')
  bar.update()
  bar.close()
  assert fake.getvalue() == ''
  captured = capsys.readouterr()
  assert captured.out == '' and captured.err == ''
