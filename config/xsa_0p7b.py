# XSA at 0.7B: the SA baseline with exclusive self-attention, nothing else changed
exec(open("config/sa_0p7b.py").read())
attn_type = "xsa"
