# GPT-2 774M (gpt2-large's shape) on FineWeb-Edu 10B tokens. Learning rate from the GPT-3 paper's
# table 2.1 (GPT-3 Large, 760M: 2.5e-4, 0.5M-token batches); warmup over 375M tokens as there.
#   torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_774m.py
# micro_batch_size 16 fits an 80 GB GPU; halve it for 40 GB (more accumulation, same total batch).
data_dir = "edu_fineweb10B"
out_dir = "out/gpt2_774m"
n_layer = 36
n_head = 20
n_embd = 1280
vocab_size = 50304
micro_batch_size = 16
total_batch_size = 524288
max_steps = 19073
warmup_steps = 715
max_lr = 2.5e-4
min_lr = 2.5e-5
eval_interval = 250
hellaswag_interval = 500
sample_interval = 500
checkpoint_interval = 2000
checkpoint_minutes = 60  # and after each hour of training (5000 steps of 124M take ~1 day on a T4)
keep_last = 2  # older checkpoints are deleted once a newer one is in place
resume = "auto"  # the same command continues the run in out_dir after Ctrl-C, a kill or a time_limit
