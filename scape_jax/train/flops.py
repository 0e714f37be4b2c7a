"""Model FLOPs and the devices' peaks: the run's MFU.

MFU (model FLOPs utilisation, PaLM's appendix B) is the model's training
FLOPs per second over the devices' peak. A decoder's training FLOPs per token
are 6 N (forward and backward through the N parameters of its matmuls,
embeddings included: the output projection reads them) plus 12 L d T for
attention's scores and values (L layers, width d, sequence T), as nanoGPT's
`estimate_mfu` counts them. Remat's recomputation is not counted: MFU is of
the model's FLOPs, not the hardware's.
"""

from typing import Optional

# Dense bf16 peak FLOP/s per device, by a substring of `device.device_kind`
# (first match wins: the more specific names first). The vendors' data sheets.
PEAK_FLOPS = (
    ('GH200', 989e12),
    ('H200', 989e12),
    ('H100 PCIe', 756e12),
    ('H100', 989e12),
    ('A100', 312e12),
    ('L4', 121e12),
    ('TPU v6', 918e12),
    ('TPU v5p', 459e12),
    ('TPU v5 lite', 197e12),
    ('TPU v5e', 197e12),
    ('TPU v4', 275e12),
)


def peak_flops(device_kind: str, override: float = 0.0) -> Optional[float]:
  """The peak FLOP/s of one device: `override` when > 0, else `PEAK_FLOPS`'
  entry for `device_kind`, else None (unknown, e.g. a CPU)."""
  if override > 0:
    return float(override)
  for name, flops in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None


def train_flops_per_token(params: int, n_layers: int, d_model: int,
                          seq_len: int) -> float:
  """6 N + 12 L d T: one token's forward and backward FLOPs."""
  return 6.0 * params + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_per_token: float,
        peak_per_device: Optional[float], devices: int) -> Optional[float]:
  """The fraction of the devices' peak the model's FLOPs reach (None where
  the peak is unknown)."""
  if not peak_per_device:
    return None
  return tokens_per_s * flops_per_token / (peak_per_device * devices)
