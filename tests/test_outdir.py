"""Runs that can't be trampled (issue 62): out_dir's lock, its shape, a full
disk, a lost peer, and the small things (a signal in setup, the order of
skipped-step lines, a short mesh-change error).

Most tests run `train.py` as a user would (system tier); each run is a tiny
AdamW model on 2 simulated CPU devices.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import train as train_cli
from scape_jax import train as trainer
from scape_jax.train import checkpoint
from scape_jax.train import config as config_lib
from scape_jax.train import outdir
from scape_jax.train import peers
from scape_jax.train import resume
from scape_jax.train import trainer as trainer_lib
from tests import fast_compile
from tests import test_multiprocess as multiprocess
from tests.test_resilience import _args

TRAIN = multiprocess.TRAIN
LOST_PEER_BOUND_S = 20  # the README's "within about 10 s", with slack


def _env() -> dict:
  """This process's environment (its compilation cache included) for a
  train.py on 2 CPU devices."""
  return dict(os.environ, PYTHONPATH=str(multiprocess.REPO),
              PYTHONUNBUFFERED='1', JAX_PLATFORMS='cpu',
              XLA_FLAGS=('--xla_force_host_platform_device_count=2 '
                         f'{fast_compile.FLAGS}'))


def _command(corpus, out_dir, *overrides) -> list:
  return [sys.executable, str(TRAIN), *_args(corpus, out_dir, *overrides)]


def _start(command, log: pathlib.Path) -> subprocess.Popen:
  with open(log, 'wb') as f:
    return subprocess.Popen(command, env=_env(), stdout=f,
                            stderr=subprocess.STDOUT)


def _train_steps(out_dir) -> list:
  """The train steps in metrics.jsonl (complete lines only)."""
  path = pathlib.Path(out_dir) / 'metrics.jsonl'
  if not path.is_file():
    return []
  lines = path.read_text().split('\n')[:-1]
  return [r['step'] for r in map(json.loads, lines) if r['split'] == 'train']


def _wait(condition, proc, log, timeout_s: float = 240) -> None:
  """Waits until `condition()` holds while `proc` runs."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert proc.poll() is None, pathlib.Path(log).read_text()
    assert time.monotonic() < deadline, pathlib.Path(log).read_text()
    time.sleep(0.1)


def _stop(proc) -> None:
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def _holder(out_dir) -> dict:
  return json.loads((pathlib.Path(out_dir) / outdir.LOCK_NAME).read_text())


# ----------------------------------------------------------------------------
# The lock.


def test_a_second_lock_on_one_out_dir_names_the_holder(tmp_path):
  with outdir.RunLock(str(tmp_path)) as lock:
    lock.acquire()
    with pytest.raises(outdir.RunLockedError, match=(
        f'in use by another trainer: PID {os.getpid()} on host '
        f'{socket.gethostname()}')):
      outdir.RunLock(str(tmp_path)).acquire()
  with outdir.RunLock(str(tmp_path)) as again:  # released on exit
    again.acquire()


def test_a_second_trainer_exits_2_and_the_first_keeps_every_step(corpus,
                                                                 tmp_path):
  out = tmp_path / 'run'
  command = _command(corpus, out, '--config.steps=100000',
                     '--config.ckpt_every=5')
  first = _start(command, tmp_path / 'first.log')
  try:
    _wait(lambda: len(_train_steps(out)) >= 3, first, tmp_path / 'first.log')
    second = subprocess.run(command, env=_env(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert second.returncode == 2, second.stderr
    assert (f'is in use by another trainer: PID {first.pid} on host '
            f'{socket.gethostname()}') in second.stderr, second.stderr
    assert 'Traceback' not in second.stderr
    n = len(_train_steps(out))
    _wait(lambda: len(_train_steps(out)) >= n + 2, first,
          tmp_path / 'first.log')
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM
  finally:
    _stop(first)
  saved = outdir.finished_steps(str(out / 'ckpt'))[-1]
  assert _train_steps(out) == list(range(1, saved + 1))  # each step once


def test_kill_9_of_the_lock_holder_then_a_restart_resumes(corpus, tmp_path):
  out = tmp_path / 'run'
  command = _command(corpus, out, '--config.steps=100000',
                     '--config.ckpt_every=2')
  first = _start(command, tmp_path / 'first.log')
  try:
    _wait(lambda: outdir.finished_steps(str(out / 'ckpt')), first,
          tmp_path / 'first.log')
    first.kill()  # SIGKILL: no handler runs, the kernel drops the flock
    first.wait()
  finally:
    _stop(first)
  assert _holder(out)['pid'] == first.pid  # the file stays; the lock not
  saved = outdir.finished_steps(str(out / 'ckpt'))[-1]
  log = tmp_path / 'second.log'
  second = _start(command, log)
  try:
    _wait(lambda: f'resumed from {out}/ckpt step {saved}' in log.read_text(),
          second, log)
    assert _holder(out)['pid'] == second.pid
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()
  finally:
    _stop(second)


# ----------------------------------------------------------------------------
# out_dir's shape, checked before anything is compiled.


@pytest.mark.parametrize('name, make, message', [
    ('metrics.jsonl', os.mkdir, 'is a directory, not a file'),
    ('ckpt', lambda p: pathlib.Path(p).write_text(''),
     'is a file, not a directory'),
])
def test_outputs_of_the_wrong_kind_exit_2_before_compiling(
    corpus, tmp_path, capsys, monkeypatch, name, make, message):
  make(str(tmp_path / name))

  def no_compiling(*args, **kwargs):
    raise AssertionError('compiled despite a bad out_dir')
  monkeypatch.setattr(trainer_lib, 'build_program', no_compiling)
  code = train_cli.main(_args(corpus, tmp_path, '--config.steps=2'))
  err = capsys.readouterr().err
  assert code == 2, err
  assert f'{tmp_path / name} {message}' in err, err
  assert 'Traceback' not in err


# ----------------------------------------------------------------------------
# A full disk.


@pytest.fixture
def small_disk(tmp_path):
  """A 6 MiB tmpfs (mounting needs root on Linux)."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  mount = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=6m', 'tmpfs',
                          str(disk)], capture_output=True, text=True,
                         check=False) if sys.platform == 'linux' else None
  if mount is None or mount.returncode:
    pytest.skip('mounting a tmpfs is not permitted here: '
                f'{mount.stderr.strip() if mount else sys.platform}')
  try:
    yield disk
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(corpus,
                                                               small_disk):
  out = small_disk / 'run'
  proc = subprocess.run(_command(corpus, out, '--config.steps=60',
                                 '--config.ckpt_every=2'),
                        env=_env(), capture_output=True, text=True,
                        timeout=300, check=False)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert len(lines) <= 5, proc.stderr
  assert 'No space left on device' in proc.stderr
  last = outdir.finished_steps(str(out / 'ckpt'))[-1]
  failed_at = _train_steps(out)[-1]
  assert (f'the last good checkpoint is {out}/ckpt/{last}, so the '
          f'{failed_at - last} steps since it are lost') in proc.stderr
  ckpt = checkpoint.Checkpointer(str(out / 'ckpt'))
  assert ckpt.read_extras(last)[0] == last  # manifest and extras verify


# ----------------------------------------------------------------------------
# A lost peer in a 2-process run.


def test_a_killed_peer_is_named_by_the_survivor_with_exit_4(corpus,
                                                            tmp_path):
  coordinator = f'127.0.0.1:{multiprocess._free_port()}'  # pylint: disable=protected-access
  out = tmp_path / 'run'
  logs = [tmp_path / f'p{i}.log' for i in range(2)]
  procs = []
  try:
    for i, log in enumerate(logs):
      with open(log, 'wb') as f:
        procs.append(subprocess.Popen(
            [sys.executable, str(TRAIN),
             *multiprocess._joined(i, coordinator),  # pylint: disable=protected-access
             *multiprocess._config_args(corpus, out, 'adamw'),  # pylint: disable=protected-access
             '--config.steps=100000'],
            env=multiprocess._env(1), cwd=tmp_path, stdout=f,  # pylint: disable=protected-access
            stderr=subprocess.STDOUT))
    _wait(lambda: len(_train_steps(out)) >= 2, procs[0], logs[0])
    procs[1].kill()
    killed = time.monotonic()
    code = procs[0].wait(timeout=120)
    took = time.monotonic() - killed
  finally:
    for proc in procs:
      _stop(proc)
  text = logs[0].read_text()
  assert code == 4, text
  assert 'error: process 1 of 2 is lost' in text, text
  assert 'Traceback' not in text, text
  assert took < LOST_PEER_BOUND_S, (took, text)


# ----------------------------------------------------------------------------
# The small things.


def test_sigterm_during_setup_is_one_line_and_exit_143(corpus, tmp_path):
  # Signalled once out_dir is locked: building and compiling follow.
  out = tmp_path / 'run'
  log = tmp_path / 'run.log'
  proc = _start(_command(corpus, out, '--config.steps=100000'), log)
  try:
    _wait(lambda: (out / outdir.LOCK_NAME).exists(), proc, log)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
  finally:
    _stop(proc)
  text = log.read_text()
  assert code == 128 + signal.SIGTERM, text
  assert 'Traceback' not in text, text
  lines = [line for line in text.splitlines() if 'SIGTERM' in line]
  # "stopped at once" in setup; "stopped after step N" had it compiled and
  # trained a step already (the loop's own stop): one line either way.
  assert len(lines) == 1, text
  assert lines[0].startswith('stopped: SIGTERM received: stopped '), text


def test_skipped_step_lines_come_in_step_order(corpus, tmp_path, capsys):
  cfg = config_lib.load(None, _args(corpus, tmp_path, '--config.steps=30',
                                    '--config.optimizer.lr=1e30',
                                    '--config.max_bad_steps=3'))
  with pytest.raises(trainer.DivergedError):
    trainer.train(cfg)
  lines = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith('step ')]
  steps = [int(line.split('|')[0].split()[1].rstrip(':')) for line in lines]
  assert sum('update skipped' in line for line in lines) >= 3, lines
  assert steps == sorted(steps), lines


class _Mesh:
  shape = {'data': 4}


def test_a_mesh_change_error_is_at_most_5_lines():
  detail = 'checkpoint /c/2 does not match abstract_state:' + ''.join(
      f'\n  opt.leaf{i}: checkpoint has float32(8,), abstract_state wants '
      'float32(4,)' for i in range(8)) + '\n  ... and 12 more'

  class Ckpt:
    directory = '/c'

    def restore(self, step, target):
      raise checkpoint.CheckpointError(detail)

  class Program:
    mesh = _Mesh()
    cfg = config_lib.load(None, [])

  with pytest.raises(checkpoint.CheckpointError) as e:
    resume._restore(Program(), Ckpt(), 2, None, {'data': 8})  # pylint: disable=protected-access
  message = str(e.value)
  assert len(message.splitlines()) <= 5, message
  assert "mesh of {'data': 8}" in message and 'opt.leaf0' in message


class _KeyValues:
  """The part of JAX's coordination client that `PeerWatch` uses."""

  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.store
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def test_peer_watch_names_a_silent_peer_and_a_peer_that_failed():
  client = _KeyValues()
  watches = [peers.PeerWatch(i, 3, heartbeat_timeout=0.3, client=client,
                             grace_s=0.3) for i in range(3)]
  for _ in range(2):  # all beat: nobody is lost
    assert [w.check() for w in watches] == [None] * 3
  watches[1]._announce(0)  # pylint: disable=protected-access
  assert watches[0].check() is None  # has heard the others' last beats
  time.sleep(0.4)  # 1 has ended on purpose, 2 falls silent
  assert watches[0].check() == (
      'process 2 of 3 is lost: no heartbeat for 0 s (killed, crashed, or '
      'its host is down or out of reach)')
  watches[2]._announce(2)  # pylint: disable=protected-access
  assert watches[0].check() is None  # its own error: 0 may share it
  time.sleep(0.4)
  assert watches[0].check() == ('process 2 of 3 stopped with exit code 2 '
                                '(its log says why)')


def test_process_0_ends_a_margin_after_the_others_announce(monkeypatch):
  """Process 0, whose exit ends the coordination service (and aborts any
  process still running), waits for the others' announcements and then
  `EXIT_MARGIN_S` for them to end."""
  monkeypatch.setattr(peers, 'EXIT_MARGIN_S', 0.5)
  client = _KeyValues()
  first, second = (peers.PeerWatch(i, 2, client=client) for i in range(2))
  for watch in (second, first, second, first):  # 0 hears 1 beat
    assert watch.check() is None
  announce = threading.Timer(0.5, second._announce, (143,))  # pylint: disable=protected-access
  start = time.monotonic()
  announce.start()
  first._leave(143)  # pylint: disable=protected-access
  waited = time.monotonic() - start
  announce.join()
  assert dict(client.key_value_dir_get('scape_jax/exit/')) == {
      'scape_jax/exit/0': '143', 'scape_jax/exit/1': '143'}
  assert 1.0 <= waited < 3.0, waited  # 0.5 s to the announcement, 0.5 more
