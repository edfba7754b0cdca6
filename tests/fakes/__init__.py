"""Stand-ins for what the tests cannot use for real: programs (torchrun, nvidia-smi, Slurm's commands, a
training), which tests copy into a bin directory put first on PATH, and services (hub.py: a Hugging
Face Hub out of reach), which tests import."""
