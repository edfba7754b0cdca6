# SA baseline at 0.7B non-embedding parameters (paper, Table 1)
exec(open("config/paper_recipe.py").read())
n_layer = 24
n_embd = 1536
n_head = 6
head_dim = 256  # attention width n_head * head_dim = 1536
learning_rate = 5e-4  # the paper's peak LR for this size (grid-searched for SA, reused for XSA); min_lr = 0.1x
batch_size = 8  # sequences per GPU per micro-step: the largest that fits 80 GB under DDP (scripts/memory_plan.py)
attn_type = "sa"
