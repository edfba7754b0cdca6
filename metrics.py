"""
Run logging on the main process: stdout copied to <out_dir>/train.log, one JSON object per
logged step in <out_dir>/metrics.jsonl, and the same metrics to wandb when enabled.
Plots need only the JSONL files (eval/compare.py), no wandb account.
"""

import json
import os


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
        kept = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= step]
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.metrics_path)

    def start_wandb(self, project, group, name, run_id, config):
        """Start (or, with the checkpoint's run_id, continue) the wandb run."""
        if not self.enabled:
            return
        import wandb
        self.wandb_run = wandb.init(project=project, group=group, name=name, id=run_id,
                                    resume="allow", config=config,
                                    tags=[config.get("attn_type", "")])

    def log(self, record):
        """Append one step's metrics (a dict with "step") to metrics.jsonl and wandb."""
        if not self.enabled:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                               step=record["step"])

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()
