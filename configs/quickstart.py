# Quickstart: a tiny GPT-2 trained on 2 CPU cores in under a minute and a half, no GPU and no network.
#   python train_gpt2.py configs/quickstart.py
# On first run it builds its corpus in data/python/ from what ships with Python: the help() topic pages
# and the standard library's .py sources (~4.3M GPT-2 tokens, 0.25% of them val, taken along the whole
# corpus), through fineweb.py, in a few seconds.
# On our 2-core CPU the val loss goes 10.61 -> 4.87 -> 4.38 -> 4.23 -> 4.08 (every 40 steps; AdamW alone, the
# optimizer before Muon, ends at 4.61 on the same split and order: dev/muon.md), the first run from a fresh
# clone takes about a minute with nothing else running (corpus included), and the samples from "def" have
# indentation, if, else:, yield and names in roughly the right places.
# The issue-33 levers (dev/recipe.md) are on: without them (cosine to min_lr 6e-4, GPT-2's init, one lr for
# all of AdamW's groups; c_attn split as q, k, v in both) it ends at 4.13 / 4.15 (seeds 1337 / 1), with them
# at 4.08 / 4.09.
data_dir = "data/python"
data_source = "python"
out_dir = "out/quickstart"
n_layer = 4
n_head = 4
n_embd = 64  # the 50304-way output layer is most of the cost: a narrow model takes more steps in the time
block_size = 128
vocab_size = 50304
micro_batch_size = 8
seq_len = 128
total_batch_size = 1024
max_steps = 160
warmup_steps = 16
optimizer = "muon"  # Muon on the blocks' matrices: val 4.08 at step 160 where AdamW alone ends at 4.61 (dev/muon.md)
muon_lr = 1.2e-2  # (6e-3: 4.17)
max_lr = 6e-3  # AdamW's, on the embeddings, the tied head, biases and norms
min_lr = 0.0  # to zero...
lr_schedule = "wsd"  # ...flat after warmup, then linear over the last 20% (cooldown_frac)
embed_lr_mult = 3.0  # AdamW's lr x 3 on the embeddings (the tied head too)
scalar_lr_mult = 3.0  # and on biases and layer-norm gains
zero_init_proj = True  # attn.c_proj and mlp.c_proj start at zero
eval_interval = 40
val_steps = 9  # 72 of the val split's 83 rows of 129 tokens: nearly all of it
hellaswag_interval = 0
sample_interval = 160
sample_tokens = 48
num_samples = 3
sample_prompt = "def"
checkpoint_interval = 0
resume = "auto"  # Ctrl-C saves a checkpoint; the same command then continues from it
