"""
The guards that judge every training step from its loss, before the update: a non-finite loss or gradient
(skipped, then a stop), a spike above the run's floor (not checkpointed; a run of them stops the run), and
a stop signal shared by all processes so that all stop after the same step. train.py's TrainStep asks them
for each step's verdict, a StepResult; their state goes into every checkpoint (RunState.guards).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain import exits


@dataclass
class StepResult:
    loss: float  # mean over micro-steps and processes
    grad_norm: float  # global, before clipping
    spike: bool  # a finite loss far above the recent ones: this state is not checkpointed
    stop_signal: int | None  # a process got SIGTERM or SIGINT: the signal all processes agreed to stop for
    failure: str | None = None  # why the run must stop here (non-finite beyond the skips, diverged)

    @property
    def blew_up(self):
        """The weights this step started from gave a spike or a non-finite value."""
        return self.spike or not (math.isfinite(self.loss) and math.isfinite(self.grad_norm))


class Guards:
    """What stops a run rather than let it train on, judged on every step from its loss (averaged over
    the processes, so all decide alike) before the update:
    - a non-finite loss or gradient norm is never applied: skip_nonfinite_steps of them are skipped, one
      more stops the run without a checkpoint of that state;
    - a finite blow-up, which that check cannot see: a loss above loss_spike_factor x the run's floor +
      loss_spike_margin is a spike. The floor is the lowest value an exponential moving average of the
      losses (spikes left out) has reached, a slow statistic that a slow climb cannot drag up with it. A
      spiking step's state is not checkpointed, nor the checkpoint whose weights gave the spike kept
      (Checkpointer.judge); loss_spike_steps spikes in a row stop the run;
    - a stop signal (SIGTERM, SIGINT) that may reach the processes at different steps: shared through
      the same all-reduce, so every process stops after the same step with the same exit status.
    Their state goes into checkpoints, so a resumed run judges its steps as the uninterrupted one."""
    SMOOTHING = 0.9  # of the moving average: about the last 10 losses
    SETTLE = 3  # losses in the average before any is judged

    def __init__(self, c, runtime, stop_signals, log=None):
        self.c, self.runtime, self.stop_signals, self.log = c, runtime, stop_signals, log
        self.average, self.seen, self.floor = None, 0, math.inf  # of the non-spiking losses
        self.spikes_in_a_row = 0
        self.skipped = 0

    def threshold(self):
        """The loss above which a step is a spike; inf while too few losses have been seen, or when off."""
        if not self.c.loss_spike_factor or self.seen < self.SETTLE:
            return math.inf
        return self.c.loss_spike_factor * self.floor + self.c.loss_spike_margin

    def is_spike(self, loss):
        """Record this step's loss; True if it is a spike."""
        if loss > self.threshold():
            self.spikes_in_a_row += 1
            return True
        self.spikes_in_a_row = 0
        self.average = loss if self.average is None else self.SMOOTHING * self.average + (1 - self.SMOOTHING) * loss
        self.seen += 1
        if self.seen >= self.SETTLE:
            self.floor = min(self.floor, self.average)
        return False

    @property
    def diverged(self):
        return self.c.loss_spike_factor > 0 and self.spikes_in_a_row >= self.c.loss_spike_steps

    def judge(self, step, loss, grad_norm):
        """The step's StepResult, from its loss (a tensor on the device) and gradient norm; its failure says
        why the run must stop. One small all-reduce and host sync per step."""
        signalled = self.stop_signals.received if self.stop_signals else None
        votes = torch.tensor([float(signalled == signum) for signum in exits.SIGNALLED], device=loss.device)
        shared = torch.cat([loss.reshape(1), votes])
        if self.runtime.distributed:
            dist.all_reduce(shared)
            shared[0] /= self.runtime.world_size
        loss, votes = shared[0].item(), shared[1:].tolist()
        grad_norm = grad_norm.item()
        # SIGTERM wins over SIGINT: a scheduler's stop is the one a launcher must see
        agreed = [signum for signum, vote in zip(exits.SIGNALLED, votes) if vote > 0]
        result = StepResult(loss, grad_norm, spike=False, stop_signal=max(agreed) if agreed else None)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped += 1
            if self.skipped > self.c.skip_nonfinite_steps:
                result.failure = (
                    f"non-finite loss or gradient norm at step {step} (loss {loss}, grad norm {grad_norm}); "
                    f"stopping without writing a checkpoint of this state. The last checkpoint in "
                    f"{self.c.out_dir} is intact; lower learning_rate or raise warmup_iters")
            elif self.log:
                self.log.print(f"step {step}: non-finite loss or gradient, step skipped "
                               f"({self.skipped}/{self.c.skip_nonfinite_steps})")
            return result
        threshold = self.threshold()
        result.spike = self.is_spike(loss)
        if result.spike and self.log:
            self.log.print(f"step {step}: train loss {loss:.4g} is a spike (above {threshold:.4g} = "
                           f"loss_spike_factor x the run's floor {self.floor:.4g} + loss_spike_margin)")
        if self.diverged:
            result.failure = (
                f"train loss {loss:.4g} at step {step}: {self.spikes_in_a_row} steps in a row above {threshold:.4g} "
                f"(loss_spike_factor={self.c.loss_spike_factor:g} x the run's floor {self.floor:.4g} + "
                f"loss_spike_margin={self.c.loss_spike_margin:g}), the run diverged. Neither the spiking steps nor "
                f"the checkpoint whose weights gave the first spike were kept; the checkpoints in {self.c.out_dir} "
                f"(the best validation loss's among them) are intact; lower learning_rate or raise warmup_iters")
        return result

    def state_dict(self):
        return {"average": self.average, "seen": self.seen, "floor": self.floor, "in_a_row": self.spikes_in_a_row}

    def load_state_dict(self, state):
        if "recent" in state:  # a checkpoint of the earlier rule: its recent losses start the average
            recent = state["recent"]
            self.average, self.seen = (sum(recent) / len(recent), len(recent)) if recent else (None, 0)
            self.floor = self.average if self.seen >= self.SETTLE else math.inf
        else:
            self.average, self.seen, self.floor = state["average"], state["seen"], state["floor"]
        self.spikes_in_a_row = state["in_a_row"]
