"""train.py with every optimizer step SLOW_STEP_S seconds longer, for the runs stopped from outside
(test_resume_processes.py): over bytes a step takes milliseconds, and a signal sent once a few steps are logged
needs steps left to land in. The pause adds wall-clock time, not computation: the losses are train.py's.
Started in train.py's place (by python or torchrun), with train.py's arguments and the repo root on PYTHONPATH."""

import os
import runpy
import sys
import time

from pretrain import parallelize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

clip_grad_norm = parallelize.clip_grad_norm


def slow_clip_grad_norm(*args, **kwargs):  # called once per step, after the backward
    time.sleep(float(os.environ["SLOW_STEP_S"]))
    return clip_grad_norm(*args, **kwargs)


parallelize.clip_grad_norm = slow_clip_grad_norm
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
