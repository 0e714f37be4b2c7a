"""What a run says before it trains: one line of what is being trained, and
after it one row per program of the bytes each step sends."""

import dataclasses

from scape_jax import analysis
from scape_jax.train import methods
from scape_jax.train.config import Config
from scape_jax.train.program import Program, model_name, param_count


def method_line(cfg: Config) -> str:
  """The method and its settings that differ from the defaults, e.g.
  'scape (density=0.05, density_warmup_steps=50)'; an outer method's inner
  method in brackets after it."""
  parts = []
  for spec, section in methods.selected(cfg.optimizer):
    keys = [] if section is None else [
        f'{f.name}={getattr(section, f.name)}'
        for f in dataclasses.fields(section)
        if methods.changed(section, f.name)]
    parts.append(spec.name + (f' ({", ".join(keys)})' if keys else ''))
  return ' over '.join(parts)


def banner(cfg: Config, program: Program) -> str:
  """One line: model, parameters, method, mesh and devices, batch, steps."""
  mesh = ' '.join(f'{k}={v}' for k, v in program.mesh.shape.items() if v > 1)
  devices = program.mesh.devices.size
  kind = program.mesh.devices.flat[0].platform
  tokens = cfg.data.batch_size * cfg.data.seq_len
  return (f'training {model_name(cfg)} ({param_count(program):,} '
          f'parameters) with {method_line(cfg)}, lr {cfg.optimizer.lr:g}, on '
          f'{devices} {kind} device{"s" if devices > 1 else ""} (mesh '
          f'{mesh or "of one"}); global batch {cfg.data.batch_size} x '
          f'{cfg.data.seq_len} = {tokens:,} tokens per step, {cfg.steps:,} '
          'steps')


def bytes_table(rows: list) -> str:
  """[(static arguments, steps that run it, collectives)] -> one row each:
  the program, its steps, and the bytes a device sends per step."""
  lines = [f'{"program":<36}  {"steps":>9}  MB sent/step/device',
           f'{"-" * 36}  {"-" * 9}  {"-" * 19}']
  for key, steps, cols in rows:
    name = ', '.join(f'{k}={v}' for k, v in key) or 'the train step'
    lines.append(f'{name:<36}  {steps:>9,}  '
                 f'{analysis.bytes_sent(cols) / 1e6:>19.6f}')
  return '\n'.join(lines)
