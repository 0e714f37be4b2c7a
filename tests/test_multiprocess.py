"""train.py as 2 CPU processes (gloo, jax.distributed) == 1 process, 2 devices.

Run A: one process with 2 simulated CPU devices. Run B: two processes with one
device each, joined through `--coordinator 127.0.0.1:PORT` (train.py switches
the CPU collectives to gloo and calls `jax.distributed.initialize`). Both use
a data-parallel mesh of 2 and the same prepared corpus, so every per-step
metric must agree: the data sharding across processes, the cross-process
gradient exchange (SCAPE's sparse collectives) and the optimizer are the same.

Each run compiles the train step (two programs for SCAPE: the dense first
step and the sparse steady state), which dominates the runtime. Both runs use
the same XLA flags that cut CPU compile time (`tests/fast_compile.py`),
so the comparison is still exact.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from scape_jax.data import prepare
from tests import fast_compile

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = REPO / 'train.py'
STEPS = 4
TIMEOUT_S = 400  # per test (runs A and B together); a hang guard, generous for a loaded machine
# Variables that would change the device count or start jax.distributed on
# their own (train.py also joins a cluster found in SLURM/Open MPI variables).
_CLUSTER_VARS = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')
_NOT_COMPARED = ('tokens_per_s', 'wall_time', 'step_ms', 'elapsed_s', 'eta_s',
                 'mfu', 'peak_memory_bytes')  # wall-clock


def _free_port() -> int:
  try:
    import portpicker  # pylint: disable=g-import-not-at-top
    return portpicker.pick_unused_port()
  except ImportError:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(('127.0.0.1', 0))
      return s.getsockname()[1]


def _env(device_count: int) -> dict:
  """The parent's environment without JAX/XLA/cluster settings, plus ours."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_', 'XLA_')) and k not in _CLUSTER_VARS}
  env.update(
      JAX_PLATFORMS='cpu',
      XLA_FLAGS=(f'--xla_force_host_platform_device_count={device_count} '
                 f'{fast_compile.FLAGS}'),
      PYTHONPATH=os.pathsep.join(
          [str(REPO)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else [])),
      PYTHONUNBUFFERED='1',
  )
  return env


# Extra overrides of a test case: 'scape-bf16' is SCAPE's half-width wire:
# its all-to-all and all-gathers cross the processes over gloo, and so do
# the all-reduces of its dense leaves and of the metrics (every collective
# kind of the methods here; `test_two_processes_match_one_process` checks
# the log's table).
_CASES = {'scape-bf16': ('scape', {'optimizer.scape.payload_dtype': 'bfloat16',
                                   'optimizer.scape.offset_bits': 'auto'})}


def _config_args(data_dir, out_dir, optimizer: str) -> list:
  optimizer, extra = _CASES.get(optimizer, (optimizer, {}))
  overrides = {
      'data.corpus': data_dir,  # a prepared directory (has meta.json)
      'data.batch_size': 4,
      'data.seq_len': 32,
      'model.preset': 'llama-tiny',
      'model.dtype': 'float32',
      'mesh.data': 2,
      'optimizer.name': optimizer,
      'optimizer.scape.density': 0.1,
      'optimizer.lr': 3e-3,
      'optimizer.warmup_steps': 1,  # real updates from step 2 on
      'steps': STEPS,
      'log_every': 1,
      'eval_every': 0,  # only the final evaluation
      'eval_batches': 1,
      'out_dir': out_dir,
      **extra,
  }
  return [f'--config.{k}={v}' for k, v in overrides.items()]


def _run(commands: list, envs: list, cwd, logs: list) -> None:
  """Runs `commands` at once, each in its environment; fails (with their
  output) unless all exit 0."""
  procs, files = [], []
  try:
    for cmd, env, log in zip(commands, envs, logs):
      f = open(log, 'wb')  # pylint: disable=consider-using-with
      files.append(f)
      procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f,
                                    stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    problem = None
    while problem is None and any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed:  # the others would wait for it until jax's own timeouts
        problem = f'process {failed[0]} exited {procs[failed[0]].returncode}'
      elif time.monotonic() > deadline:
        problem = f'timed out after {TIMEOUT_S} s'
      else:
        time.sleep(0.1)
    if problem is None and any(p.returncode for p in procs):
      problem = f'exit codes {[p.returncode for p in procs]}'
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass
    for f in files:
      f.close()
  if problem is not None:
    out = '\n'.join(
        f'--- process {i}: {" ".join(map(str, cmd))}\n'
        f'{pathlib.Path(log).read_text(errors="replace")[-6000:]}'
        for i, (cmd, log) in enumerate(zip(commands, logs)))
    pytest.fail(f'{problem} (rc {[p.returncode for p in procs]})\n{out}',
                pytrace=False)


def _metrics(out_dir) -> tuple[dict, dict]:
  """({step: train metrics}, {step: eval metrics}) from metrics.jsonl."""
  train, evals = {}, {}
  path = pathlib.Path(out_dir) / 'metrics.jsonl'
  assert path.exists(), f'{path} was not written'
  for line in path.read_text().splitlines():
    rec = json.loads(line)
    split = {'train': train, 'eval': evals}.get(rec.pop('split'))
    if split is not None:  # not the 'compile' record (a time)
      split[rec.pop('step')] = rec
  return train, evals


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A prepared synthetic corpus shared by all runs (so nothing races)."""
  path = tmp_path_factory.mktemp('multiprocess') / 'data'
  prepare.make_synthetic_corpus(str(path), num_tokens=1 << 18)
  return path


def test_two_processes_match_one_process(data_dir, tmp_path):
  optimizer = 'scape-bf16'
  # Run A: 1 process, 2 devices. Run B: 2 processes, 1 device each, one
  # shared out_dir (orbax writes the checkpoint from both; only process 0
  # writes metrics). A and B run side by side (compiling dominates both).
  out_a, out_b = tmp_path / 'a', tmp_path / 'b'
  coordinator = f'127.0.0.1:{_free_port()}'
  run_a = [sys.executable, str(TRAIN), *_config_args(data_dir, out_a,
                                                     optimizer)]
  run_b = [[sys.executable, str(TRAIN), '--coordinator', coordinator,
            '--num-processes', '2', '--process-id', str(i),
            *_config_args(data_dir, out_b, optimizer)] for i in range(2)]
  _run([run_a, *run_b], [_env(2), _env(1), _env(1)], tmp_path,
       [tmp_path / 'a.log', tmp_path / 'b0.log', tmp_path / 'b1.log'])

  train_a, eval_a = _metrics(out_a)
  train_b, eval_b = _metrics(out_b)
  log_b = (tmp_path / 'b0.log').read_text()
  assert sorted(train_a) == list(range(1, STEPS + 1)), train_a
  assert sorted(train_b) == sorted(train_a), (train_b, log_b)
  losses_a = [train_a[s]['loss'] for s in sorted(train_a)]
  losses_b = [train_b[s]['loss'] for s in sorted(train_a)]
  np.testing.assert_allclose(losses_b, losses_a, rtol=1e-6, atol=0,
                             err_msg=f'per-step train loss, B vs A\n{log_b}')
  assert losses_a[-1] != losses_a[0]  # the optimizer did update the model
  for step in sorted(train_a):  # grad norm, lr, SCAPE's density/bytes, ...
    a, b = train_a[step], train_b[step]
    assert sorted(b) == sorted(a), (step, a, b)
    for key in sorted(set(a) - set(_NOT_COMPARED)):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=0,
                                 err_msg=f'{key} at step {step}, B vs A')
  assert sorted(eval_b) == sorted(eval_a) == [STEPS], (eval_a, eval_b)
  np.testing.assert_allclose(eval_b[STEPS]['loss'], eval_a[STEPS]['loss'],
                             rtol=1e-6, atol=0, err_msg='eval loss, B vs A')
  # The final checkpoint was written jointly by both processes of run B.
  assert (out_b / 'ckpt' / str(STEPS)).is_dir(), sorted(out_b.rglob('*'))
  assert not (tmp_path / 'b1.log').read_text().count('Traceback')
  # Every kind of collective crossed the processes (the first program's
  # table in the log; the later, sparse ones have the same kinds).
  kinds = {line.split()[0] for line in log_b.splitlines()
           if line.startswith(('all-reduce ', 'all-gather ', 'all-to-all '))}
  assert kinds == {'all-reduce', 'all-gather', 'all-to-all'}, log_b


# ----------------------------------------------------------------------------
# Faults on one process: every process must stop with the same verdict,
# not wait forever for the other in a collective.


def _start(commands: list, env: dict, cwd, timeout_s: float = 240) -> list:
  """Runs `commands` at once (in `cwd`, or each in its own of a list of
  them); [(exit code, output)], None for one still running at the limit
  (killed: the hang this section guards against)."""
  cwds = cwd if isinstance(cwd, list) else [cwd] * len(commands)
  procs = [subprocess.Popen(c, env=env, cwd=d, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for c, d in zip(commands, cwds)]
  deadline = time.monotonic() + timeout_s
  results = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
      p.kill()
      results.append((None, p.communicate()[0]))
  return results


def _joined(i: int, coordinator: str) -> list:
  return ['--coordinator', coordinator, '--num-processes', '2',
          '--process-id', str(i)]


@pytest.mark.parametrize('fault', ['config', 'data'])
def test_a_fault_on_one_process_stops_both_with_exit_2(fault, data_dir,
                                                       tmp_path):
  # 'config': process 1 was given other steps. 'data': the corpus is prepared
  # by process 0 into a per-host data_dir that process 1's host lacks.
  coordinator = f'127.0.0.1:{_free_port()}'
  commands = []
  for i in range(2):
    args = _config_args(data_dir, tmp_path / 'run', 'adamw')
    if fault == 'config':
      args.append(f'--config.steps={STEPS + 2 * i}')
    else:
      args += ['--config.data.corpus=synthetic',
               f'--config.data.data_dir={tmp_path / f"host{i}"}']
    commands.append([sys.executable, str(TRAIN), *_joined(i, coordinator),
                     *args])
  results = _start(commands, _env(1), tmp_path)
  assert [rc for rc, _ in results] == [2, 2], results
  for rc, out in results:
    assert 'Traceback' not in out, out
  if fault == 'config':
    assert all('these keys differ: steps.' in out for _, out in results)
  else:
    assert 'must be on a shared filesystem' in results[1][1], results[1][1]
    assert 'reading the data failed on process 1' in results[0][1]


def test_another_process_count_on_one_process_stops_both(data_dir,
                                                         tmp_path):
  # Process 1 is told 3 processes; process 0, whose count the job takes, 2.
  coordinator = f'127.0.0.1:{_free_port()}'
  commands = [[sys.executable, str(TRAIN), '--coordinator', coordinator,
               '--num-processes', str(2 + i), '--process-id', str(i),
               *_config_args(data_dir, tmp_path / 'run', 'adamw')]
              for i in range(2)]
  results = _start(commands, _env(1), tmp_path)
  assert [rc for rc, _ in results] == [2, 2], results
  assert '--num-processes 3 here, but process 0 started the job with 2' in (
      results[1][1]), results[1][1]
  assert 'joining failed on process 1' in results[0][1], results[0][1]
  assert not (tmp_path / 'run').exists()  # before any work


def test_join_timeout_bounds_the_wait_for_a_missing_process(data_dir,
                                                           tmp_path):
  # Only process 0 of 2 starts: it must give up after --join-timeout, not
  # jax's default 300 s (jax aborts the process; the joining line says why).
  start = time.monotonic()
  [(rc, out)] = _start([[sys.executable, str(TRAIN),
                         *_joined(0, f'127.0.0.1:{_free_port()}'),
                         '--join-timeout', '3',
                         *_config_args(data_dir, tmp_path / 'run', 'adamw')]],
                       _env(1), tmp_path, timeout_s=120)
  assert rc not in (None, 0), out
  assert 'waits up to 3 s for every process' in out, out
  assert time.monotonic() - start < 100


def test_an_out_dir_the_hosts_do_not_share_stops_both(data_dir, tmp_path):
  # The same relative out_dir from two working directories: two directories,
  # as the same path on two hosts' own disks would be.
  coordinator = f'127.0.0.1:{_free_port()}'
  homes = [tmp_path / f'host{i}' for i in range(2)]
  for home in homes:
    home.mkdir()
  commands = [[sys.executable, str(TRAIN), *_joined(i, coordinator),
               *_config_args(data_dir, 'run', 'adamw')] for i in range(2)]
  results = _start(commands, _env(1), homes)
  assert [rc for rc, _ in results] == [2, 2], results
  for _, out in results:
    assert 'Traceback' not in out, out
  assert "out_dir='run'" in results[1][1], results[1][1]
  assert 'must be on a filesystem every host shares' in results[1][1]
  assert 'checking that out_dir is shared failed on process 1' in (
      results[0][1]), results[0][1]
  assert not list((homes[0] / 'run').iterdir())  # no checkpoint, no marker


_RESTORE_SCRIPT = '''
import sys
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
coordinator, pid, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator, 2, pid)
from scape_jax.train import checkpoint
sharding = NamedSharding(Mesh(np.array(jax.devices()), ('d',)),
                         PartitionSpec('d'))
x = jax.make_array_from_callback(
    (8,), sharding, lambda i: np.arange(8, dtype=np.float32)[i])
ckpt = checkpoint.Checkpointer(directory)
ckpt.save(1, {'x': x})
ckpt.wait()
if pid == 1:  # this process's own shard of the state does not decode
  read = ocp.CheckpointManager.restore
  def damaged(self, step, args=None, **kw):
    restored = read(self, step, args=args, **kw)
    if 'state' in args:
      raise OSError('ZSTD_decompressStream() failed')
    return restored
  ocp.CheckpointManager.restore = damaged
try:
  ckpt.restore(1, {'x': jax.ShapeDtypeStruct((8,), np.float32,
                                             sharding=sharding)})
  print('restored')
except checkpoint.CorruptCheckpointError as e:
  print('corrupt:', e)
ckpt.close()
'''


def test_a_checkpoint_one_process_cannot_read_is_corrupt_on_both(tmp_path):
  coordinator = f'127.0.0.1:{_free_port()}'
  script = tmp_path / 'restore.py'
  script.write_text(_RESTORE_SCRIPT)
  results = _start([[sys.executable, str(script), coordinator, str(i),
                     str(tmp_path / 'ckpt')] for i in range(2)], _env(1),
                   tmp_path)
  assert [rc for rc, _ in results] == [0, 0], results
  assert 'corrupt: checkpoint' in results[1][1] and 'ZSTD' in results[1][1]
  assert 'corrupt: reading checkpoint' in results[0][1], results[0][1]
  assert 'failed on process 1' in results[0][1]


def test_sigterm_during_set_up_stops_both_processes(data_dir, tmp_path):
  # Before the train loop installs its handler, SIGTERM must stop the
  # process as it does with one process (JAX's preemption notifier, on by
  # default after jax.distributed.initialize, swallowed it).
  coordinator = f'127.0.0.1:{_free_port()}'
  logs = [tmp_path / f'p{i}.log' for i in range(2)]
  files = [open(log, 'wb') for log in logs]  # pylint: disable=consider-using-with
  procs = [subprocess.Popen(
      [sys.executable, str(TRAIN), *_joined(i, coordinator),
       *_config_args(data_dir, tmp_path / 'run', 'scape')],
      env=_env(1), cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
           for i, f in enumerate(files)]
  try:
    deadline = time.monotonic() + 120
    while not all(b'[Gloo]' in log.read_bytes() for log in logs):
      assert time.monotonic() < deadline, [log.read_text() for log in logs]
      assert all(p.poll() is None for p in procs), [log.read_text()
                                                    for log in logs]
      time.sleep(0.1)
    for p in procs:  # joined: the processes have exchanged data over gloo
      p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in files:
      f.close()
  assert all(c in (-signal.SIGTERM, 128 + signal.SIGTERM) for c in codes), (
      codes, [log.read_text() for log in logs])
