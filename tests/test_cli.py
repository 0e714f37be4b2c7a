"""train.py as a user runs it: clear errors, no traceback, no lost data."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scape_jax import train as trainer
from scape_jax.train import checkpoint
from scape_jax.train import cli
from scape_jax.train import config as config_lib
from scape_jax.data.prepare import make_synthetic_corpus
from tests import fast_compile
from tests import script_runner
from tests.tiny_runs import tiny_tokenizer_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                         *args], capture_output=True, text=True, env=env,
                        timeout=timeout, cwd=ROOT, check=False)


BAD_CONFIGS = [
    (['--config.optimizer.lrr=1'], "unknown config key 'optimizer.lrr'"),
    (['--config.steps=abc'], "'steps': expected int, got 'abc'"),
    (['--config.optimizer.scape.density=1.5'], 'density'),
    (['--config', 'configs/nope.py'], 'configs/nope.py'),
]


def test_bad_config_is_a_clear_error():
  """`python train.py` with each of BAD_CONFIGS (one subprocess runs them
  all, `script_runner`)."""
  results = script_runner.run_in_one_process(
      [(os.path.join(ROOT, 'train.py'), args, ROOT)
       for args, _ in BAD_CONFIGS],
      dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  for (args, message), (code, stderr) in zip(BAD_CONFIGS, results):
    assert code == 2, (args, stderr)
    assert message in stderr, (args, stderr)
    assert 'Traceback' not in stderr, (args, stderr)


@pytest.mark.parametrize('args, message', [
    (['--num-processes', '4', '--process-id', '1'], 'need --coordinator'),
    (['--coordinator', 'h:1', '--num-processes', '2', '--process-id', '2'],
     '--process-id 2: must be in 0 .. 1'),
    (['--coordinator', 'h:1', '--num-processes', '0', '--process-id', '0'],
     '--num-processes 0: must be >= 1'),
    (['--coordinator', 'h:1', '--num-processes', '2', '--process-id', '-1'],
     '--process-id -1'),
    (['--coordinator', 'h:1'], 'needs --num-processes and --process-id'),
    (['--coordinator', 'host', '--num-processes', '2', '--process-id', '0'],
     'expected HOST:PORT'),
    (['--join-timeout', '60'], '--join-timeout needs --coordinator'),
    (['--coordinator', 'h:1', '--num-processes', '2', '--process-id', '0',
      '--join-timeout', '0'], "'0': expected a whole number of seconds >= 1"),
    (['--distributed', '--join-timeout', '1.5'], "'1.5': expected a whole"),
])
def test_bad_process_options_are_usage_errors(args, message, capsys,
                                              monkeypatch):
  for var in ('JAX_COORDINATOR_ADDRESS', 'SLURM_NTASKS',
              'OMPI_COMM_WORLD_SIZE'):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(SystemExit) as e:
    cli.parse_args(args)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_good_process_options_parse():
  args, _ = cli.parse_args(['--coordinator', 'h:1', '--num-processes', '2',
                            '--process-id', '1', '--config.steps=3'])
  assert (args.num_processes, args.process_id) == (2, 1)
  assert args.join_timeout is None  # jax's default, cli.JOIN_TIMEOUT_S
  args, _ = cli.parse_args(['--distributed', '--join-timeout', '900'])
  assert args.join_timeout == 900


def test_distributed_outside_a_cluster_and_unwritable_out_dir_are_errors(
    tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_COORDINATOR_ADDRESS', 'SLURM_NTASKS',
                      'OMPI_COMM_WORLD_SIZE')}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'), '--dry-run',
       '--distributed', '--config.mesh.data=1'],
      capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
      env=dict(env, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2, proc.stderr
  assert 'jax.distributed.initialize' in proc.stderr
  assert 'Traceback' not in proc.stderr
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  proc = _run('--config.mesh.data=1', '--config.data.corpus=synthetic',
              '--config.steps=2', f'--config.out_dir={blocker}/run')
  assert proc.returncode == 2, proc.stderr
  assert f"out_dir='{blocker}/run': cannot create it" in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_corrupt_checkpoint_is_reported_and_left_alone(tmp_path):
  corpus = tmp_path / 'corpus'
  make_synthetic_corpus(str(corpus), num_tokens=1 << 15)
  args = [f'--config.data.corpus={corpus}', f'--config.out_dir={tmp_path}/run',
          '--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=8', '--config.eval_batches=1',
          '--config.eval_every=0']
  trainer.train(config_lib.load(None, args + ['--config.steps=2']))
  ckpt = tmp_path / 'run' / 'ckpt'
  files = sorted(p for p in ckpt.rglob('*') if p.is_file())
  biggest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  data[len(data) // 2] ^= 0xFF
  biggest.write_bytes(bytes(data))
  before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files}

  proc = _run(*args, '--config.steps=4')
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert 'corrupt' in proc.stderr and 'Traceback' not in proc.stderr
  after = sorted(p for p in ckpt.rglob('*') if p.is_file())
  assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in after} == before


def _train_steps(out_dir) -> list:
  path = os.path.join(out_dir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().split('\n')[:-1]  # complete lines only
  return [r['step'] for r in map(json.loads, lines) if r['split'] == 'train']


def _signalled_run(args, out_dir, signum, after_step, timeout=300):
  """Runs train.py, sends `signum` once `after_step` is logged; (rc, output)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             PYTHONUNBUFFERED='1', XLA_FLAGS=(
                 '--xla_force_host_platform_device_count=8 '
                 f'{fast_compile.FLAGS}'))
  log = os.path.join(out_dir, f'log-{signum}.txt')
  os.makedirs(out_dir, exist_ok=True)
  with open(log, 'wb') as f:
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'),
                             *args], env=env, cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
      while (proc.poll() is None and time.monotonic() < deadline and
             not [s for s in _train_steps(out_dir) if s >= after_step]):
        time.sleep(0.1)
      if proc.poll() is None:
        proc.send_signal(signum)
      proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  with open(log, errors='replace') as f:
    return proc.returncode, f.read()


def test_signals_stop_after_a_step_with_a_checkpoint(tmp_path):
  """SIGINT, then SIGTERM on the resumed run, then the run completes.

  `ckpt_every=0` (only at the end) as in the demo: without the handler each
  signal would lose every step.
  """
  corpus = tmp_path / 'corpus'
  make_synthetic_corpus(str(corpus), num_tokens=1 << 15)
  out = tmp_path / 'run'
  args = [f'--config.data.corpus={corpus}', f'--config.out_dir={out}',
          '--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=8', '--config.eval_batches=1',
          '--config.eval_every=0', '--config.ckpt_every=0',
          '--config.log_every=1', '--config.optimizer.decay=constant',
          '--config.steps=100000']
  ckpt = checkpoint.Checkpointer(str(out / 'ckpt'))

  rc, log = _signalled_run(args, out, signal.SIGINT, after_step=2)
  assert rc == 130, log
  assert 'Traceback' not in log
  first = ckpt.all_steps()
  assert len(first) == 1 and first[0] >= 2, log
  assert f'SIGINT received: stopped after step {first[0]}' in log
  assert _train_steps(out) == list(range(1, first[0] + 1))

  rc, log = _signalled_run(args, out, signal.SIGTERM,
                           after_step=first[0] + 2)
  assert rc == 143, log
  assert f'resumed from {out}/ckpt step {first[0]}' in log
  second = ckpt.all_steps()[-1]
  assert second >= first[0] + 2
  assert f'SIGTERM received: stopped after step {second}' in log
  assert _train_steps(out) == list(range(1, second + 1))  # each step once


def test_a_corpus_of_another_tokenizer_is_refused(tmp_path):
  # The corpus was prepared with a tokenizer.json; data.tokenizer is left at
  # 'byte': the model would learn one tokenizer's ids and ship the other.
  from scape_jax.data import prepare  # pylint: disable=g-import-not-at-top
  tok_path = tiny_tokenizer_json(tmp_path / 'tokenizer.json')
  texts = tmp_path / 'texts'
  texts.mkdir()
  for i in range(3):
    (texts / f'{i}.txt').write_text('to be or not to be ' * 400)
  prepare.prepare(str(texts), str(tok_path), str(tmp_path / 'corpus'))
  common = [f'--config.data.corpus={tmp_path / "corpus"}',
            '--config.mesh.data=1', '--config.data.batch_size=2',
            '--config.data.seq_len=16', '--config.steps=1',
            '--config.eval_batches=1', f'--config.out_dir={tmp_path / "run"}']
  proc = _run(*common)
  assert proc.returncode == 2, proc.stderr
  assert f"was tokenized with '{tok_path}'" in proc.stderr, proc.stderr
  assert "data.tokenizer is 'byte'" in proc.stderr
  proc = _run(*common, f'--config.data.tokenizer={tok_path}')
  assert proc.returncode == 0, proc.stderr
  from scape_jax.train.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  _, extras = Checkpointer(str(tmp_path / 'run' / 'ckpt')).read_extras(None)
  assert extras['tokenizer'] == {  # what export_hf checks its file against
      'spec': str(tok_path), 'sha256': prepare.sha256_file(str(tok_path))}


def _texts(root, text):
  root.mkdir()
  for i in range(3):
    (root / f'{i}.txt').write_text(text * 200)
  return str(root)


def test_two_corpora_of_one_name_do_not_share_the_default_dir(
    tmp_path, monkeypatch):
  """/a/books and /b/books both default to <cache>/data/books-byte: the
  second run must not replace the first run's corpus under it. The default
  is under the cache dir ($SCAPE_JAX_CACHE), not the current directory."""
  from scape_jax.data import prepare  # pylint: disable=g-import-not-at-top
  from scape_jax.train import trainer as trainer_mod  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('SCAPE_JAX_CACHE', str(tmp_path / 'cache'))
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  first = _texts(tmp_path / 'a' / 'books', 'to be or not to be ')
  second = _texts(tmp_path / 'b' / 'books', 'all the world is a stage ')
  cfg = config_lib.load(None, [f'--config.data.corpus={first}'])
  data_dir = trainer_mod._prepare_data(cfg)
  assert data_dir == str(tmp_path / 'cache' / 'data' / 'books-byte')
  assert not (tmp_path / 'data').exists()
  meta = prepare.load_meta(data_dir)
  cfg = config_lib.load(None, [f'--config.data.corpus={second}'])
  with pytest.raises(prepare.CorpusError, match=(
      r"'.*/cache/data/books-byte', the default data dir for "
      r"data.corpus=.*b/books', "
      rf'holds the corpus prepared from {first}: set data.data_dir')):
    trainer_mod._prepare_data(cfg)
  assert prepare.load_meta(data_dir) == meta  # untouched
  cfg = config_lib.load(None, [f'--config.data.corpus={second}',
                               f'--config.data.data_dir={tmp_path / "own"}'])
  assert trainer_mod._prepare_data(cfg) == str(tmp_path / 'own')
  # The same corpus again, changed: rebuilt in place, as before.
  with open(os.path.join(first, '0.txt'), 'a') as f:
    f.write('more')
  cfg = config_lib.load(None, [f'--config.data.corpus={first}'])
  assert trainer_mod._prepare_data(cfg) == data_dir
  assert prepare.load_meta(data_dir)['source_sha256'] != meta['source_sha256']


def test_a_data_dir_beside_a_prepared_corpus_is_refused(tmp_path):
  """data.corpus already prepared is read in place: a data.data_dir set
  beside it would be silently unused."""
  from scape_jax.data import prepare  # pylint: disable=g-import-not-at-top
  from scape_jax.train import trainer as trainer_mod  # pylint: disable=g-import-not-at-top
  corpus = str(tmp_path / 'corpus')
  prepare.prepare(_texts(tmp_path / 'texts', 'to be '), 'byte', corpus)
  cfg = config_lib.load(None, [f'--config.data.corpus={corpus}',
                               f'--config.data.data_dir={tmp_path / "x"}'])
  with pytest.raises(prepare.CorpusError, match=(
      rf"data.data_dir='{tmp_path / 'x'}' is not used: data.corpus="
      rf"'{corpus}' is a prepared corpus, read where it is")):
    trainer_mod._prepare_data(cfg)
  assert not os.path.exists(tmp_path / 'x')
  cfg = config_lib.load(None, [f'--config.data.corpus={corpus}',
                               f'--config.data.data_dir={corpus}'])
  assert trainer_mod._prepare_data(cfg) == corpus
