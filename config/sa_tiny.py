# A tiny SA model for CPU (scripts/quickstart.sh, scripts/small_study.sh): 120 steps of 2,048 tokens
# in under 2 minutes on 2 idle cores (0.8 s a step, most of it in the output layer over 50,304 tokens).
# Runs unchanged on 1 or 2 processes: total_batch_size = 2 x batch_size x block_size.
data_dir = "data/fineweb/fineweb_tiny"  # as scripts/tiny_data.sh makes it: the val split holds val_tokens + 1
n_layer = 4
n_head = 4
n_embd = 128
head_dim = 32
block_size = 128
batch_size = 8
total_batch_size = 2 * 8 * 128
learning_rate = 2e-3
max_iters = 120
warmup_iters = 12
eval_interval = 40
val_tokens = 16_384
log_interval = 10
checkpoint_interval = 40
dtype = "float32"
compile = False
attn_type = "sa"
