"""Run configuration: nested dataclasses, nanoGPT-style config files, overrides.

A config file is a plain Python file that states only what it changes::

  # configs/llama500m.py
  model = dict(preset='llama500m')
  optimizer = dict(name='scape', lr=3e-4, scape=dict(density=0.01))
  steps = 100_000

It is executed in a fresh namespace; every top-level name not starting with
'_' (imported modules excluded) is applied onto `Config()` (helpers: '_x').

Command-line overrides are applied afterwards, in order::

  --config.optimizer.name=adamw --config.steps 500

Every key is checked against the dataclass fields (typos raise `ConfigError`
naming the dotted key and the keys allowed there) and every value is parsed or
checked against the field's type.

The optimizer section holds the keys every method shares, plus one
sub-section per method with its own keys (`optimizer.scape.density`), taken
from the method registry (`scape_jax.train.methods`). Only the section of the
method named by `optimizer.name` is used, so that changing that one line
switches methods; every section is range-checked, so a bad value waiting in
another method's section is reported now, not when a run switches to it.
"""

import dataclasses
import math
import types
import typing
from typing import Any, Mapping, Sequence

from scape_jax import models
from scape_jax.optim import _common
from scape_jax.train import methods
from scape_jax.train import presets
from scape_jax.train.methods import DECAYS

_PREFIX = '--config.'

DTYPES = ('bfloat16', 'float32')


class ConfigError(ValueError):
  """An unknown key, a badly typed value or an out-of-range setting."""


@dataclasses.dataclass(slots=True)
class LoraConfig:
  """LoRA adapters (models/lora.py); on when `targets` names layers."""
  rank: int = 8  # Inner dimension of the adapters A [d_in, r], B [r, d_out].
  alpha: float = 16.0  # The update is scaled by alpha / rank.
  # Layers inside a block that get adapters ('q_proj', 'mlp.c_fc', ...;
  # empty: no LoRA); their base weights (all but the adapters) are frozen.
  targets: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class ModelConfig:
  preset: str = 'llama-tiny'  # A name in models.PRESETS (checked by trainer).
  dtype: str = 'bfloat16'  # Compute dtype: one of DTYPES.
  param_dtype: str = 'float32'  # Parameter (master copy) dtype.
  remat: bool = False  # Rematerialise each block in the backward pass.
  scan_layers: bool = False  # Blocks as one stacked module (nnx.scan).
  attn_impl: str = 'xla'  # One of ATTN_IMPLS; cudnn: flash attention on GPU.
  # Token ids of the embedding and output layer; 0: the preset's. Set it for
  # a tokenizer larger than the preset's vocabulary (e.g. 640 for 600 tokens).
  vocab_size: int = 0
  # A transformers GPT-2/Llama directory (config.json + model.safetensors):
  # a new run starts from its weights and takes its shape (preset ignored).
  init_from: str = ''
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


@dataclasses.dataclass(slots=True)
class CommonOptimizerConfig:
  """The optimizer keys every method shares."""
  name: str = 'adamw'  # A name in methods.names().
  lr: float = 3e-4  # Peak learning rate.
  warmup_steps: int = 100  # Linear warmup from 0.
  decay: str = 'cosine'  # After warmup: one of methods.DECAYS.
  min_lr_ratio: float = 0.1  # Cosine decays to lr * min_lr_ratio.
  b1: float = _common.B1  # First-moment decay.
  b2: float = _common.B2  # Second moment (AdamS: previous m squared) weight.
  eps: float = _common.EPS  # Added to the direction's denominator.
  weight_decay: float = _common.WEIGHT_DECAY  # Decoupled weight decay.
  clip_norm: float = _common.CLIP_NORM  # Global-norm clip; 0 disables it.


# The common keys plus one section per registered method that has its own.
OptimizerConfig = dataclasses.make_dataclass(
    'OptimizerConfig',
    [(spec.name, spec.section, dataclasses.field(default_factory=spec.section))
     for spec in methods.REGISTRY.values() if spec.section is not None],
    bases=(CommonOptimizerConfig,), slots=True)


@dataclasses.dataclass(slots=True)
class DataConfig:
  corpus: str = 'shakespeare'  # shakespeare | synthetic | a directory.
  tokenizer: str = 'byte'  # 'byte' or a path to a HF tokenizer.json.
  seq_len: int = 128  # Tokens per sequence.
  batch_size: int = 32  # Global batch (sequences per step).
  micro_batches: int = 1  # Sequential micro-batches per worker (accumulation).
  # Where the corpus is prepared; '' = <cache>/data/<corpus-name>-<tokenizer-
  # name>, <cache> = $SCAPE_JAX_CACHE or ~/.cache/scape_jax (not the current
  # directory). Several hosts: a directory they share, or one per host.
  data_dir: str = ''


@dataclasses.dataclass(slots=True)
class MeshConfig:
  replica: int = 1  # Replica groups (methods with one model copy per group).
  data: int = -1  # Data-parallel workers; -1: all devices the others leave.
  fsdp: int = 1  # Parameters and optimizer state split over this many.
  nodes: int = 1  # Nodes the fsdp group spans (mesh axis 'node'); divides fsdp.
  tensor: int = 1  # Reserved: only 1.


@dataclasses.dataclass(slots=True)
class FcdpConfig:
  """FCDP on top of mesh.fsdp > 1; each switch alone or together
  (scape_jax/sharding/fcdp.py). All off: ZeRO-3 per-unit gathers."""
  host_cache: bool = False  # Backward pass reads forward gathers from host.
  hierarchical: bool = False  # Gather over 'node', then within the node.
  lora_aware: bool = False  # Frozen LoRA base weights gathered once, on host.


@dataclasses.dataclass(slots=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optimizer: OptimizerConfig = dataclasses.field(
      default_factory=OptimizerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  fcdp: FcdpConfig = dataclasses.field(default_factory=FcdpConfig)
  steps: int = 1000  # Optimizer updates in the whole run.
  seed: int = 0  # Model initialisation and data order.
  log_every: int = 10  # Steps between fetches of the metrics.
  eval_every: int = 100  # Steps between evaluations; 0: only at the end.
  eval_batches: int = 8  # Batches of the validation split per evaluation.
  ckpt_every: int = 0  # Steps between checkpoints; 0: only at the end.
  keep_checkpoints: int = 3  # The newest this many are kept.
  # A step whose loss or gradient norm is not finite is skipped (params and
  # state unchanged); this many in a row stop the run.
  max_bad_steps: int = 10
  out_dir: str = 'runs/default'  # Checkpoints, metrics and plots.
  # JAX's persistent compilation cache, from which a restart loads its
  # programs: under out_dir unless absolute (runs may share it); 'auto':
  # JAX_COMPILATION_CACHE_DIR if set, else out_dir/xla_cache.
  compile_cache: str = 'auto'
  # A device's peak FLOP/s in TFLOP/s, for the MFU the run reports; 0: from
  # the device kind (train/flops.py), none where it is not known (CPU).
  peak_tflops: float = 0.0


# ----------------------------------------------------------------------------
# Typed assignment.


def _field_types(obj: Any) -> dict[str, type]:
  hints = typing.get_type_hints(type(obj))
  return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _join(prefix: str, key: str) -> str:
  return f'{prefix}.{key}' if prefix else key


def _unknown_key(obj: Any, prefix: str, key: str) -> ConfigError:
  allowed = ', '.join(_field_types(obj))
  where = f"'{prefix}'" if prefix else 'the top level'
  hint = ''
  if isinstance(obj, CommonOptimizerConfig):  # a method's own key?
    owners = [n for n, t in _field_types(obj).items()
              if dataclasses.is_dataclass(t) and key in _field_types(
                  getattr(obj, n))]
    if owners:
      hint = ('; it is a method\'s own key: ' +
              ' or '.join(f"'{prefix}.{n}.{key}'" for n in owners))
  return ConfigError(f"unknown config key '{_join(prefix, key)}'; "
                     f'allowed keys at {where}: {allowed}{hint}')


def _type_error(key: str, value: Any, typ: type) -> ConfigError:
  return ConfigError(f'config key {key!r}: expected {typ.__name__}, '
                     f'got {value!r}')


def _parse_int(key: str, value: Any) -> int:
  if isinstance(value, bool):
    raise _type_error(key, value, int)
  if isinstance(value, int):
    return value
  if isinstance(value, str):
    text = value.strip()
    try:
      return int(text)
    except ValueError:
      pass
    try:
      number = float(text)  # '1e3' is fine, '1.5' is not.
    except ValueError:
      raise _type_error(key, value, int) from None
    if math.isfinite(number) and number.is_integer():
      return int(number)
  elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
    return int(value)
  raise _type_error(key, value, int)


def _parse_float(key: str, value: Any) -> float:
  """A finite float: no config value means anything at NaN or infinity."""
  number = None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    number = float(value)
  elif isinstance(value, str):
    try:
      number = float(value.strip())
    except ValueError:
      pass
  if number is None:
    raise _type_error(key, value, float)
  if not math.isfinite(number):
    raise ConfigError(f'config key {key!r}: expected a finite number, got '
                      f'{value!r}')
  return number


def _parse_bool(key: str, value: Any) -> bool:
  if isinstance(value, bool):
    return value
  if isinstance(value, str):
    text = value.strip().lower()
    if text in ('true', '1'):
      return True
    if text in ('false', '0'):
      return False
  raise _type_error(key, value, bool)


def _parse_str(key: str, value: Any) -> str:
  if isinstance(value, str):
    return value
  raise _type_error(key, value, str)


def _parse_names(key: str, value: Any) -> list[str]:
  """A list of names: a list/tuple of strings or 'a,b,c' (command line)."""
  if isinstance(value, str):
    return [v.strip() for v in value.split(',') if v.strip()]
  if isinstance(value, (list, tuple)) and all(isinstance(v, str)
                                              for v in value):
    return list(value)
  raise ConfigError(f'config key {key!r}: expected a list of names (or '
                    f"'a,b' on the command line), got {value!r}")


_PARSERS = {int: _parse_int, float: _parse_float, bool: _parse_bool,
            str: _parse_str, list[str]: _parse_names}


def _set_leaf(obj: Any, prefix: str, key: str, value: Any) -> None:
  """Parses `value` by the type of field `key` of `obj` and assigns it."""
  full = _join(prefix, key)
  typ = _field_types(obj)[key]
  if dataclasses.is_dataclass(typ):
    raise ConfigError(f'config key {full!r} is a section with keys '
                      f'{", ".join(_field_types(getattr(obj, key)))}; '
                      f'assign a dict (in a file) or set {full}.KEY, '
                      f'not {value!r}')
  if isinstance(value, Mapping):
    raise ConfigError(f'config key {full!r} is a leaf ({typ.__name__}), '
                      f'not a section; cannot assign the dict {dict(value)!r}')
  setattr(obj, key, _PARSERS[typ](full, value))


def _apply(obj: Any, prefix: str, values: Mapping[str, Any]) -> None:
  """Recursively applies a (nested) mapping of values onto dataclass `obj`."""
  types_ = _field_types(obj)
  for key, value in values.items():
    if not isinstance(key, str) or key not in types_:
      raise _unknown_key(obj, prefix, str(key))
    if dataclasses.is_dataclass(types_[key]):
      if not isinstance(value, Mapping):
        _set_leaf(obj, prefix, key, value)  # Raises: a section needs a dict.
      _apply(getattr(obj, key), _join(prefix, key), value)
    else:
      _set_leaf(obj, prefix, key, value)


def _set_dotted(cfg: Config, dotted: str, value: str) -> None:
  """Sets one dotted key, e.g. 'optimizer.lr', from its string value."""
  parts = dotted.split('.')
  obj, prefix = cfg, ''
  for part in parts[:-1]:
    types_ = _field_types(obj)
    if part not in types_:
      raise _unknown_key(obj, prefix, part)
    if not dataclasses.is_dataclass(types_[part]):
      raise ConfigError(f'config key {_join(prefix, part)!r} is a leaf '
                        f'({types_[part].__name__}), not a section; '
                        f'cannot set {dotted!r}')
    obj, prefix = getattr(obj, part), _join(prefix, part)
  if parts[-1] not in _field_types(obj):
    raise _unknown_key(obj, prefix, parts[-1])
  _set_leaf(obj, prefix, parts[-1], value)


# ----------------------------------------------------------------------------
# Files and overrides.


def _read_file(path: str) -> dict[str, Any]:
  """Executes a config file; returns its public, non-module top-level names."""
  try:
    with open(path, encoding='utf-8') as f:
      source = f.read()
  except OSError as e:
    raise ConfigError(f'cannot read config file {path!r}: {e}') from e
  namespace: dict[str, Any] = {'__file__': path, '__name__': '__config__'}
  try:
    exec(compile(source, path, 'exec'), namespace)  # pylint: disable=exec-used
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'error executing config file {path!r}: '
                      f'{type(e).__name__}: {e}') from e
  return {k: v for k, v in namespace.items()
          if not k.startswith('_') and not isinstance(v, types.ModuleType)}


def _split_overrides(overrides: Sequence[str]) -> list[tuple[str, str]]:
  """Turns argv-style overrides into (dotted key, string value) pairs."""
  pairs, i = [], 0
  while i < len(overrides):
    item = overrides[i]
    if not item.startswith(_PREFIX) or len(item) == len(_PREFIX):
      raise ConfigError(f'bad override {item!r}: expected '
                        f'{_PREFIX}KEY=VALUE or {_PREFIX}KEY VALUE')
    body = item[len(_PREFIX):]
    if '=' in body:
      key, value = body.split('=', 1)
      i += 1
    elif i + 1 < len(overrides) and not overrides[i + 1].startswith('--'):
      key, value = body, overrides[i + 1]
      i += 2
    else:
      raise ConfigError(f'override {item!r} has no value: expected '
                        f'{_PREFIX}KEY=VALUE or {_PREFIX}KEY VALUE')
    if not key or '' in key.split('.'):
      raise ConfigError(f'bad override {item!r}: empty key in {key!r}; '
                        f'expected {_PREFIX}KEY=VALUE')
    pairs.append((key, value))
  return pairs


def load(path: str | None, overrides: Sequence[str] = ()) -> Config:
  """Builds a validated config from defaults, a config file and overrides.

  Args:
    path: a Python config file (see the module docstring) or the name of a
      preset (`presets.resolve`), or None for the defaults alone.
    overrides: argv items '--config.KEY=VALUE' (or '--config.KEY', 'VALUE'),
      applied after the file, in order; KEY is dotted, e.g. 'optimizer.lr'.

  Returns:
    The config.

  Raises:
    ConfigError: unknown key, badly typed value, unreadable file or an
      out-of-range setting (see `validate`).
  """
  cfg = Config()
  if path is not None:
    try:
      path = presets.resolve(path)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    _apply(cfg, '', _read_file(path))
  for key, value in _split_overrides(overrides):
    _set_dotted(cfg, key, value)
  validate(cfg)
  return cfg


# ----------------------------------------------------------------------------
# Validation.


def _raised(fn, *args) -> list[str]:
  """[message] if `fn(*args)` raises ValueError, else []."""
  try:
    fn(*args)
  except ValueError as e:
    return [str(e).rstrip('.')]
  return []


def _optimizer_problems(cfg: Config) -> list[str]:
  """The common keys by the optimizers' own checks, then the methods.

  The method named by `optimizer.name`, and every method with a section of
  its own, is built (nothing is allocated): each section is checked by the
  code that will use it, also when another method is selected.
  """
  o = cfg.optimizer
  problems = [
      message for ok, message in [
          (o.name in methods.names(), f'optimizer.name must be one of '
           f'{methods.names()}, got {o.name!r}'),
          (o.lr > 0, f'optimizer.lr must be > 0, got {o.lr}'),
          (o.warmup_steps >= 0,
           f'optimizer.warmup_steps must be >= 0, got {o.warmup_steps}'),
          (o.decay in DECAYS,
           f'optimizer.decay must be one of {DECAYS}, got {o.decay!r}'),
          (0 <= o.min_lr_ratio <= 1, f'optimizer.min_lr_ratio must be in '
           f'[0, 1], got {o.min_lr_ratio}'),
          (o.clip_norm >= 0, f'optimizer.clip_norm must be >= 0 (0 disables '
           f'clipping), got {o.clip_norm}'),
      ] if not ok]
  problems += _raised(_common.check_betas, 'optimizer', o.b1, o.b2)
  problems += _raised(_common.check_eps, 'optimizer', o.eps)
  problems += _raised(_common.check_non_negative, 'optimizer',
                      'weight_decay', o.weight_decay)
  if problems:
    return problems
  # steps < 1 is reported by _problems, once; not again by each method that
  # derives a schedule from it.
  steps = max(cfg.steps, 1)
  for name, spec in methods.REGISTRY.items():
    if name == o.name or spec.section is not None:  # every own key checked
      selected = dataclasses.replace(o, name=name)
      problems += [f'optimizer.{name}: {message}' for message in
                   _raised(methods.build, selected, steps)]
  if problems:
    return problems
  if cfg.steps >= 1:  # what has no effect in a run of that many steps
    problems += methods.no_effect(o, cfg.steps)
  fp32_replica = any(spec.name == 'scape' and section.fp32_replica
                     for spec, section in methods.selected(o))
  if fp32_replica and cfg.model.param_dtype == 'float32':
    problems.append('optimizer.scape.fp32_replica=True needs low-precision '
                    "parameters (model.param_dtype='bfloat16'): with "
                    "'float32' it is a second copy of the same values")
  if fp32_replica and methods.get(o.name).per_replica:
    problems.append(
        f'optimizer.scape.fp32_replica=True inside optimizer.name='
        f'{o.name!r} is not supported: the replica is the inner SCAPE\'s '
        'authoritative copy of the parameters, which the outer sync does '
        'not set, so every group would go back to its own model after each '
        'sync; use fp32_replica with optimizer.name=\'scape\'')
  return problems


def _problems(cfg: Config) -> list[str]:
  """Returns a message per out-of-range setting (NaN fails every check)."""
  d, m = cfg.data, cfg.mesh
  checks = [
      (cfg.steps > 0, f'steps must be > 0, got {cfg.steps}'),
      # (the model's init key is 32 bits: 2**32 would repeat seed 0's)
      (0 <= cfg.seed < 2**32, f'seed must be in [0, 2**32), got {cfg.seed}'),
      (cfg.log_every > 0, f'log_every must be > 0, got {cfg.log_every}'),
      (bool(cfg.compile_cache), "compile_cache must be 'auto' or a "
       "directory, got ''"),
      (cfg.peak_tflops >= 0,
       f'peak_tflops must be >= 0 (0: from the device kind), got '
       f'{cfg.peak_tflops}'),
      (cfg.eval_every >= 0, f'eval_every must be >= 0, got {cfg.eval_every}'),
      (cfg.eval_batches >= 1,
       f'eval_batches must be >= 1, got {cfg.eval_batches}'),
      (cfg.ckpt_every >= 0, f'ckpt_every must be >= 0, got {cfg.ckpt_every}'),
      (cfg.keep_checkpoints >= 1, f'keep_checkpoints must be >= 1, got '
       f'{cfg.keep_checkpoints}'),
      (cfg.max_bad_steps >= 1,
       f'max_bad_steps must be >= 1, got {cfg.max_bad_steps}'),
      (cfg.model.attn_impl in models.layers.ATTN_IMPLS,
       f'model.attn_impl must be one of {models.layers.ATTN_IMPLS}, got '
       f'{cfg.model.attn_impl!r}'),
      (cfg.model.dtype in DTYPES,
       f'model.dtype must be one of {DTYPES}, got {cfg.model.dtype!r}'),
      # cuDNN's flash attention takes only 16- or 8-bit inputs.
      (cfg.model.attn_impl != 'cudnn' or cfg.model.dtype == 'bfloat16',
       f"model.attn_impl='cudnn' needs model.dtype='bfloat16', got "
       f"{cfg.model.dtype!r}; use attn_impl='xla' or 'jax' for float32"),
      (cfg.model.param_dtype in DTYPES, f'model.param_dtype must be one of '
       f'{DTYPES}, got {cfg.model.param_dtype!r}'),
      (cfg.model.vocab_size >= 0, f'model.vocab_size must be >= 1, or 0 for '
       f"the preset's, got {cfg.model.vocab_size}"),
      (not (cfg.model.vocab_size and cfg.model.init_from),
       f'model.vocab_size={cfg.model.vocab_size} has no effect with '
       f'model.init_from={cfg.model.init_from!r}, whose config.json sets the '
       'vocabulary; drop model.vocab_size'),
      (bool(d.corpus), 'data.corpus must not be empty'),
      (bool(d.tokenizer), 'data.tokenizer must not be empty'),
      (d.seq_len > 0, f'data.seq_len must be > 0, got {d.seq_len}'),
      (d.batch_size > 0, f'data.batch_size must be > 0, got {d.batch_size}'),
      (d.micro_batches > 0,
       f'data.micro_batches must be > 0, got {d.micro_batches}'),
      (m.replica >= 1, f'mesh.replica must be >= 1, got {m.replica}'),
      (m.data == -1 or m.data >= 1,
       f'mesh.data must be >= 1 or -1 (all remaining devices), got {m.data}'),
      (m.fsdp >= 1, f'mesh.fsdp must be >= 1, got {m.fsdp}'),
      (m.tensor >= 1, f'mesh.tensor must be >= 1, got {m.tensor}'),
  ]
  problems = [message for ok, message in checks if not ok]
  return problems + _fcdp_problems(cfg) + _optimizer_problems(cfg)


def _fcdp_problems(cfg: Config) -> list[str]:
  """LoRA, mesh.nodes and the FCDP switches."""
  lora, m, f = cfg.model.lora, cfg.mesh, cfg.fcdp
  on = [k for k in ('host_cache', 'hierarchical', 'lora_aware')
        if getattr(f, k)]
  checks = [
      (lora.rank >= 1, f'model.lora.rank must be >= 1, got {lora.rank}'),
      (lora.alpha > 0, f'model.lora.alpha must be > 0, got {lora.alpha}'),
      (m.nodes >= 1, f'mesh.nodes must be >= 1, got {m.nodes}'),
      # (mesh.fsdp < 1 is reported by _problems)
      (m.nodes < 1 or m.fsdp < 1 or m.fsdp % m.nodes == 0,
       f'mesh.nodes={m.nodes} must divide mesh.fsdp={m.fsdp}'),
      (not on or m.fsdp > 1, f'fcdp.{on[0] if on else ""} needs the fsdp '
       f'layout (mesh.fsdp > 1), got mesh.fsdp={m.fsdp}'),
      (not f.hierarchical or m.nodes > 1, 'fcdp.hierarchical needs an fsdp '
       f'group over several nodes (mesh.nodes > 1), got mesh.nodes={m.nodes}'),
      (not f.lora_aware or bool(lora.targets), 'fcdp.lora_aware needs LoRA: '
       'set model.lora.targets'),
      (not (cfg.model.scan_layers and f.host_cache and f.hierarchical) or
       cfg.model.remat, 'model.scan_layers with fcdp.host_cache and '
       'fcdp.hierarchical needs model.remat=true (without it XLA:CPU aborts '
       "in the scanned backward pass's collectives)"),
  ]
  checks += [(bool(lora.targets), f'model.lora.{k}={getattr(lora, k)} has no '
              'effect without model.lora.targets (LoRA is off: every '
              'parameter trains); set the layers that get adapters')
             for k in ('rank', 'alpha') if methods.changed(lora, k)]
  return [message for ok, message in checks if not ok]


def validate(cfg: Config) -> None:
  """Raises ConfigError listing every out-of-range setting of `cfg`."""
  problems = _problems(cfg)
  if problems:
    raise ConfigError('invalid config:\n  ' + '\n  '.join(problems))


# ----------------------------------------------------------------------------
# Serialization.


def to_dict(cfg: Config) -> dict[str, Any]:
  """Returns the config as nested plain dicts (JSON-serializable)."""
  return dataclasses.asdict(cfg)


def flatten(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1} (`to_dict`'s sections as dotted keys)."""
  out = {}
  for key, value in tree.items():
    dotted = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(flatten(value, dotted + '.'))
    else:
      out[dotted] = value
  return out


def from_dict(d: Mapping[str, Any], check: bool = True) -> Config:
  """Inverse of `to_dict`; unknown keys raise, missing keys keep defaults.
  With `check`, the config is validated too (a checkpoint's saved config
  need not pass checks added since it was saved)."""
  cfg = Config()
  _apply(cfg, '', d)
  if check:
    validate(cfg)
  return cfg


def format(cfg: Config) -> str:  # pylint: disable=redefined-builtin
  """Returns a short readable dump: one line per section, then the rest.

  Of the methods' own sections only the one in use is shown.
  """
  lines, top = [], []

  def section(name: str, obj: Any) -> None:
    fields = [(g.name, getattr(obj, g.name)) for g in dataclasses.fields(obj)]
    lines.append(f'{name}: ' + ' '.join(
        f'{k}={v!r}' for k, v in fields if not dataclasses.is_dataclass(v)))
    for k, v in fields:  # of the methods' sections only the one in use
      if dataclasses.is_dataclass(v) and k == getattr(obj, 'name', k):
        section(f'{name}.{k}', v)

  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      section(f.name, value)
    else:
      top.append(f'{f.name}={value!r}')
  return '\n'.join(lines + ['run: ' + ' '.join(top)])
