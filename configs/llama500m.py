# Llama-500M (H2O-Danube3-500M shape) as in the SCAPE paper, Section V-B:
# SlimPajama-6B with the Llama tokenizer, 100k steps, global batch 1024 x 4096
# tokens on 32 GPUs, cosine lr 3e-4 -> 3e-5 after 2000 warmup steps, SCAPE at
# 1% density reached by exponential density warmup. Give the prepared corpus
# with --config.data.corpus=DIR. On GPUs add --config.model.attn_impl=cudnn.
model = dict(preset='llama500m', remat=True)
# SCAPE mode: Algorithm 1, the paper's (local_adam=True: per-worker Adam).
optimizer = dict(name='scape', lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1,
                 scape=dict(density=0.01, density_warmup_steps=1000))
data = dict(seq_len=4096, batch_size=1024, micro_batches=32)
mesh = dict(data=32)
steps = 100_000
eval_every = 1000
ckpt_every = 1000
out_dir = 'runs/llama500m'
