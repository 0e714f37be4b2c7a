"""Exports a run's checkpoint as a `transformers` model directory.

  python -m scape_jax.export_hf --run runs/NAME --out DIR [--step N]
      [--tokenizer PATH | --no-tokenizer] [--force]

DIR gets `config.json` and `model.safetensors` (`LlamaForCausalLM` or
`GPT2LMHeadModel`) and the tokenizer files (`tokenizer.json`,
`tokenizer_config.json`), so that

  AutoModelForCausalLM.from_pretrained(DIR)
  AutoTokenizer.from_pretrained(DIR)

load it. The byte tokenizer is written as a byte-level BPE without merges
(ids are the UTF-8 bytes). The run's own config, saved in the checkpoint,
gives the model; only the parameters are read (of replica group 0 for
methods that keep one copy per group, as the trainer evaluates). They are
written in the run's parameter dtype; a run that computed in bfloat16 was
evaluated in bfloat16, which transformers' float32 forward pass does not
reproduce bit for bit. A LoRA run's adapters are merged into the base
weights (W + alpha / rank * A @ B, as PEFT's `merge_and_unload`), so DIR
holds a plain model that computes what the adapted one did.
"""

import argparse
import os
import shutil
import sys
import tempfile
from typing import Optional

import jax

from scape_jax import models
from scape_jax import hf
from scape_jax.train import config as config_lib
from scape_jax.train import methods
from scape_jax.train import program as program_lib
from scape_jax.train.checkpoint import Checkpointer, CheckpointError


def _abstract_params(cfg: config_lib.Config, init_from_config=None):
  """(model config, params target of the checkpoint on one device, replicas)."""
  model_cfg, shapes = program_lib.param_shapes(cfg, init_from_config)
  per_replica = methods.get(cfg.optimizer.name).per_replica
  lead = (cfg.mesh.replica,) if per_replica else ()
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype,
                                     sharding=device), shapes)
  return model_cfg, target, bool(lead)


class ExportError(ValueError):
  """An export that would write the wrong files or over other files."""


def _tokenizer_spec(cfg: config_lib.Config, extras: dict,
                    path: Optional[str]) -> str:
  """The tokenizer to write: `path`, else the run's; checked against the
  fingerprint the run recorded from its corpus (runs since it was added)."""
  spec = path or cfg.data.tokenizer
  recorded = (extras.get('tokenizer') or {}).get('sha256')
  if spec == 'byte':
    if recorded is not None:
      raise ExportError('the run trained on a corpus tokenized with a '
                        f'tokenizer.json (sha256 {recorded[:12]}...), not '
                        "'byte': give it with --tokenizer PATH")
    return spec
  if not os.path.isfile(spec):
    raise ExportError(
        f"the run's tokenizer {spec!r} is not found from here (a relative "
        'path is read from this directory): give its tokenizer.json with '
        '--tokenizer PATH, or --no-tokenizer to write the model alone')
  if recorded is not None:
    from scape_jax.data.tokenizer import fingerprint  # pylint: disable=g-import-not-at-top
    if fingerprint(spec) != recorded:
      raise ExportError(
          f'{spec!r} is not the tokenizer the run trained with (its sha256 '
          f'differs from the recorded {recorded[:12]}...): the file changed '
          'since; give the original with --tokenizer PATH')
  return spec


def _tokenizer_files(spec: str, out: str,
                     max_len: int) -> tuple[list[str], Optional[int]]:
  """Writes tokenizer `spec` to `out`; (files, end-of-document id)."""
  eos_id, eos_token = None, None
  if spec != 'byte':
    from scape_jax.data.tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
    try:
      tok = HFTokenizer(spec)
    except ValueError as e:  # not a tokenizer.json
      raise ExportError(str(e)) from None
    eos_id = tok.eos_id
    eos_token = None if eos_id is None else tok.decode([eos_id])
  files = hf.save_tokenizer(out, spec, max_len=max_len, eos_token=eos_token)
  return files, eos_id


def _check_out(run_dir: str, out_dir: str, force: bool) -> None:
  run, out = os.path.realpath(run_dir), os.path.realpath(out_dir)
  ckpt = os.path.join(run, 'ckpt')
  if (os.path.commonpath([run, out]) == out or
      os.path.commonpath([ckpt, out]) == ckpt):
    raise ExportError(
        f'--out {out_dir!r} holds the run {run_dir!r} or lies in its ckpt/: '
        'writing it would replace the run\'s checkpoints; choose a new '
        f'directory, e.g. {os.path.join(run_dir, "hf")!r}')
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ExportError(f'--out {out_dir!r} is a file, not a directory')
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
    raise ExportError(
        f'--out {out_dir!r} is not empty ({len(os.listdir(out_dir))} '
        'entries): choose a new directory, or --force to replace it')


def _replace_dir(new: str, out_dir: str) -> None:
  """Moves the finished directory `new` to `out_dir`, replacing it whole."""
  if not os.path.exists(out_dir):
    os.rename(new, out_dir)
    return
  old = new + '.old'
  os.rename(out_dir, old)
  os.rename(new, out_dir)
  shutil.rmtree(old)


def export(run_dir: str, out_dir: str, step: Optional[int] = None, *,
           tokenizer: Optional[str] = None, write_tokenizer: bool = True,
           force: bool = False) -> dict:
  """Writes the model of `run_dir`'s checkpoint to `out_dir`.

  The files are written into a new directory beside `out_dir`, which then
  takes its place: a failed export leaves `out_dir` as it was.

  Args:
    run_dir: the run's out_dir (with ckpt/).
    out_dir: the directory to write; it must not exist or be empty, unless
      `force`, which replaces it whole.
    step: the checkpoint step (default: the latest).
    tokenizer: a tokenizer.json in place of the run's `data.tokenizer` path.
    write_tokenizer: False writes the model alone.
    force: replace a non-empty `out_dir`.

  Returns:
    A summary: step, model class, files written, compute dtype.
  """
  _check_out(run_dir, out_dir, force)
  ckpt = Checkpointer(os.path.join(run_dir, 'ckpt'))
  step, extras = ckpt.read_extras(step)
  if 'config' not in extras:
    raise CheckpointError(f'checkpoint step {step} in {ckpt.directory} has no '
                          'saved config (extras["config"])')
  cfg = config_lib.from_dict(extras['config'])
  spec = (_tokenizer_spec(cfg, extras, tokenizer) if write_tokenizer
          else None)
  model_cfg, target, per_replica = _abstract_params(
      cfg, extras.get('init_from_config'))  # (runs from before: the dir)
  state, _ = ckpt.restore(step, {'params': target}, partial=True)
  params = jax.device_get(state['params'])
  if per_replica:
    params = jax.tree.map(lambda x: x[0], params)
  lora = cfg.model.lora
  if lora.targets:  # transformers gets the merged weights (PEFT's merge)
    params = models.lora.merge_adapters(params, lora.alpha / lora.rank)
  out_dir = os.path.abspath(out_dir)
  os.makedirs(os.path.dirname(out_dir), exist_ok=True)
  new = tempfile.mkdtemp(dir=os.path.dirname(out_dir),
                         prefix=f'.{os.path.basename(out_dir)}.tmp-')
  try:
    files, eos_id = ([], None) if spec is None else _tokenizer_files(
        spec, new, model_cfg.max_seq_len)
    hf.save_pretrained(new, model_cfg, params, bos_token_id=eos_id,
                       eos_token_id=eos_id)
    mask = _umask()  # mkdtemp's and safetensors' files are private
    for name in os.listdir(new):
      os.chmod(os.path.join(new, name), 0o666 & ~mask)
    os.chmod(new, 0o777 & ~mask)
    _replace_dir(new, out_dir)
  finally:
    if os.path.exists(new):
      shutil.rmtree(new)
  return {'step': step, 'model': hf.to_hf_config(model_cfg)['architectures'][0],
          'files': [hf.convert.CONFIG_FILE, hf.convert.WEIGHTS_FILE] + files,
          'compute_dtype': cfg.model.dtype}


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--run', required=True,
                      help='the run directory (its out_dir, with ckpt/)')
  parser.add_argument('--out', required=True, help='the output directory')
  parser.add_argument('--step', type=int, default=None,
                      help='the checkpoint step (default: the latest)')
  parser.add_argument('--force', action='store_true',
                      help='replace a non-empty --out directory')
  which = parser.add_mutually_exclusive_group()
  which.add_argument('--tokenizer', default=None, metavar='PATH',
                     help="a tokenizer.json in place of the run's "
                     'data.tokenizer (checked against the one it trained '
                     'with)')
  which.add_argument('--no-tokenizer', action='store_true',
                     help='write the model without tokenizer files')
  args = parser.parse_args(argv)
  try:
    summary = export(args.run, args.out, args.step, tokenizer=args.tokenizer,
                     write_tokenizer=not args.no_tokenizer, force=args.force)
  except (CheckpointError, config_lib.ConfigError, hf.ConversionError,
          ExportError, ImportError, OSError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {summary["model"]} of step {summary["step"]} to {args.out}: '
        f'{", ".join(summary["files"])}')
  if summary['compute_dtype'] != 'float32':
    print(f'note: the run computed in {summary["compute_dtype"]}; '
          'transformers will compute in the saved dtype', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
