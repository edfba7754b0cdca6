# XSA at 1.4B: the SA baseline with exclusive self-attention, nothing else changed
exec(open("config/sa_1p4b.py").read())
attn_type = "xsa"
