"""DeMo against an independent NumPy simulation of its N workers."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax import analysis
from scape_jax import train as trainer
from scape_jax.optim import _demo
from tests import reference_methods as ref_lib
from tests.mesh_runner import MeshRunner, random_params, worker_grads
from tests.tiny_runs import run_config

# Matrices, vectors, a scalar, rank 3, prime sides and leaves smaller than a
# chunk (bloc97/DeMo issue 2: every shape must work).
SHAPES = {'w': (12, 10), 'v': (6,), 'one': (1,), 's': (), 'x': (2, 3, 5),
          'p': (7, 11), 'col': (9, 1), 'empty': (0, 3)}


def _demo_state(state):
  return state[0]


def test_dct_matrix_is_the_orthonormal_dct_ii():
  for n in (1, 2, 5, 8, 64):
    d = _demo.dct_matrix(n)
    np.testing.assert_allclose(d, ref_lib.dct_matrix(n), atol=1e-6)
    np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-5)
  scipy_fft = pytest.importorskip('scipy.fft')
  x = np.random.default_rng(0).normal(size=16)
  np.testing.assert_allclose(_demo.dct_matrix(16) @ x,
                             scipy_fft.dct(x, norm='ortho'), atol=1e-5)


@pytest.mark.parametrize('shape, chunk, blocks', [
    ((128, 96), 64, (64, 48)), ((12, 10), 4, (4, 2)), ((6,), 4, (1, 3)),
    ((), 64, (1, 1)), ((2, 3, 5), 4, (3, 1)), ((7, 11), 64, (7, 11)),
    ((0, 5), 4, (1, 1)),
])
def test_chunks_tile_every_shape_and_the_dct_round_trips(shape, chunk, blocks):
  layout = _demo.DctLayout.create(shape, chunk, topk=3)
  assert (layout.chunk_rows, layout.chunk_cols) == blocks
  x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  coef = _demo.dct_chunks(jnp.asarray(x), layout)
  assert coef.shape == (layout.num_chunks, layout.chunk_size)
  np.testing.assert_allclose(np.asarray(_demo.idct_chunks(coef, layout)), x,
                             atol=1e-5)
  # Orthonormal: the energy of every chunk is kept.
  np.testing.assert_allclose(np.sum(np.asarray(coef)**2), np.sum(x**2),
                             rtol=1e-5)


def test_duplicates_are_averaged_not_summed():
  idx = np.array([[[0, 1], [2, 3], [0, 1], [3, 2]],   # worker 0
                  [[1, 0], [2, 1], [3, 2], [3, 0]]])  # worker 1
  val = np.arange(16, dtype=np.float32).reshape(2, 4, 2) + 1
  got = np.asarray(_demo.scatter_mean(jnp.asarray(idx), jnp.asarray(val),
                                      chunk_size=4))
  want = np.zeros((4, 4))
  for c in range(4):
    for i in range(4):
      sent = [val[w, c, s] for w in range(2) for s in range(2)
              if idx[w, c, s] == i]
      want[c, i] = np.mean(sent) if sent else 0.0
  np.testing.assert_allclose(got, want)
  assert got[0, 0] == (1 + 10) / 2 and got[1, 2] == (3 + 11) / 2
  assert got[1, 1] == 12 and got[3, 1] == 0


@pytest.mark.parametrize('n', [1, 4])
def test_matches_numpy_simulation(n):
  params = random_params(SHAPES)
  names = sorted(params)  # jax flattens dicts in sorted key order
  beta, chunk, topk, steps = 0.9, 4, 3, 4
  lr_fn = optax.linear_schedule(1e-2, 1e-3, steps)
  tx = scape_jax.demo(lr_fn, beta=beta, chunk=chunk, topk=topk)
  run = MeshRunner(tx, params, n)
  ref = ref_lib.DemoReference([params[k] for k in names], n, beta=beta,
                              chunk=chunk, topk=topk,
                              lr_fn=lambda i: float(lr_fn(i)))
  for i, g in enumerate(worker_grads(params, n, steps, seed=2)):
    run.step(g)
    ref.step([[g[k][w] for k in names] for w in range(n)])
    st = _demo_state(run.state)
    for j, k in enumerate(names):
      msg = f'{k} step {i + 1}'
      np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                                 rtol=1e-6, atol=1e-6, err_msg=msg)
      for w in range(n):
        np.testing.assert_allclose(np.asarray(st.momentum[k])[w],
                                   ref.m[w][j], rtol=1e-4, atol=2e-5,
                                   err_msg=msg)
    np.testing.assert_allclose(  # the logged ||m|| over all leaves
        np.asarray(st.momentum_norm).reshape(-1),
        [np.sqrt(sum(np.sum(np.square(m, dtype=np.float64)) for m in ref.m[w]))
         for w in range(n)], rtol=1e-4)
  assert int(st.count) == steps
  if n > 1:  # the scatter saw both shared and single coefficients
    assert ref.duplicates > 0 and ref.singles > 0


def test_all_coefficients_send_the_whole_momentum():
  """topk = chunk**2: q is all of m, Q the mean over workers, m becomes 0."""
  params = random_params({'w': (8, 6), 'b': (5,)})
  grads = worker_grads(params, 4, 1)[0]
  tx = scape_jax.demo(1e-2, chunk=8, topk=64, weight_decay=0.0)
  run = MeshRunner(tx, params, 4)
  run.step(grads)
  st = _demo_state(run.state)
  for k in params:
    np.testing.assert_allclose(np.asarray(st.momentum[k]), 0, atol=1e-5)
    mean = grads[k].mean(0)
    step = np.asarray(run.params[k]) - params[k]
    np.testing.assert_allclose(step, -1e-2 * np.sign(mean), atol=1e-7)


def test_wire_is_one_byte_all_gather_with_small_indices():
  shapes = {'big': (128, 64), 'mid': (24, 8), 'vec': (40,)}
  params = random_params(shapes)
  n, chunk, topk = 8, 64, 32
  run = MeshRunner(scape_jax.demo(1e-3, chunk=chunk, topk=topk), params, n)
  layouts = {k: _demo.DctLayout.create(s, chunk, topk)
             for k, s in shapes.items()}
  assert layouts['big'].index_dtype == jnp.int16  # 4096 entries per chunk
  assert layouts['mid'].index_dtype == jnp.int16  # 192 > 128
  assert layouts['vec'].index_dtype == jnp.int8  # 40
  # Per worker: chunks * k * (4 B amplitude + index bytes).
  per_worker = (2 * 32 * 6) + (1 * 32 * 6) + (1 * 32 * 5)
  assert sum(l.wire_bytes for l in layouts.values()) == per_worker
  cols = analysis.collectives(run.compiled(), run.params, run.state,
                              run.abstract_grads(params))
  assert len(cols) == 1, analysis.format_table(cols)
  (gather,) = cols
  assert (gather.kind, gather.dtype) == ('all-gather', 'u8')
  assert gather.elements == n * per_worker
  assert analysis.bytes_sent(cols) == pytest.approx(
      analysis.ring_all_gather_bytes(n * per_worker, n))


def test_init_global_view_and_partition_specs():
  params = random_params({'w': (8, 6)})
  tx = scape_jax.demo(1e-2)
  with jax.set_mesh(MeshRunner(tx, params, 8).mesh):
    st = _demo_state(jax.eval_shape(tx.init, params))
  assert st.momentum['w'].shape == (8, 8, 6)
  specs = _demo_state(scape_jax.state_partition_specs((st,)))
  assert specs.momentum['w'] == jax.sharding.PartitionSpec('data')
  assert specs.count == jax.sharding.PartitionSpec()


@pytest.mark.parametrize('kwargs, match', [
    (dict(chunk=0), r'chunk=0 must be an integer >= 1'),
    (dict(chunk=8.5), r'chunk=8.5 must be an integer >= 1'),
    (dict(topk=0), r'topk=0 must be an integer in \[1, 4096\]'),
    (dict(chunk=4, topk=17), r'topk=17 must be an integer in \[1, 16\]'),
    (dict(beta=1.0), r'beta=1.0 must be in \[0, 1\)'),
])
def test_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    scape_jax.demo(1e-2, **kwargs)


def test_rejects_unbound_axis():
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    scape_jax.demo(1e-2).init({'w': jnp.zeros((4, 4))})


# ----------------------------------------------------------------------------
# Through the trainer.


def _cfg(corpus, out_dir, *overrides):
  return run_config(
      corpus, out_dir, '--config.eval_every=0', '--config.optimizer.name=demo',
      '--config.optimizer.demo.chunk=16', '--config.optimizer.demo.topk=8',
      *overrides, lr='1e-3')


def test_trainer_resumes_bit_exactly(corpus, tmp_path):
  """A run resumed from step 2 of another equals it from there on."""
  straight = trainer.train(_cfg(corpus, tmp_path / 'a', '--config.steps=4',
                                '--config.ckpt_every=1'))
  shutil.copytree(tmp_path / 'a' / 'ckpt', tmp_path / 'b' / 'ckpt')
  for step in ('3', '4'):
    shutil.rmtree(tmp_path / 'b' / 'ckpt' / step)
  resumed = trainer.train(_cfg(corpus, tmp_path / 'b', '--config.steps=4'))
  assert resumed['start_step'] == 2
  assert resumed['losses'] == straight['losses'][2:]  # bit for bit
  with open(tmp_path / 'a' / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if r['split'] == 'train']
  assert all(r['momentum_norm'] > 0 for r in rows)
