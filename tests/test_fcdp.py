"""FCDP on the fsdp layout, 8 simulated devices as 2 nodes x 4 (mesh.fsdp=8,
mesh.nodes=2): what the compiled step gathers, and that it trains exactly
like plain ZeRO-3.

* host cache: the backward pass has no all-gather of the cached weights (and
  with the hierarchy only intra-node ones); loss and gradients equal the
  uncached run;
* LoRA-aware: frozen weights never change, live in host memory already
  gathered, and no step gathers them over the network; only the adapters
  have optimizer state;
* checkpoint and resume are exact in fsdp and fcdp modes.
"""

import functools
import zlib

import jax
import numpy as np
import optax
import pytest

from scape_jax import analysis
from scape_jax import sharding
from scape_jax import train as trainer
from scape_jax.analysis import traffic
from scape_jax.comm.collectives import pmean_gradients
from scape_jax.train import config as config_lib
from scape_jax.train import step as step_lib
from scape_jax.train.checkpoint import Checkpointer

RANK = 8  # adapters [64, 8]: 512 elements, a size no frozen leaf has
LORA = ('--config.model.lora.targets=q_proj,v_proj',
        f'--config.model.lora.rank={RANK}')
ALL_FCDP = ('--config.fcdp.host_cache=true', '--config.fcdp.hierarchical=true',
            '--config.fcdp.lora_aware=true')


def _cfg(*overrides):
  base = ['--config.model.dtype=float32', '--config.data.seq_len=16',
          '--config.data.batch_size=16', '--config.optimizer.lr=1e-2',
          '--config.optimizer.warmup_steps=0', '--config.optimizer.eps=1e-3',
          '--config.optimizer.decay=constant', '--config.steps=10',
          '--config.mesh.data=1', '--config.mesh.fsdp=8',
          '--config.mesh.nodes=2']
  return config_lib.load(None, base + list(overrides))


def _batches(program, steps, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    tokens = rng.integers(0, 256, size=(16, 17), dtype=np.int32)
    out.append(jax.device_put({'inputs': tokens[:, :-1],
                               'targets': tokens[:, 1:]},
                              program.batch_sharding()))
  return out


def _mesh_shape(program):
  return list(program.mesh.shape.items())


def _all_gathers(program, hlo_text, phase=None):
  """(elements, spanned mesh axes) of each all-gather, optionally of a pass."""
  out = []
  for col in analysis.collectives_from_hlo(hlo_text):
    if col.kind == 'all-gather' and phase in (None,
                                              traffic.phase(col.op_name)):
      out.append((col.elements,
                  traffic.spanned_axes(col.groups, _mesh_shape(program))))
  return out


def _sgd(overrides):
  """(program, jitted SGD(lr=1) step, tx, abstract args): the step's update
  is the gradient."""
  program = trainer.build_program(_cfg(*overrides))
  tx = optax.chain(pmean_gradients('data'), optax.sgd(1.0))
  state = jax.eval_shape(tx.init, program.abstract_params)
  fn = step_lib.make_train_step(program.apply_fn, tx, program.layout,
                                sharding.state_partition_specs(state))
  return program, fn, tx, (program.abstract_params, state,
                           program.abstract_batch())


@functools.lru_cache(maxsize=None)
def _sgd_step(*overrides):
  """(program, compiled SGD step, tx), compiled as `Program.compile_step`
  does."""
  program, fn, tx, args = _sgd(overrides)
  options = sharding.fcdp.compiler_options(jax.devices()[0])
  return program, fn.lower(*args).compile(compiler_options=options), tx


def _gradient(overrides, batch_seed=0):
  program, compiled, tx = _sgd_step(*overrides)
  params, _ = program.init_state()
  before = jax.tree.map(np.asarray, params)
  state = tx.init(params)
  after, _, metrics = compiled(params, state, _batches(program, 1,
                                                       batch_seed)[0])
  return float(metrics['loss']), jax.tree.map(
      lambda b, a: b - np.asarray(a), before, after)


@pytest.mark.parametrize('switches', [
    ('--config.fcdp.host_cache=true',),
    ('--config.fcdp.host_cache=true', '--config.fcdp.hierarchical=true'),
])
def test_host_cache_backward_pass_reads_weights_from_host(switches):
  zero3, zero3_exe, _ = _sgd_step()
  program, exe, _ = _sgd_step(*switches)
  # ZeRO-3 gathers every unit again in the backward pass, over both levels.
  regathers = _all_gathers(zero3, zero3_exe.as_text(), 'backward')
  assert len(regathers) >= 10
  assert all(axes == ('node', 'fsdp') for _, axes in regathers)
  backward = _all_gathers(program, exe.as_text(), 'backward')
  if len(switches) == 1:  # the full weights come back from host memory
    assert not backward
  else:  # node-level shards come back from host; only intra-node gathers
    assert len(backward) == len(regathers)
    assert all(axes == ('fsdp',) for _, axes in backward)
  # ... and the step computes the same loss and gradients.
  loss, grads = _gradient(())
  cached_loss, cached_grads = _gradient(switches)
  assert cached_loss == pytest.approx(loss, rel=1e-6)
  for a, b in zip(jax.tree.leaves(cached_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert np.abs(b).max() > 0


def test_offload_is_placed_in_pinned_host_on_gpu():
  """The CPU compiler drops host placement (its device memory is host
  memory); the program lowered for a GPU keeps it for every cached value."""
  program, fn, _, args = _sgd(('--config.fcdp.host_cache=true',))
  assert analysis.offloaded_bytes(fn.trace(*args).jaxpr) > 0
  mlir = jax.export.export(fn, platforms=['cuda'])(*args).mlir_module()
  cached = mlir.count('_xla_buffer_placement = "pinned_host"')
  # One per cached weight: the 9 of each of the 2 blocks and the head's 2.
  assert cached == 9 * program.model_cfg.n_layers + 2


@functools.lru_cache(maxsize=None)
def _adamw(*overrides):
  program = trainer.build_program(_cfg(*overrides))
  return program, program.compile_step(0)


def _run(program, compiled, params, opt_state, batches):
  losses = []
  for b in batches:
    params, opt_state, metrics = compiled(params, opt_state, b)
    losses.append(float(metrics['loss']))
  return params, opt_state, losses


def test_lora_aware_trains_only_adapters_and_never_gathers_frozen_weights():
  program, compiled = _adamw(*LORA, '--config.fcdp.lora_aware=true')
  params, opt_state = program.init_state()
  trainable = program.layout.trainable
  start = jax.tree.map(np.asarray, params)
  # Frozen weights live in host memory, gathered (replicated) at init.
  for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(trainable)):
    if not t:
      assert p.sharding.memory_kind == 'pinned_host'
      assert p.sharding.is_fully_replicated
  # Only the adapters have optimizer state (AdamW: mu and nu).
  adapters = [p for p, t in zip(jax.tree.leaves(params),
                                jax.tree.leaves(trainable)) if t]
  assert len(adapters) == 8  # q, v x 2 layers x (A, B)
  moments = [x for x in jax.tree.leaves(opt_state) if x.ndim]
  assert sorted(x.shape for x in moments) == sorted(
      [x.shape for x in adapters] * 2)
  params, _, losses = _run(program, compiled, params, opt_state,
                           _batches(program, 3))
  assert np.all(np.isfinite(losses))
  for p, s, t in zip(jax.tree.leaves(params), jax.tree.leaves(start),
                     jax.tree.leaves(trainable)):
    if t:
      assert not np.array_equal(np.asarray(p), s)
    else:
      np.testing.assert_array_equal(np.asarray(p), s)  # bit for bit
  # The only weights gathered are the split adapters (A: [64, 8]).
  gathered = _all_gathers(program, compiled.as_text())
  assert gathered and {e for e, _ in gathered} == {64 * RANK}


def _resume_is_exact(overrides, tmp_path):
  program, compiled = _adamw(*overrides)
  batches = _batches(program, 4, seed=1)
  params, opt_state = program.init_state()
  params, opt_state, _ = _run(program, compiled, params, opt_state,
                              batches[:2])
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(2, {'params': params, 'opt': opt_state})
  straight, _, losses = _run(program, compiled, params, opt_state, batches[2:])
  with Checkpointer(str(tmp_path)) as ckpt:
    state, _ = ckpt.restore(2, {'params': program.abstract_params,
                                'opt': program.abstract_opt})
  assert jax.tree.map(lambda x: x.sharding, state['params']) == jax.tree.map(
      lambda x: x.sharding, program.abstract_params)
  resumed, _, resumed_losses = _run(program, compiled, state['params'],
                                    state['opt'], batches[2:])
  assert resumed_losses == losses
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return program, compiled, batches


def test_resume_is_exact_with_fsdp(tmp_path):
  _resume_is_exact((), tmp_path)


def test_resume_is_exact_with_all_of_fcdp(tmp_path):
  program, compiled, batches = _resume_is_exact(LORA + ALL_FCDP, tmp_path)
  # The frozen weights' node-level blocks reassemble the right weights: the
  # run trains like the one with fully gathered frozen weights.
  flat, flat_compiled = _adamw(*LORA, '--config.fcdp.lora_aware=true')
  want = _run(flat, flat_compiled, *flat.init_state(), batches)[2]
  got = _run(program, compiled, *program.init_state(), batches)[2]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # With the hierarchy the frozen weights are node-level shards on host:
  # gathered within the node from host memory, never across nodes.
  frozen_sizes = {64 * 64, 64 * 32, 64 * 192, 256 * 64, 64}
  inter = [(e, axes) for e, axes in _all_gathers(program, compiled.as_text())
           if 'node' in axes]
  assert inter and {e for e, _ in inter} == {64 * RANK // 4}
  intra = {e for e, axes in _all_gathers(program, compiled.as_text())
           if axes == ('fsdp',)}
  assert intra & frozen_sizes


def test_resume_may_switch_fcdp_and_relabel_nodes(tmp_path):
  """The FCDP switches and mesh.nodes place the same numbers differently: a
  checkpoint saved without them resumes with all of them (and 4 nodes) and
  trains as the run that kept its layout; resume.check_config lets them
  change without --allow-config-change."""
  from scape_jax.train import resume  # pylint: disable=g-import-not-at-top
  before = _cfg(*LORA)
  after = _cfg(*LORA, *ALL_FCDP, '--config.mesh.nodes=4')
  changes = resume.check_config(config_lib.to_dict(before),
                                config_lib.to_dict(after), 'ckpt', False)
  assert sorted(changes) == ['fcdp.hierarchical', 'fcdp.host_cache',
                             'fcdp.lora_aware', 'mesh.nodes']
  program, compiled = _adamw(*LORA)
  batches = _batches(program, 4, seed=2)
  params, opt_state, _ = _run(program, compiled, *program.init_state(),
                              batches[:2])
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(2, {'params': params, 'opt': opt_state})
  straight, _, losses = _run(program, compiled, params, opt_state, batches[2:])
  switched, switched_compiled = _adamw(*LORA, *ALL_FCDP,
                                       '--config.mesh.nodes=4')
  with Checkpointer(str(tmp_path)) as ckpt:
    state, _ = ckpt.restore(2, {'params': switched.abstract_params,
                                'opt': switched.abstract_opt})
  resumed, _, resumed_losses = _run(
      switched, switched_compiled, state['params'], state['opt'],
      [jax.device_put(b, switched.batch_sharding()) for b in batches[2:]])
  np.testing.assert_allclose(resumed_losses, losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-7)



def _grid(processes, shape):
  """A mesh's device grid of stand-ins on the given processes, in order."""
  import types  # pylint: disable=g-import-not-at-top
  devices = np.empty(len(processes), object)
  devices[:] = [types.SimpleNamespace(process_index=p) for p in processes]
  return devices.reshape(shape)


@pytest.mark.parametrize('processes, shape, problem', [
    # 2 hosts x 4 devices, fsdp=8 over nodes=2: each node a host.
    ([0] * 4 + [1] * 4, (1, 1, 2, 4, 1), None),
    # data=2 x (2 nodes x 2): every fsdp group spans both hosts.
    ([0] * 4 + [1] * 4, (1, 2, 2, 2, 1),
     'nodes 0 and 1 of the fsdp group at replica 0, data 0 are on one host'),
    # 4 devices per host but 2 per node: a node inside a host.
    ([0] * 4 + [1] * 4, (1, 1, 4, 2, 1),
     'nodes 0 and 1 of the fsdp group at replica 0, data 0 are on one host'),
    # 2 devices per host, 4 per node: a node over two hosts.
    ([0, 0, 1, 1, 2, 2, 3, 3], (1, 1, 2, 4, 1),
     "node 0 of the fsdp group at replica 0, data 0 has devices of 2 hosts"),
])
def test_the_node_axis_must_be_the_hosts(processes, shape, problem):
  """The hierarchical gather and the traffic split take 'node' for the
  network between hosts: in a multi-process run that is checked."""
  got = sharding.mesh.node_problem(_grid(processes, shape),
                                   lambda d: d.process_index)
  assert got is None if problem is None else got.startswith(problem), got


def test_a_multi_process_mesh_is_checked_against_the_hosts(monkeypatch):
  from scape_jax.train import agreement  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  mesh = types.SimpleNamespace(devices=_grid([0] * 4 + [1] * 4,
                                             (1, 2, 2, 2, 1)))
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  # Two processes on two hosts (their names' checksums, gathered).
  monkeypatch.setattr(agreement, '_all_gather',
                      lambda x: np.array([[11], [22]], np.uint32))
  with pytest.raises(config_lib.ConfigError, match=(
      r'mesh.nodes=2: nodes 0 and 1 of the fsdp group at replica 0, data 0 '
      r'are on one host.*Devices per host in this job: \[4\]; set mesh.fsdp '
      r'/ mesh.nodes to the devices of one host')):
    agreement.nodes_are_hosts(mesh, 2)
  agreement.nodes_are_hosts(mesh, 1)  # one node: nothing to check
  # The same two processes on one host: no node axis crosses hosts.
  monkeypatch.setattr(agreement, '_all_gather',
                      lambda x: np.array([[11], [11]], np.uint32))
  mesh.devices = _grid([0] * 4 + [1] * 4, (1, 1, 2, 4, 1))
  with pytest.raises(config_lib.ConfigError, match='are on one host'):
    agreement.nodes_are_hosts(mesh, 2)
  # $SCAPE_HOST names the host in place of the host name.
  names = []
  monkeypatch.setattr(agreement, '_all_gather', lambda x: names.append(
      int(x[0])) or np.array([[1], [2]], np.uint32))
  monkeypatch.setenv('SCAPE_HOST', 'node-a')
  agreement.nodes_are_hosts(mesh, 2)
  assert names == [zlib.crc32(b'node-a')]
