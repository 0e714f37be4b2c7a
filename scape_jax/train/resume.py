"""Resuming a run: the newest checkpoint that verifies, and config changes.

`restore_or_init` looks at the checkpoints in `out_dir/ckpt`, newest first.
A damaged one (`CorruptCheckpointError`: unreadable files, checksums or an
extras hash that differ) is moved to `ckpt.corrupt/<step>` (nothing is
deleted, and the step can be saved again) and the next older one is tried;
the run says which were skipped and why.

Before any array is read, the config the checkpoint was saved with is
compared with the current one, key by key (`config_changes`):

* `RESUME_SAFE_KEYS` (logging, evaluation and checkpoint intervals, where
  outputs go, rematerialisation, FCDP's placement) may change freely; the
  change is reported;
* `STRUCTURAL_KEYS` (method, model, mesh, seed, batch and sequence length)
  define the state's shapes or the data order: a change is refused,
  whatever the flag;
* any other change (learning rate, schedule, `steps`, a method's own keys,
  the corpus or tokenizer moved to another path, ...) is refused unless
  `allow_config_change` (`train.py --allow-config-change`); then it is
  reported and recorded in every later checkpoint's `config_history`. The
  data itself is checked by content when the data position is restored.

A key added to the config since the checkpoint was written is no change at
its default, and `PATH_KEYS` are compared as the files they name.
"""

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

import jax

from scape_jax.train import config as config_lib
from scape_jax.train import methods
from scape_jax.train import convert
from scape_jax.train.checkpoint import CheckpointError, Checkpointer
from scape_jax.train.checkpoint import CorruptCheckpointError

# Keys that change neither the state nor the numbers of the run.
# (Not eval_batches: the eval set changes with it, so the eval losses
# before and after a change would not compare; it needs the flag.)
RESUME_SAFE_KEYS = ('log_every', 'eval_every', 'ckpt_every',
                    'keep_checkpoints', 'peak_tflops',
                    'max_bad_steps', 'out_dir', 'compile_cache',
                    'data.data_dir', 'model.remat',
                    # Where SCAPE's state lives, and its layout (converted on
                    # restore; the numbers are the same up to rounding).
                    'optimizer.scape.offload', 'optimizer.scape.offload_kind',
                    'optimizer.scape.distributed',
                    # How SCAPE's warmup levels compile (the same numbers).
                    'optimizer.scape.shared_warmup',
                    # Where FCDP keeps and gathers the same numbers, and how
                    # the same fsdp group is split into nodes.
                    'fcdp.host_cache', 'fcdp.hierarchical', 'fcdp.lora_aware',
                    'mesh.nodes')
# Keys (or 'section.' prefixes) that fix the state's shapes or the data order.
# (`tests/test_resilience.py` checks that every other method key, and the
# model keys, keep the parameters' and the optimizer state's pytree and
# shapes.)
STRUCTURAL_KEYS = ('optimizer.name', 'optimizer.diloco.inner',
                   'optimizer.pier.inner', 'optimizer.scape.fp32_replica',
                   'optimizer.scape.dense_leaves',
                   'optimizer.scape.interleaved_leaves',
                   'optimizer.scape.local_adam', 'optimizer.radius.density',
                   'optimizer.radius.index_radius', 'model.preset',
                   'model.vocab_size', 'model.param_dtype',
                   'model.scan_layers', 'model.lora.rank',
                   'model.lora.targets', 'mesh.', 'seed', 'data.seq_len',
                   'data.batch_size')
# Paths compared as the files they name (a trailing slash, a relative path
# or a symlink is no change). Moved elsewhere they need the flag: the
# restore then checks the data by content (the corpus's sha256 in the saved
# data position; the tokenizer the corpus was made with against
# data.tokenizer).
PATH_KEYS = ('data.corpus', 'data.tokenizer')
# Safe only where the restore converts the state (`convert.converts_modes`);
# structural elsewhere, e.g. SCAPE inside DiLoCo.
CONVERTED_KEYS = ('optimizer.scape.distributed',)
_ABSENT = '(absent)'


@dataclasses.dataclass
class Resumed:
  """Where the run starts: step, state and the recorded config changes."""
  start: int
  params: Any
  opt_state: Any
  config_history: list
  # Steps before `start` whose update was skipped (not finite): the
  # optimizer's count at `start` is start - skipped.
  skipped: int = 0


def _unused_section(key: str, in_use: set) -> bool:
  """Whether `key` belongs to the own section of a method not in use."""
  parts = key.split('.')
  return (len(parts) > 2 and parts[0] == 'optimizer' and
          parts[1] not in in_use and parts[1] in methods.REGISTRY)


def _methods_in_use(cfg: Mapping[str, Any]) -> set:
  """`optimizer.name` and, for an outer method (DiLoCo, Pier), its inner
  method, whose section is in use too."""
  optimizer = cfg.get('optimizer', {})
  name = optimizer.get('name')
  section = optimizer.get(name, {})
  inner = section.get('inner') if isinstance(section, Mapping) else None
  return {name, inner} - {None}


def config_changes(saved: Mapping[str, Any],
                   current: Mapping[str, Any]) -> dict[str, tuple]:
  """{dotted key: (saved value, current value)} for every differing key.

  The sections of methods that neither config uses are left out. A key the
  saved config lacks (added to the config since) is no change when it has
  its default: the saved run did what the default does.
  """
  old, new = config_lib.flatten(saved), config_lib.flatten(current)
  defaults = config_lib.flatten(config_lib.to_dict(config_lib.Config()))
  in_use = _methods_in_use(saved) | _methods_in_use(current)
  changes = {}
  for key in sorted(old.keys() | new.keys()):
    if _unused_section(key, in_use):
      continue
    before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
    if before is _ABSENT and key in defaults and after == defaults[key]:
      continue
    if key in PATH_KEYS and same_path(before, after):
      continue
    if before != after:
      changes[key] = (before, after)
  return changes


def same_path(a, b) -> bool:
  """Whether `a` and `b` name one existing file or directory."""
  if not (isinstance(a, str) and isinstance(b, str) and os.path.exists(a)
          and os.path.exists(b)):
    return a == b
  return os.path.samefile(a, b)


def _is_structural(key: str) -> bool:
  return key not in RESUME_SAFE_KEYS and any(
      key == k or (k.endswith('.') and key.startswith(k))
      for k in STRUCTURAL_KEYS)


def _lines(changes: Mapping[str, tuple]) -> str:
  return ''.join(f'\n  {k}: {old!r} -> {new!r}'
                 for k, (old, new) in changes.items())


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any],
                 where: str, allow_change: bool) -> dict[str, tuple]:
  """The changes that need the flag; raises ConfigError if not allowed.

  Args:
    saved: the config the checkpoint was saved with (`config.to_dict`).
    current: the config of this run.
    where: the checkpoint, for messages.
    allow_change: accept changes of keys that are neither structural nor in
      `RESUME_SAFE_KEYS`.

  Returns:
    Every change (safe ones included), to report and record.
  """
  changes = config_changes(saved, current)
  converts = convert.converts_modes(current.get('optimizer', {}).get('name'))
  structural = {k: v for k, v in changes.items() if _is_structural(k) or (
      k in CONVERTED_KEYS and not converts)}
  if structural:
    raise config_lib.ConfigError(
        f'cannot resume {where} with this config: these keys fix the model, '
        f'the optimizer state or the data order and must stay as saved:'
        f'{_lines(structural)}\nUse another out_dir to start a new run.')
  flagged = {k: v for k, v in changes.items() if k not in RESUME_SAFE_KEYS}
  if flagged and not allow_change:
    raise config_lib.ConfigError(
        f'the config differs from the one {where} was saved with:'
        f'{_lines(flagged)}\nThese change what the run computes from here '
        'on. To resume with them anyway, pass --allow-config-change (the '
        'new values are recorded in the checkpoints); to keep the saved '
        'values, drop these overrides.')
  return changes


def _set_aside(ckpt: Checkpointer, skipped: list, start: int,
               say: Callable[[str], None]) -> None:
  for step, reason in skipped:
    moved = ckpt.set_aside(step)
    say(f'warning: {reason}\n  moved it to {moved}; resuming from step '
        f'{start}, the newest checkpoint that verifies')


def mesh_sizes(mesh: jax.sharding.Mesh) -> dict:
  """The mesh's axis sizes as the checkpoint extras record them (JSON)."""
  return {str(k): int(v) for k, v in mesh.shape.items()}


def _restore(program, ckpt: Checkpointer, step: int, target,
             saved_mesh: Optional[dict]) -> tuple:
  """`ckpt.restore`, or a SCAPE checkpoint of the other mode converted.

  When neither fits and the checkpoint was saved on another mesh, the error
  says so first."""
  try:
    try:
      return ckpt.restore(step, target)
    except CorruptCheckpointError:
      raise
    except CheckpointError as e:  # saved in the other SCAPE mode?
      return convert.restore_other_mode(program, ckpt, step, e)
  except CorruptCheckpointError:
    raise
  except CheckpointError as e:
    mesh = mesh_sizes(program.mesh)
    if saved_mesh is None or saved_mesh == mesh:
      raise
    differ = [line.strip() for line in str(e).split('\n')[1:]]
    example = f'; e.g. {differ[0]}' if differ else ''
    raise CheckpointError(
        f'checkpoint {ckpt.directory}/{step} was saved on a mesh of '
        f'{saved_mesh} devices per axis; this run has {mesh}. Its optimizer '
        "state does not fit (a method's per-worker state, such as SCAPE's "
        'residuals, is split over the workers and cannot be re-split): '
        f'resume on the same mesh{example}') from e


def check_state_fits(saved: Mapping[str, Any], cfg: config_lib.Config,
                     method, count: int, where: str) -> None:
  """Raises ConfigError if the state saved under config `saved` after
  `count` updates holds what another schedule chose than the one `method`
  (built from `cfg`) runs from there (`methods.Built.state_key`): e.g.
  SCAPE's masks chosen for one density and decoded at another, or Radius's
  sparse steps before any resample chose their masks."""
  old_cfg = config_lib.from_dict(saved, check=False)
  before = methods.build(old_cfg.optimizer, old_cfg.steps).state_key(count)
  after = method.state_key(count)
  if before != after:
    changed = {k: v for k, v in config_changes(saved, config_lib.to_dict(
        cfg)).items() if k not in RESUME_SAFE_KEYS}
    raise config_lib.ConfigError(
        f'cannot resume {where} with these changes:{_lines(changed)}\n'
        f'after its {count} updates the {method.name} state holds '
        f'{before}, but the new config would go on from there as from '
        f'{after}, and the state does not fit that. Keep the saved values '
        'of these keys up to that point, or use another out_dir to start '
        'a new run.')


def restore_or_init(cfg: config_lib.Config, program, ckpt: Checkpointer,
                    iterator, allow_config_change: bool = False,
                    say: Optional[Callable[[str], None]] = print) -> Resumed:
  """The newest checkpoint that verifies, else a new state (see module doc).

  Raises:
    ConfigError: the config changed in a way that is not allowed, the
      checkpoint is past `cfg.steps`, or the prepared corpus is not the one
      the checkpoint was trained on.
    CheckpointError: the checkpoints do not fit the program, or none of them
      verifies (then nothing is moved).
  """
  say = say or (lambda _: None)
  steps = ckpt.all_steps()
  if not steps:
    return Resumed(0, *program.init_state(), config_history=[])
  current = config_lib.to_dict(cfg)
  target = {'params': program.abstract_params, 'opt': program.abstract_opt}
  skipped = []
  for step in reversed(steps):
    where = f'checkpoint {ckpt.directory}/{step}'
    try:
      _, extras = ckpt.read_extras(step)
      changes = check_config(extras.get('config', {}), current, where,
                             allow_config_change)
      if step > cfg.steps:
        raise config_lib.ConfigError(
            f'{where} is past steps={cfg.steps}: the run has trained {step} '
            f'steps. Set steps >= {step} to go on from it, or use another '
            'out_dir for a shorter run.')
      skipped_steps = int(extras.get('skipped_steps', 0))
      if changes:
        check_state_fits(extras.get('config', {}), cfg, program.method,
                         step - skipped_steps, where)
      state, extras = _restore(program, ckpt, step, target,
                               extras.get('mesh'))
    except CorruptCheckpointError as e:
      skipped.append((step, str(e)))
      continue
    try:
      iterator.set_state(extras['data'])
    except (KeyError, ValueError) as e:
      raise config_lib.ConfigError(
          f'{where}: cannot restore the data position: {e}') from e
    _set_aside(ckpt, skipped, step, say)
    saved_mesh, mesh = extras.get('mesh'), mesh_sizes(program.mesh)
    if saved_mesh is not None and saved_mesh != mesh:
      say(f'resuming step {step}, saved on a mesh of {saved_mesh} devices '
          f'per axis, on this run\'s {mesh}: the state is re-sharded; the '
          'global batch and the data order are the same')
    history = list(extras.get('config_history', []))
    if changes:
      say(f'resuming step {step} with config changes:{_lines(changes)}')
      history.append({'step': step, 'changes': {
          k: list(v) for k, v in changes.items()}})
    return Resumed(step, state['params'], state['opt'], history,
                   skipped_steps)
  raise CorruptCheckpointError(
      f'no checkpoint in {ckpt.directory} verifies:' +
      ''.join(f'\n  step {s}: {reason}' for s, reason in skipped) +
      '\nNothing was moved. Move the directory away to start a new run.')
