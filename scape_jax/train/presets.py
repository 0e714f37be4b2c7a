"""The config presets: `--config NAME` from any directory.

The presets are `configs/*.py` at the top of a checkout; the wheel installs
them as `scape_jax/configs/` (pyproject.toml's package-dir), so that
`scape-train --config llama500m` works wherever scape-jax is installed.
"""

import os


def preset_dir() -> str:
  """The directory of the presets: `scape_jax/configs/` in an installed
  wheel, `configs/` at the top of a checkout."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  installed = os.path.join(package, 'configs')
  if os.path.isdir(installed):
    return installed
  return os.path.join(os.path.dirname(package), 'configs')


def names() -> list[str]:
  """The presets' names (`llama500m`, ...), sorted."""
  try:
    files = os.listdir(preset_dir())
  except OSError:
    return []
  return sorted(f[:-3] for f in files
                if f.endswith('.py') and not f.startswith('_'))


def resolve(config: str) -> str:
  """The config file that `--config` names: a path to a file, or a preset's
  name (`llama500m` or `llama500m.py`).

  Raises:
    ValueError: neither a file nor a preset; the message lists the presets.
  """
  if os.path.isfile(config):
    return config
  name = config[:-3] if config.endswith('.py') else config
  if name in names():
    return os.path.join(preset_dir(), f'{name}.py')
  raise ValueError(f'--config {config!r} is neither a config file nor a '
                   f'preset; the presets are {", ".join(names())} (or give '
                   'the path to a config file)')
