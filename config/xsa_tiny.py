# The tiny model with exclusive self-attention, nothing else changed
exec(open("config/sa_tiny.py").read())
attn_type = "xsa"
