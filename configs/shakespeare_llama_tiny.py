# The README demo: a tiny Llama on the Shakespeare plays, 8 simulated CPU
# devices, SCAPE at 5% density. Override anything with --config.KEY=VALUE.
model = dict(preset='llama-tiny', dtype='float32')
# SCAPE mode: Algorithm 1, the paper's (local_adam=True: per-worker Adam).
# Its warmup's sparse levels share one program: 4 compiles, not 9.
optimizer = dict(name='scape', lr=3e-3, warmup_steps=30,
                 scape=dict(density=0.05, density_warmup_steps=50,
                            shared_warmup=True))
data = dict(corpus='shakespeare', seq_len=128, batch_size=32)
mesh = dict(data=8)
steps = 300
eval_every = 100
log_every = 25
out_dir = 'runs/shakespeare_llama_tiny'
