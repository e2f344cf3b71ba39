# Quickstart: a tiny GPT-2 trained on 2 CPU cores in about a minute (longer on a busy machine), no GPU
# and no network needed.
#   python train_gpt2.py configs/quickstart.py
# On first run it builds its own corpus in data/quickstart/ from the help() pages that ship with Python
# (pydoc_data.topics, ~140K GPT-2 tokens: 20K for val, the rest train), through fineweb.py.
# Expect the val loss to fall from 10.76 to ~5.8, a checkpoint in out/quickstart/ and a few samples
# that look like Python documentation only from far away.
data_dir = "data/python"
data_source = "python"
out_dir = "out/quickstart"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
vocab_size = 50304
micro_batch_size = 8
seq_len = 128
total_batch_size = 1024
max_steps = 80
warmup_steps = 8
max_lr = 3e-3
min_lr = 3e-4
eval_interval = 20
val_steps = 4
hellaswag_interval = 0
sample_interval = 80
sample_tokens = 40
num_samples = 3
sample_prompt = "The for statement"
checkpoint_interval = 0
