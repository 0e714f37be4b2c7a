# Llama-1.8B (H2O-Danube-1.8B shape) with SCAPE at 1% density, 32 workers.
model = dict(preset='llama1.8b', remat=True)
optimizer = dict(name='scape', lr=2e-4, warmup_steps=2000, density=0.01,
                 density_warmup_steps=1000)
data = dict(seq_len=2048, batch_size=256)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/llama1.8b'
