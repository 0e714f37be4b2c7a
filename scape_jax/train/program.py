"""Everything built from the config before any array exists.

`build_program(cfg)` makes the mesh, the model functions, the method, the
layout and the abstract train state; `Program.compile_step` compiles the
train step for the static arguments in force at a step; `dry_run` compiles
the steady-state step from abstract shapes and reports memory and
collectives, allocating nothing.
"""

import dataclasses
import math
import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from scape_jax import models
from scape_jax import analysis
from scape_jax import hf
from scape_jax import sharding
from scape_jax.train import methods
from scape_jax.train import step as step_lib
from scape_jax.train.config import Config, ConfigError

# XLA options of a CPU program compiled only to be read (`compile_step`).
_READ_ONLY_CPU_OPTIONS = {'xla_backend_optimization_level': 0}


@dataclasses.dataclass
class Program:
  """The model functions, the method and the abstract state of a run."""
  cfg: Config
  layout: sharding.Layout
  model_cfg: Any
  method: methods.Method
  apply_fn: Any  # (params, tokens, param_hook=None) -> logits
  init_params: Any  # () -> one group's params (pure dict)
  abstract_params: Any  # global view, with shardings
  abstract_opt: Any  # global view, with shardings
  opt_specs: Any  # one group's PartitionSpecs of the optimizer state (of
  # the trainable parameters)
  load_params: Any = None  # () -> host params of model.init_from, or None
  opt_memory_kinds: Any = None  # their memory kinds; None: device memory
  # Lines for the user: settings that are legal but easy to get wrong (idle
  # devices, common keys the method does not read). train.py prints them.
  notes: tuple = ()

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self.layout.mesh

  @property
  def n_workers(self) -> int:
    """Data-parallel workers of the optimizer's exchange."""
    return self.layout.workers

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.layout.batch_spec())

  def abstract_batch(self) -> dict:
    d = self.cfg.data
    s = jax.ShapeDtypeStruct((d.batch_size, d.seq_len), jnp.int32,
                             sharding=self.batch_sharding())
    return {'inputs': s, 'targets': s}

  def state_shardings(self) -> tuple:
    """(params, opt_state) shardings of the global view."""
    return (self.layout.param_shardings(),
            self.layout.shardings(self.opt_specs, self.opt_memory_kinds))

  def init_state(self) -> tuple:
    """(params, opt_state) of a new run, placed by `state_shardings`."""
    p_shard, o_shard = self.state_shardings()
    replicas = self.layout.replicas if self.layout.per_replica else None

    def params_fn(loaded):
      params = self.init_params()
      if loaded is not None:  # New adapters (LoRA) on the loaded base.
        params = _overlay(params, loaded)
      if replicas is None:
        return params
      return jax.tree.map(
          lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), params)

    loaded = self.load_params() if self.load_params else None
    params = jax.jit(params_fn, out_shardings=p_shard)(loaded)
    init = self.method.tx.init
    if replicas is not None:
      init = jax.vmap(init)
    with jax.set_mesh(self.mesh):
      opt_state = jax.jit(init, out_shardings=o_shard)(
          self.layout.split(params)[0])
    return params, opt_state

  def trace_step(self, step: int):
    """The train step for the static arguments in force at `step`, traced
    from abstract shapes (`.jaxpr`, `.lower()`)."""
    fn = step_lib.make_train_step(self.apply_fn, self.method.tx, self.layout,
                                  self.opt_specs,
                                  self.method.update_kwargs(step),
                                  self.cfg.data.micro_batches)
    return fn.trace(self.abstract_params, self.abstract_opt,
                    self.abstract_batch())

  def compile_step(self, step: int, traced=None, *, run: bool = True):
    """The compiled train step for the static arguments in force at `step`
    (from `traced`, its `trace_step`, if given).

    `run=False`: the program is compiled only to be read (its memory, HLO and
    collectives: `dry_run`, the benches' tables), never run; on CPU devices
    XLA then skips its backend's (LLVM's) optimizations, which change how
    fast the program runs but not its HLO, buffers or collectives.
    """
    device = self.mesh.devices.flat[0]
    options = {}
    if self.layout.per_unit:
      options.update(sharding.fcdp.compiler_options(device) or {})
    if not run and device.platform == 'cpu':
      options.update(_READ_ONLY_CPU_OPTIONS)
    traced = traced or self.trace_step(step)
    return traced.lower().compile(compiler_options=options or None)


def _check_batch(cfg: Config, layout: sharding.Layout) -> None:
  shards = math.prod(layout.mesh.shape[a] for a in layout.batch_axes)
  per_worker, rest = divmod(cfg.data.batch_size, shards)
  if rest or per_worker % cfg.data.micro_batches:
    raise ConfigError(
        f'data.batch_size={cfg.data.batch_size} is not divisible by the '
        f'{shards} workers the batch is split over '
        f'({" x ".join(layout.batch_axes)}) times '
        f'data.micro_batches={cfg.data.micro_batches}.')


def model_name(cfg: Config) -> str:
  """`model.init_from` if set, else `model.preset`."""
  return cfg.model.init_from or cfg.model.preset


def _lora(cfg: Config) -> Optional[models.LoraSpec]:
  lora = cfg.model.lora
  if not lora.targets:
    return None
  return models.LoraSpec(lora.rank, lora.alpha, lora.targets)


def model_config(cfg: Config, init_from_config=None) -> models.Config:
  """The model's shape: `model.init_from`'s config.json, else the preset.

  `init_from_config`, given, is that config.json as a run recorded it (the
  directory need not exist any more).
  """
  m = cfg.model
  overrides = dict(remat=m.remat, scan_layers=m.scan_layers,
                   attn_impl=m.attn_impl, lora=_lora(cfg))
  if m.vocab_size and not m.init_from:  # (with init_from: a config error)
    overrides['vocab_size'] = m.vocab_size
  if m.init_from:
    try:
      return hf.from_hf_config(init_from_config or hf.read_config(
          m.init_from), **overrides)
    except (OSError, ValueError) as e:
      raise ConfigError(f'model.init_from={m.init_from!r}: {e}') from e
  if m.preset not in models.PRESETS:
    raise ConfigError(f'model.preset: unknown model {m.preset!r}; '
                      f'allowed: {", ".join(sorted(models.PRESETS))}')
  try:
    return models.get_config(m.preset, **overrides)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def vocab_problem(cfg: Config, tokens: int, model_vocab: int) -> str:
  """The message for a tokenizer of `tokens` ids that the model's
  vocabulary of `model_vocab` cannot hold, naming the key that fixes it."""
  where = ("model.init_from's config.json sets the vocabulary: prepare the "
           "corpus with that model's tokenizer" if cfg.model.init_from else
           f'set --config.model.vocab_size={models.pad_vocab(tokens)} (or '
           f'any value >= {tokens}; a multiple of 128 runs faster)')
  return (f'the tokenizer has {tokens} tokens but model '
          f'{model_name(cfg)!r} only {model_vocab}: {where}')


def _model(cfg: Config, init_from_config=None):
  """(model config, create, graphdef, abstract nnx state)."""
  model_cfg = model_config(cfg, init_from_config)
  if cfg.data.seq_len > model_cfg.max_seq_len:
    raise ConfigError(
        f'data.seq_len={cfg.data.seq_len} exceeds the max_seq_len '
        f'{model_cfg.max_seq_len} of model {model_name(cfg)!r}.')
  dtype = jnp.dtype(cfg.model.dtype)
  param_dtype = jnp.dtype(cfg.model.param_dtype)

  def create():
    return models.build(model_cfg, rngs=models.rngs(cfg.seed), dtype=dtype,
                        param_dtype=param_dtype)

  graphdef, abstract_state = nnx.split(nnx.eval_shape(create), nnx.Param)
  return model_cfg, create, graphdef, abstract_state


def param_shapes(cfg: Config, init_from_config=None) -> tuple:
  """(model config, one model copy's params as ShapeDtypeStructs)."""
  model_cfg, _, _, abstract_state = _model(cfg, init_from_config)
  return model_cfg, nnx.to_pure_dict(abstract_state)


def _hf_loader(cfg: Config, model_cfg, group_params):
  """() -> the params of `model.init_from` (host arrays), or None. With
  LoRA, the base model's: the adapters are new (`_overlay`)."""
  if not cfg.model.init_from:
    return None

  def load():
    directory = cfg.model.init_from
    try:
      return hf.from_hf_state(
          model_cfg, hf.read_safetensors(directory),
          models.lora.without_adapters(group_params),
          jnp.dtype(cfg.model.param_dtype),
          tie_word_embeddings=hf.tied_embeddings(hf.read_config(directory)))
    except (ImportError, OSError, ValueError) as e:
      raise ConfigError(f'model.init_from={cfg.model.init_from!r}: {e}') from e

  return load


def _overlay(params: dict, over: dict) -> dict:
  """`params` with the leaves that `over` (a subtree of keys) holds."""
  return {k: (_overlay(v, over[k]) if isinstance(v, dict) else over[k])
          if k in over else v for k, v in params.items()}


def _trainable(cfg: Config, abstract_state):
  """With LoRA, a tree of bools: True for the adapters; else None."""
  if not cfg.model.lora.targets:
    return None
  return nnx.to_pure_dict(jax.tree.map(
      lambda v: isinstance(v, nnx.LoRAParam), abstract_state,
      is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _layout(cfg: Config, spec: methods.MethodSpec, mesh, devices,
            abstract_state, abstract_params, axes) -> sharding.Layout:
  fsdp = sharding.mesh.fsdp_size(mesh)
  if fsdp > 1 and not spec.supports_fsdp:
    allowed = [n for n, s in methods.REGISTRY.items() if s.supports_fsdp]
    raise ConfigError(f'mesh.fsdp={fsdp}: optimizer.name={spec.name!r} does '
                      f'not run on the fsdp layout; methods that do: '
                      f'{", ".join(allowed)}.')
  if spec.per_replica and mesh.size != len(devices):
    shape = ' x '.join(f'mesh.{k}={v}' for k, v in mesh.shape.items())
    raise ConfigError(
        f'{shape} = {mesh.size} devices, but {len(devices)} are in use: '
        f'optimizer.name={spec.name!r} splits every device into replica '
        'groups; set mesh.replica x mesh.data (x mesh.fsdp) to the device '
        'count, or mesh.data=-1.')
  options = sharding.FcdpOptions(**dataclasses.asdict(cfg.fcdp))
  trainable = _trainable(cfg, abstract_state)
  try:
    specs = sharding.param_partition_specs(abstract_params, axes, fsdp=fsdp,
                                           nodes=cfg.mesh.nodes)
    if options.lora_aware:  # frozen weights kept gathered (on host)
      specs = jax.tree.map(
          lambda s, t: s if t else sharding.fcdp.cache_spec(
              s, options.hierarchical), specs, trainable)
    if options.uses_host:
      sharding.fcdp.check_memory_kinds(mesh.devices.flat)
    return sharding.Layout(mesh, specs, per_replica=spec.per_replica,
                           fcdp=options, trainable=trainable)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def _abstract(tree, shardings, leading: Optional[int]):
  """ShapeDtypeStructs of `tree` with shardings, and a leading axis if any."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          ((leading,) if leading else ()) + tuple(x.shape), x.dtype,
          sharding=s), tree, shardings)


def build_program(cfg: Config, devices=None) -> Program:
  """Builds the mesh, model functions, method, layout and abstract state."""
  m = cfg.mesh
  try:
    mesh = sharding.make_mesh(replica=m.replica, data=m.data, fsdp=m.fsdp,
                              tensor=m.tensor, nodes=m.nodes,
                              devices=devices)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  model_cfg, create, graphdef, abstract_state = _model(cfg)

  def apply_fn(params, tokens, param_hook=None):
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(tokens, param_hook=param_hook)

  def init_params():
    return nnx.to_pure_dict(nnx.state(create(), nnx.Param))

  group_params = nnx.to_pure_dict(abstract_state)
  spec = methods.get(cfg.optimizer.name)
  devices = devices or jax.devices()
  _check_select(cfg, devices[0].platform)
  axes = nnx.to_pure_dict(models.logical_axes(abstract_state))
  layout = _layout(cfg, spec, mesh, devices, abstract_state, group_params,
                   axes)
  _check_batch(cfg, layout)
  method = methods.build(cfg.optimizer, cfg.steps, methods.Context(
      sharding.DATA, fsdp=layout.fsdp > 1, matrices=models.matrices(axes)))
  trainable = layout.split(group_params)[0]
  try:
    with jax.set_mesh(mesh):
      opt_shapes = jax.eval_shape(method.tx.init, trainable)
  except ValueError as e:  # the method's settings do not fit the model
    raise ConfigError(str(e)) from e
  opt_specs = sharding.state_partition_specs(
      opt_shapes, sharding.DATA, params=trainable,
      param_specs=layout.trainable_specs())
  kinds = method.memory_kinds(opt_shapes) if method.memory_kinds else None
  try:
    o_shard = layout.shardings(opt_specs, kinds)
  except ValueError as e:
    raise ConfigError(f'optimizer.{spec.name}.offload: {e} Set '
                      f'optimizer.{spec.name}.offload=False to keep the '
                      'state in device memory.') from e
  leading = layout.replicas if layout.per_replica else None
  p_shard = layout.param_shardings()
  notes = (methods.unread_notes(cfg.optimizer) +
           methods.schedule_notes(cfg.optimizer, cfg.steps))
  if cfg.model.lora.targets and not cfg.model.init_from:
    notes.append('model.lora.targets without model.init_from: the frozen '
                 'base is a random initialisation (fine for measuring '
                 'traffic and speed, not for fine-tuning); model.init_from='
                 'DIR starts from a Hugging Face GPT-2/Llama directory')
  if layout.per_replica and layout.replicas == 1:
    notes.append(f'optimizer.name={spec.name!r} with mesh.replica=1 runs one '
                 'group: the outer step averages nothing (a lookahead on one '
                 'model); mesh.replica sets the number of groups')
  if mesh.size < len(devices):  # (a per-replica method has refused it)
    notes.insert(0, f'the mesh uses {mesh.size} of the {len(devices)} '
                 'devices; mesh.data=-1 takes all that the other axes leave')
  return Program(cfg, layout, model_cfg, method, apply_fn, init_params,
                 _abstract(group_params, p_shard, leading),
                 _abstract(opt_shapes, o_shard, leading), opt_specs,
                 _hf_loader(cfg, model_cfg, group_params), kinds,
                 tuple(notes))


def _check_select(cfg: Config, platform: str) -> None:
  """SCAPE's Pallas selections need a GPU or TPU inside the train step."""
  for spec, section in methods.selected(cfg.optimizer):
    if (spec.name == 'scape' and section.select == 'pallas_radix' and
        platform == 'cpu'):
      raise ConfigError(
          f'optimizer.scape.select={section.select!r} runs Pallas kernels, '
          'which SCAPE\'s train step can run on a GPU or TPU only (on the '
          "CPU, Pallas' interpreter does not run inside shard_map); on cpu "
          "use 'auto', 'threshold' or 'sort'")


def param_count(program: Program) -> int:
  """Parameters of one model copy."""
  leaves = jax.tree.leaves(program.abstract_params)
  skip = 1 if program.layout.per_replica else 0
  return sum(math.prod(x.shape[skip:]) for x in leaves)


def memory_report(program: Program, traced, compiled) -> dict:
  """Per-device bytes of a compiled step: device and host memory apart.

  `device_bytes` is the compiled program's figure (arguments + outputs +
  temporaries - aliased). `state_bytes` splits the arguments that persist
  between steps (parameters and optimizer state) by memory kind, read from
  their shardings. XLA's CPU compiler keeps host-placed arguments in its one
  memory and counts them as device arguments (its host fields read 0), so
  `device_bytes_placed` takes them out again: the device figure a backend
  with a separate host memory would give for the same placement.
  """
  mem = compiled.memory_analysis()
  state = analysis.argument_bytes_by_kind((program.abstract_params,
                                           program.abstract_opt))
  report = {
      'argument_bytes': mem.argument_size_in_bytes,
      'output_bytes': mem.output_size_in_bytes,
      'temp_bytes': mem.temp_size_in_bytes,
      'alias_bytes': mem.alias_size_in_bytes,
      'state_device_bytes': state.get('device', 0),
      'state_host_bytes': sum(v for k, v in state.items() if k != 'device'),
      'host_params_bytes': analysis.host_argument_bytes(
          program.abstract_params),
      'host_opt_bytes': analysis.host_argument_bytes(program.abstract_opt),
      'host_offload_bytes': analysis.offloaded_bytes(traced.jaxpr),
      'host_compiled_bytes': (
          mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes +
          mem.host_temp_size_in_bytes - mem.host_alias_size_in_bytes),
  }
  report['device_bytes'] = (report['argument_bytes'] + report['output_bytes'] +
                            report['temp_bytes'] - report['alias_bytes'])
  counted_on_device = (report['state_host_bytes']
                       if mem.host_argument_size_in_bytes == 0 else 0)
  report['device_bytes_placed'] = report['device_bytes'] - counted_on_device
  report['host_bytes'] = (report['state_host_bytes'] +
                          report['host_offload_bytes'])
  return report


def _print_memory(report: dict) -> None:
  gib = 2.0**30
  g = lambda key: f'{report[key] / gib:.2f}'
  print(f'per-device memory (compiled step): {g("device_bytes")} GiB = '
        f'arguments {g("argument_bytes")} + outputs {g("output_bytes")} + '
        f'temporaries {g("temp_bytes")} - aliased {g("alias_bytes")}')
  print(f'per-device parameters and optimizer state: device memory '
        f'{g("state_device_bytes")} GiB, host memory {g("state_host_bytes")} '
        'GiB (from their shardings)')
  if report['host_bytes'] or report['host_compiled_bytes']:
    print(f'per-device host memory: {g("host_bytes")} GiB = parameters kept '
          f'on host {g("host_params_bytes")} + optimizer state kept on host '
          f'{g("host_opt_bytes")} + values the step offloads '
          f'{g("host_offload_bytes")}; device memory without the state kept '
          f'on host {g("device_bytes_placed")} GiB. The compiled host fields '
          f'say {g("host_compiled_bytes")} GiB (0 on the CPU, whose compiler '
          'keeps host-placed values in its one memory and counts them as '
          'device memory above)')
    if report['host_offload_bytes'] and not report['host_compiled_bytes']:
      print('  (on the CPU the values the step offloads stay among the '
            'temporaries counted as device memory: a GPU or TPU compile '
            'places them in host memory)')


# SCAPE's Pallas selection and its jnp twin on CPU devices (the same bits).
_JNP_TWIN = {'pallas_radix': 'threshold'}


def _cpu_twin(cfg: Config, platform: str) -> tuple:
  """(cfg, note): on CPU devices a Pallas selection is dry-run as its twin.

  A dry run for a GPU or TPU cluster may compile on simulated CPU devices,
  where the Pallas kernels do not run inside the train step.
  """
  select = cfg.optimizer.scape.select
  if platform != 'cpu' or select not in _JNP_TWIN:
    return cfg, None
  scape = dataclasses.replace(cfg.optimizer.scape, select=_JNP_TWIN[select])
  twin = dataclasses.replace(
      cfg, optimizer=dataclasses.replace(cfg.optimizer, scape=scape))
  return twin, (f'dry run on cpu devices: optimizer.scape.select={select!r} '
                f'is compiled as {_JNP_TWIN[select]!r}, the CPU\'s jnp '
                'search (the same bits and collectives; its Pallas kernels '
                'run on a GPU or TPU only)')


def program_key(program: Program, count: int) -> tuple:
  """The train-step program of the update after `count` updates: the
  method's static update arguments, sorted (one compiled program each)."""
  return tuple(sorted(program.method.update_kwargs(count).items()))


def steady_count(program: Program) -> tuple:
  """(count, static args, steps that run it): the first update of the
  program that runs most of the run's steps (SCAPE's final density,
  Radius's sparse step, DiLoCo's inner step); the later one on a tie."""
  runs = {}
  for count in range(program.cfg.steps):
    key = program_key(program, count)
    first, n = runs.get(key, (count, 0))
    runs[key] = first, n + 1
  key = max(runs, key=lambda k: (runs[k][1], runs[k][0]))
  return runs[key][0], dict(key), runs[key][1]


def dry_run(cfg: Config, devices=None) -> dict:
  """Compiles the steady-state train step (the program most steps run,
  `steady_count`) from abstract shapes only."""
  devices = jax.devices() if devices is None else devices
  cfg, note = _cpu_twin(cfg, devices[0].platform)
  program = build_program(cfg, devices)
  if note:
    program = dataclasses.replace(program, notes=program.notes + (note,))
  print_notes(program)
  count, static, runs = steady_count(program)
  traced = program.trace_step(count)
  compiled = program.compile_step(count, traced, run=False)
  cols = analysis.collectives_from_hlo(compiled.as_text())
  report = {
      'preset': model_name(cfg),
      'optimizer': cfg.optimizer.name,
      'params': param_count(program),
      'workers': program.n_workers,
      'comm_bytes_per_step': analysis.bytes_sent(cols),
      'steady_program': static,
      'steady_steps': runs,
  }
  report.update(memory_report(program, traced, compiled))
  shape = ' '.join(f'{k}={v}' for k, v in program.mesh.shape.items())
  print(f'model {model_name(cfg)}: {report["params"]:,} parameters; '
        f'optimizer {cfg.optimizer.name}; mesh {shape}')
  _print_memory(report)
  if static:
    print(f'collectives of the train step ('
          f'{", ".join(f"{k}={v}" for k, v in static.items())}: {runs:,} of '
          f'the {cfg.steps:,} steps), per device per step:')
  print(analysis.format_table(cols))
  return report


def print_notes(program: Program) -> None:
  if jax.process_index() == 0:
    for note in program.notes:
      print(f'note: {note}', file=sys.stderr, flush=True)


def required_devices(cfg: Config) -> Optional[int]:
  """Devices the configured mesh needs (None when it takes all)."""
  m = cfg.mesh
  if m.data == -1:
    return None
  return m.replica * m.data * m.fsdp * m.tensor
