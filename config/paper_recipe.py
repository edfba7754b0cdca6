# The paper's training recipe, shared by every size (docs/training.md, "The paper's configs"):
# FineWeb-100BT, context 2048, 524,288 tokens per step, 200K steps (~100B tokens, one epoch),
# AdamW with 2K warmup and cosine decay to 0.1x of the peak learning rate, bf16, compiled.
data_dir = "data/fineweb/fineweb100B"
block_size = 2048
total_batch_size = 524_288  # 256 sequences of 2048 tokens
max_iters = 200_000
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = "bfloat16"
compile = True
eval_interval = 1000
val_tokens = 10_485_760  # 5,120 validation sequences per evaluation
log_interval = 10
checkpoint_interval = 2000
wandb_log = True
wandb_project = "xsa"
# in-loop evaluation (docs/training.md): the 8 zero-shot tasks on their first 500 examples 40 times over the run,
# the similarity bias at every evaluation (similarity_interval defaults to eval_interval)
downstream_interval = 5000
downstream_limit = 500
