"""The training program: model, mesh, data, optimizer, checkpoints, logging.

`train(cfg)` runs (or resumes) a run; `dry_run(cfg)` compiles the train step
from abstract shapes on a mesh of the configured size and reports parameter
count, per-device memory and collectives, allocating nothing.
"""

import dataclasses
import math
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from scape_jax import comm
from scape_jax import config as config_lib
from scape_jax import methods
from scape_jax import step as step_lib
from scape_jax.checkpoint import Checkpointer
from scape_jax.metrics import MetricsLogger, Progress, plot_loss
from scape_jax.scape import scape_stats, state_partition_specs


def make_mesh(mcfg: config_lib.MeshConfig, devices=None) -> jax.sharding.Mesh:
  """A ('data', 'fsdp', 'tensor') mesh; -1 for data takes what is left."""
  devices = list(devices if devices is not None else jax.devices())
  if mcfg.fsdp != 1 or mcfg.tensor != 1:
    raise config_lib.ConfigError(
        f'mesh.fsdp={mcfg.fsdp}, mesh.tensor={mcfg.tensor}: only 1 is '
        'supported so far (pure data parallelism); the axes are reserved.')
  data = len(devices) if mcfg.data == -1 else mcfg.data
  if data > len(devices) or len(devices) % data:
    raise config_lib.ConfigError(
        f'mesh.data={mcfg.data} does not fit the {len(devices)} devices; '
        f'use a divisor of {len(devices)} or -1.')
  return jax.make_mesh((data, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(AxisType.Auto,) * 3, devices=devices[:data])


@dataclasses.dataclass
class Program:
  """Everything that is built from the config before any array exists."""
  cfg: config_lib.Config
  mesh: jax.sharding.Mesh
  model_cfg: Any
  method: methods.Method
  apply_fn: Any
  init_params: Any  # () -> params (pure dict)
  abstract_params: Any
  abstract_opt: Any
  opt_specs: Any

  @property
  def n_workers(self) -> int:
    return self.mesh.shape['data']

  def batch_sharding(self):
    return NamedSharding(self.mesh, P(step_lib.DATA))

  def abstract_batch(self):
    d = self.cfg.data
    s = jax.ShapeDtypeStruct((d.batch_size, d.seq_len), jnp.int32,
                             sharding=self.batch_sharding())
    return {'inputs': s, 'targets': s}

  def state_shardings(self):
    rep = NamedSharding(self.mesh, P())
    return (jax.tree.map(lambda _: rep, self.abstract_params),
            jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                         self.opt_specs))

  def compile_step(self, step: int):
    """The compiled train step for the static arguments in force at `step`."""
    fn = step_lib.make_train_step(self.apply_fn, self.method.tx, self.mesh,
                                  self.opt_specs,
                                  self.method.update_kwargs(step),
                                  self.cfg.data.micro_batches)
    return fn.lower(self.abstract_params, self.abstract_opt,
                    self.abstract_batch()).compile()


def build_program(cfg: config_lib.Config, devices=None) -> Program:
  """Builds the mesh, model functions, method and abstract state."""
  mesh = make_mesh(cfg.mesh, devices)
  model_cfg = models.get_config(cfg.model.preset, remat=cfg.model.remat,
                                attn_impl=cfg.model.attn_impl)
  if cfg.data.seq_len > model_cfg.max_seq_len:
    raise config_lib.ConfigError(
        f'data.seq_len={cfg.data.seq_len} exceeds the max_seq_len '
        f'{model_cfg.max_seq_len} of model {cfg.model.preset!r}.')
  per_worker, rest = divmod(cfg.data.batch_size, mesh.shape['data'])
  if rest or per_worker % cfg.data.micro_batches:
    raise config_lib.ConfigError(
        f'data.batch_size={cfg.data.batch_size} is not divisible by the '
        f'{mesh.shape["data"]} data-parallel workers times '
        f'data.micro_batches={cfg.data.micro_batches}.')
  dtype = jnp.dtype(cfg.model.dtype)
  param_dtype = jnp.dtype(cfg.model.param_dtype)

  def create():
    return models.build(model_cfg, rngs=nnx.Rngs(cfg.seed), dtype=dtype,
                        param_dtype=param_dtype)

  graphdef, abstract_state = nnx.split(nnx.eval_shape(create), nnx.Param)

  def apply_fn(params, tokens):
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(tokens)

  def init_params():
    return nnx.to_pure_dict(nnx.state(create(), nnx.Param))

  rep = NamedSharding(mesh, P())
  abstract_params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
      nnx.to_pure_dict(abstract_state))
  method = methods.build(cfg.optimizer, cfg.steps, step_lib.DATA)
  with jax.set_mesh(mesh):
    opt_shapes = jax.eval_shape(method.tx.init, abstract_params)
  opt_specs = state_partition_specs(opt_shapes, step_lib.DATA)
  abstract_opt = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=NamedSharding(mesh, s)),
      opt_shapes, opt_specs)
  return Program(cfg, mesh, model_cfg, method, apply_fn, init_params,
                 abstract_params, abstract_opt, opt_specs)


def param_count(program: Program) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(
      program.abstract_params))


def dry_run(cfg: config_lib.Config, devices=None) -> dict:
  """Compiles the steady-state train step from abstract shapes only."""
  program = build_program(cfg, devices)
  compiled = program.compile_step(cfg.steps)
  mem = compiled.memory_analysis()
  cols = comm.collectives_from_hlo(compiled.as_text())
  report = {
      'preset': cfg.model.preset,
      'optimizer': cfg.optimizer.name,
      'params': param_count(program),
      'workers': program.n_workers,
      'argument_bytes': mem.argument_size_in_bytes,
      'output_bytes': mem.output_size_in_bytes,
      'temp_bytes': mem.temp_size_in_bytes,
      'alias_bytes': mem.alias_size_in_bytes,
      'comm_bytes_per_step': comm.bytes_sent(cols),
  }
  report['device_bytes'] = (report['argument_bytes'] + report['output_bytes'] +
                            report['temp_bytes'] - report['alias_bytes'])
  gib = 2.0**30
  print(f'model {cfg.model.preset}: {report["params"]:,} parameters; '
        f'optimizer {cfg.optimizer.name}; mesh data={program.n_workers}')
  print(f'per-device memory (compiled step): {report["device_bytes"] / gib:.2f}'
        f' GiB = arguments {report["argument_bytes"] / gib:.2f} + outputs '
        f'{report["output_bytes"] / gib:.2f} + temporaries '
        f'{report["temp_bytes"] / gib:.2f} - aliased '
        f'{report["alias_bytes"] / gib:.2f}')
  print(comm.format_table(cols))
  return report


def _prepare_data(cfg: config_lib.Config) -> str:
  """Prepares the corpus once (on process 0) and returns its directory."""
  from scape_jax.data import prepare as prepare_lib  # grain-free import
  d = cfg.data
  if os.path.exists(os.path.join(d.corpus, 'meta.json')):
    return d.corpus  # an already prepared directory
  tok_name = os.path.splitext(os.path.basename(d.tokenizer))[0]
  name = os.path.basename(os.path.normpath(d.corpus))
  data_dir = d.data_dir or os.path.join('data', f'{name}-{tok_name}')
  if jax.process_index() == 0:
    if d.corpus != 'synthetic':
      prepare_lib.prepare(d.corpus, d.tokenizer, data_dir)  # idempotent
    elif not os.path.exists(os.path.join(data_dir, 'meta.json')):
      prepare_lib.make_synthetic_corpus(data_dir, num_tokens=1 << 18)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices('scape_jax data prepared')
  return data_dir


def _global_batch(program: Program, local: dict) -> dict:
  sharding = program.batch_sharding()
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local.items()}


def _fetch(metrics: dict) -> dict:
  """Device scalars (or per-worker vectors, averaged) -> Python floats.

  A per-worker vector spans every process's devices; its mean is computed on
  the devices (replicated) so that each process can read it.
  """
  return {k: float(jax.device_get(jnp.mean(v) if jnp.ndim(v) else v))
          for k, v in metrics.items()}


def _init_or_restore(program: Program, ckpt: Checkpointer, it):
  """(start step, params, opt_state): the latest checkpoint, else a new run."""
  start = ckpt.latest_step() or 0
  if start:
    target = {'params': program.abstract_params, 'opt': program.abstract_opt}
    state, extras = ckpt.restore(start, target)
    it.set_state(extras['data'])
    return start, state['params'], state['opt']
  p_shard, o_shard = program.state_shardings()
  params = jax.jit(program.init_params, out_shardings=p_shard)()
  with jax.set_mesh(program.mesh):
    opt_state = jax.jit(program.method.tx.init, out_shardings=o_shard)(params)
  return 0, params, opt_state


class _StepPrograms:
  """Compiles each distinct train-step program once (one per SCAPE level)."""

  def __init__(self, program: Program):
    self._program = program
    self._compiled = {}

  def _key(self, step):
    return tuple(sorted(self._program.method.update_kwargs(step).items()))

  def __call__(self, step: int):
    """(executable, bytes sent per device) for the update after `step`."""
    key = self._key(step)
    if key not in self._compiled:
      exe = self._program.compile_step(step)
      self._compiled[key] = exe, comm.collectives_from_hlo(exe.as_text())
    exe, cols = self._compiled[key]
    return exe, comm.bytes_sent(cols)

  def compile_all(self, start: int, end: int) -> None:
    """Compiles every program that the updates after start..end-1 use."""
    last = self._key(end - 1)
    for step in range(start, end):
      self(step)
      if self._key(step) == last:  # levels only go down; the rest is last
        break

  def collectives(self, step: int):
    self(step)
    return self._compiled[self._key(step)][1]


def train(cfg: config_lib.Config, devices=None) -> dict:
  """Trains (or resumes) the run in `cfg.out_dir`; returns a summary."""
  from scape_jax.data import pipeline
  from scape_jax.data import prepare as prepare_lib
  program = build_program(cfg, devices)
  data_dir = _prepare_data(cfg)
  meta = prepare_lib.load_meta(data_dir)
  if meta['vocab_size'] > program.model_cfg.vocab_size:
    raise config_lib.ConfigError(
        f'the tokenizer has {meta["vocab_size"]} tokens but model '
        f'{cfg.model.preset!r} only {program.model_cfg.vocab_size}.')
  d = cfg.data
  it = pipeline.train_iterator(data_dir, seq_len=d.seq_len,
                               global_batch_size=d.batch_size, seed=cfg.seed,
                               process_index=jax.process_index(),
                               process_count=jax.process_count())
  eval_data = [_global_batch(program, b) for b in pipeline.eval_batches(
      data_dir, seq_len=d.seq_len, batch_size=d.batch_size,
      num_batches=cfg.eval_batches, process_index=jax.process_index(),
      process_count=jax.process_count())]
  leader = jax.process_index() == 0
  ckpt = Checkpointer(os.path.join(cfg.out_dir, 'ckpt'))
  start, params, opt_state = _init_or_restore(program, ckpt, it)
  if start and leader:
    print(f'resumed from {cfg.out_dir}/ckpt step {start}')
  programs = _StepPrograms(program)

  eval_fn = step_lib.make_eval_step(program.apply_fn, program.mesh)
  logger = MetricsLogger(cfg.out_dir, enabled=leader)
  bar = Progress(cfg.steps, initial=start) if leader else None
  tokens_per_step = d.batch_size * d.seq_len
  pending, history, last_eval = [], [], None
  t_log = time.perf_counter()

  def evaluate(step):
    loss = float(np.mean([float(eval_fn(params, b)) for b in eval_data]))
    logger.log(step, {'loss': loss, 'perplexity': math.exp(min(loss, 50))},
               prefix='eval')
    if leader:
      print(f'step {step:6d} | eval loss {loss:.4f} | ppl '
            f'{math.exp(min(loss, 50)):.2f}')
    return loss

  for step in range(start, cfg.steps):
    fn, nbytes = programs(step)
    if step == start:  # compile every level's program before timing
      programs.compile_all(start, cfg.steps)
      if leader:
        print('collectives of the train step, per device per step:')
        print(comm.format_table(programs.collectives(cfg.steps - 1)))
      t_log = time.perf_counter()
    batch = _global_batch(program, next(it))
    params, opt_state, m = fn(params, opt_state, batch)
    m = dict(m, comm_bytes=nbytes, **scape_stats(opt_state))
    pending.append((step + 1, m))
    done = step + 1
    if done % cfg.log_every == 0 or done == cfg.steps:
      fetched = [(s, _fetch(x)) for s, x in pending]
      elapsed = time.perf_counter() - t_log
      tps = tokens_per_step * len(pending) / max(elapsed, 1e-9)
      for s, x in fetched:
        x['lr'] = float(program.method.learning_rate(s - 1))
        logger.log(s, dict(x, tokens_per_s=tps))
        history.append(x['loss'])
      s, x = fetched[-1]
      if leader:
        print(f'step {s:6d} | loss {x["loss"]:.4f} | lr {x["lr"]:.2e} | '
              f'grad {x["grad_norm"]:.3f} | {tps:,.0f} tok/s | '
              f'{x["comm_bytes"] / 2**20:.3f} MiB/step')
        bar.update(len(pending), loss=x['loss'])
      pending = []
      t_log = time.perf_counter()
    if cfg.eval_every and done % cfg.eval_every == 0:
      last_eval = evaluate(done)
    if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps:
      ckpt.save(done, {'params': params, 'opt': opt_state},
                {'data': it.get_state(), 'config': config_lib.to_dict(cfg)})
  if last_eval is None or (cfg.eval_every and cfg.steps % cfg.eval_every):
    last_eval = evaluate(cfg.steps)
  ckpt.wait()
  ckpt.close()
  if bar:
    bar.close()
  logger.close()
  summary = {'steps': cfg.steps, 'start_step': start,
             'first_loss': history[0] if history else None,
             'final_loss': history[-1] if history else None,
             'eval_loss': last_eval, 'losses': history}
  if leader:
    png = os.path.join(cfg.out_dir, 'loss.png')
    plot_loss(logger.path, png)
    if history:
      print(f'done: {cfg.steps} steps, loss {history[0]:.3f} -> '
            f'{history[-1]:.3f}, eval loss {last_eval:.3f} (ppl '
            f'{math.exp(min(last_eval, 50)):.2f}); metrics '
            f'{logger.path}, plot {png}')
  return summary


def required_devices(cfg: config_lib.Config) -> Optional[int]:
  """Devices the configured mesh needs (None when it takes all)."""
  if cfg.mesh.data == -1:
    return None
  return cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
