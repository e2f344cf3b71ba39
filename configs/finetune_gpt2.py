# Fine-tune OpenAI's GPT-2 124M on FineWeb-Edu: start from the released weights (downloaded from the
# Hugging Face hub on first use; or a local save_pretrained directory), a short run at a low
# learning rate. The model's shape (and its 50257-token vocabulary) comes from the weights.
#   python train_gpt2.py configs/finetune_gpt2.py
#   python train_gpt2.py configs/finetune_gpt2.py --init_from=gpt2-medium --micro_batch_size=16
# micro-batch 64 x 1024 by default (80 GB GPUs; set micro_batch_size lower elsewhere): 2 accumulation steps.
init_from = "gpt2"
data_dir = "edu_fineweb10B"
out_dir = "out/finetune_gpt2"
total_batch_size = 131072
max_steps = 2000
warmup_steps = 100
max_lr = 6e-5
min_lr = 6e-6
weight_decay = 0.1
eval_interval = 100
hellaswag_interval = 250
sample_interval = 250
checkpoint_interval = 500
checkpoint_minutes = 60  # and after each hour of training (5000 steps of 124M take ~1 day on a T4)
keep_last = 2  # older checkpoints are deleted once a newer one is in place
resume = "auto"  # the same command continues the run in out_dir after Ctrl-C, a kill or a time_limit
