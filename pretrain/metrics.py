"""
Run logging on the main process: stdout copied to <out_dir>/train.log, one JSON object per
logged step in <out_dir>/metrics.jsonl, and the same metrics to wandb when enabled.
Plots need only the JSONL files (eval/compare.py), no wandb account.
And the throughput meter (tokens/s, MFU) that train.py and scripts/bench.py share.
"""

import json
import os
import time

import torch

from pretrain.files import write_atomically


def read_metrics(path):
    """The records of a metrics.jsonl file, skipping a torn last line from a killed run."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsLogger:

    def __init__(self, out_dir, enabled=True):
        self.enabled = enabled  # False on every rank but the main one
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        self.log_path = os.path.join(out_dir, "train.log")
        self.wandb_run = None

    def print(self, message):
        if not self.enabled:
            return
        print(message, flush=True)
        if os.path.isdir(os.path.dirname(self.log_path)):  # not yet created while the run is being checked
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(message + "\n")

    def keep_steps_up_to(self, step):
        """On resume: drop records logged after the checkpoint, so each step appears once."""
        if not self.enabled or not os.path.exists(self.metrics_path):
            return
        kept = "".join(json.dumps(r) + "\n" for r in read_metrics(self.metrics_path) if r.get("step", 0) <= step)
        write_atomically(self.metrics_path, lambda f: f.write(kept.encode("utf-8")))

    def start_wandb(self, project, group, name, run_id, config):
        """Start (or, with the checkpoint's run_id, continue) the wandb run; its files go to
        <out_dir>/wandb unless WANDB_DIR says otherwise."""
        if not self.enabled:
            return
        import wandb
        directory = os.environ.get("WANDB_DIR") or os.path.dirname(self.metrics_path)
        self.wandb_run = wandb.init(project=project, group=group, name=name, id=run_id, dir=directory,
                                    resume="allow", config=config, tags=[config.get("attn_type", "")])

    def log(self, record, jsonl=True):
        """Append one step's metrics (a dict with "step") to metrics.jsonl (unless jsonl=False) and wandb."""
        if not self.enabled:
            return
        if jsonl:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                               step=record["step"])

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


def wandb_problem():
    """Why wandb could not log from here, in one line, or None. Checked before anything is built: with no
    API key wandb.init fails only after the model is, with a traceback."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None  # no server, no key needed
    try:
        import wandb
    except ImportError:
        return "wandb_log=True, but wandb is not installed: pip install wandb, or pass --wandb_log=False"
    if wandb.login(prompt=False, verify=False):  # an API key from WANDB_API_KEY, a settings file or ~/.netrc
        return None
    return ("wandb_log=True, but wandb has no API key here: run `wandb login` (or set WANDB_API_KEY), "
            "log locally with WANDB_MODE=offline, or pass --wandb_log=False")


def format_count(n):
    """'950', '153.6K', '12.58M', '100.0B': a token count readable from a tiny run to a full one."""
    for scale, suffix, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return str(int(n))


def format_duration(seconds):
    """'3d04h', '2h05m', '4m07s', '12s'; 'n/a' for None."""
    if seconds is None:
        return "n/a"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class ThroughputMeter:
    """Tokens per second and MFU over timed spans only: time outside start()..stop() (compilation,
    evaluation, checkpoints, logging) is not counted. CUDA is synchronised at both ends of a span, so
    a span holds the device's work, not only the kernel launches.
    MFU = model FLOPs per token x tokens/s / peak FLOP/s of all the devices together."""

    def __init__(self, flops_per_token, peak_flops, device_type):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # None where unknown (CPU): no MFU
        self.device_type = device_type
        self.tokens, self.seconds, self.since = 0, 0.0, None

    @property
    def running(self):
        return self.since is not None

    def _sync(self):
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def start(self):
        self._sync()
        self.since = time.perf_counter()

    def count(self, tokens):
        """Tokens processed in the current span."""
        self.tokens += tokens

    def stop(self):
        """End the current span (if any); returns its length in seconds."""
        if self.since is None:
            return 0.0
        self._sync()
        span = time.perf_counter() - self.since
        self.seconds += span
        self.since = None
        return span

    def mfu(self, tokens_per_sec):
        if not (self.peak_flops and tokens_per_sec):
            return None
        return self.flops_per_token * tokens_per_sec / self.peak_flops

    def read(self):
        """(tokens/s, MFU) over the spans since the last read, then start counting afresh;
        (None, None) if no tokens were timed."""
        tokens_per_sec = self.tokens / self.seconds if self.tokens and self.seconds > 0 else None
        self.tokens, self.seconds = 0, 0.0
        return tokens_per_sec, self.mfu(tokens_per_sec)
