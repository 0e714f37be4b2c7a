# Llama-1.8B (H2O-Danube-1.8B shape) as profiled in the SCAPE paper: global
# batch 1024 x 2048 tokens on 32 GPUs, SCAPE at 1% density.
model = dict(preset='llama1.8b', remat=True)
# SCAPE mode: Algorithm 1, the paper's (local_adam=True: per-worker Adam).
optimizer = dict(name='scape', lr=2e-4, warmup_steps=2000, min_lr_ratio=0.1,
                 scape=dict(density=0.01, density_warmup_steps=1000))
data = dict(seq_len=2048, batch_size=1024, micro_batches=32)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/llama1.8b'
