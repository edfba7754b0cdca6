# SA baseline at 2.7B non-embedding parameters (paper, Table 1)
exec(open("config/paper_recipe.py").read())
n_layer = 32
n_embd = 2560
n_head = 24
head_dim = 128  # attention width n_head * head_dim = 3072
learning_rate = 3e-4  # the paper's peak LR for this size (grid-searched for SA, reused for XSA); min_lr = 0.1x
batch_size = 4  # sequences per GPU per micro-step; gradient accumulation makes up the rest
parallelism = "fsdp"  # DDP needs ~97 GB per GPU at this size; FSDP ~53 GB (scripts/memory_plan.py, 8 GPUs)
attn_type = "sa"
