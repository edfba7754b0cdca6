"""train.py on a slow filesystem, for the process-group timeout tests: rank 0's single-file checkpoint write
(DDP: the other ranks wait for it in a collective) takes SLOW_CHECKPOINT_S seconds longer. Launched by
torchrun in train.py's place, with train.py's arguments and the repo root on PYTHONPATH."""

import os
import runpy
import sys
import time

from pretrain import checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

write = checkpointer.save_checkpoint


def slow_write(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_CHECKPOINT_S"]))
    return write(*args, **kwargs)


checkpointer.save_checkpoint = slow_write
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
