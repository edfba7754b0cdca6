# SA baseline at 1.4B non-embedding parameters (paper, Table 1)
exec(open("config/paper_recipe.py").read())
n_layer = 24
n_embd = 2048
n_head = 24
head_dim = 128  # attention width n_head * head_dim = 3072
learning_rate = 4e-4  # the paper's peak LR for this size (grid-searched for SA, reused for XSA); min_lr = 0.1x
batch_size = 4  # sequences per GPU per micro-step: the largest that fits 80 GB under DDP (scripts/memory_plan.py)
attn_type = "sa"
