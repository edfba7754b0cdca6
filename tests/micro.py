"""The micro model every training test uses, its arguments and its data (the six fixture plays), and the SA and
XSA runs trained once for the whole session (under pytest-xdist: once for all workers, under file locks)."""

import glob
import os
import shutil

from running import REPO, run_train

# six public-domain Shakespeare plays (Project Gutenberg texts), shipped with the tests
CORPUS = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "corpus", "*.txt")))
EOT = 50256
# one micro model for every test that trains: small enough for a 2-core CPU
MICRO = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=32, vocab_size=50304)


# the micro model on byte_data_dir (conftest.py), where the tokens are bytes, for the runs whose subject is not the
# tokens (resumes, checkpoints, FSDP): an 8-step run with 3 evaluations takes 0.27 s against 1.85 s over GPT-2's
# 50,304 ids, whose logits are most of the cost
BYTE_TOKENS = dict(vocab_size=320, eot_token=256)


def write_micro_shards(out, docs):
    """llm.c shards of the documents (token lists) one after another in out: one val shard of 20,000 tokens and
    three train shards of uneven sizes (60,000, 35,000 and 55,000 tokens); returns out (a str)."""
    import numpy as np
    from pretrain.shards import write_shard
    tokens = np.concatenate([np.array(doc, dtype=np.uint16) for doc in docs])
    write_shard(os.path.join(out, "fineweb_val_000000.bin"), tokens[:20_000])
    for i, (a, b) in enumerate([(0, 60_000), (60_000, 95_000), (95_000, 150_000)]):
        write_shard(os.path.join(out, f"fineweb_train_{i + 1:06d}.bin"), tokens[20_000 + a:20_000 + b])
    return str(out)


def micro_args(data_dir, out_dir, **overrides):
    """train.py arguments for the micro model: a few seconds per dozen steps on 2 cores. 1,024 val tokens: an
    evaluation is 8 forwards of the micro-batch (the logits over 50,304 ids are most of a forward's cost)."""
    settings = dict(MICRO, data_dir=data_dir, out_dir=out_dir, batch_size=4, total_batch_size=2 * 4 * 32,
                    max_iters=20, warmup_iters=4, learning_rate=3e-3, eval_interval=10, val_tokens=1024,
                    log_interval=1, checkpoint_interval=10, compile=False, device="cpu", dtype="float32",
                    wandb_log=False)
    settings.update(overrides)
    return [f"--{k}={v}" for k, v in settings.items()]


def make_optimizer(model, **overrides):
    """The optimizer train.py would build for model on the CPU, with train.py's defaults and overrides."""
    from pretrain.optimizers import build_optimizer
    from pretrain.train_config import make_config
    return build_optimizer(model, make_config(**overrides), "cpu")


# the SA run shows the val loss falling over 30 steps (test_train.py's margin); the XSA run, 15 steps (one
# checkpoint, at its end), serves the evaluation tests, none of which needs it trained longer
TRAINED_RUN = dict(batch_size=8, total_batch_size=1024, learning_rate=3e-2, warmup_iters=5,
                   eval_interval=15, checkpoint_interval=15, val_tokens=4096)
TRAINED_STEPS = {"sa": 30, "xsa": 15}


def shared_trained_runs(tmp_path_factory, data_dir, worker_id):
    """Micro SA and XSA runs trained once for the session: {"sa": out_dir, "xsa": out_dir}. Under
    pytest-xdist they are trained in the session's shared temp dir, each under a file lock of its own: a
    worker trains the first run nobody is training, the next one to ask trains the other meanwhile, and
    then every worker waits for both and reads the same runs."""
    import filelock
    if worker_id == "master":  # one process: this session's own temp dir
        root = tmp_path_factory.mktemp("trained_runs")
        return {attn_type: train_run(root / attn_type, attn_type, data_dir) for attn_type in TRAINED_STEPS}
    shared = tmp_path_factory.getbasetemp().parent / "trained_runs"  # unique to this session's workers
    shared.mkdir(exist_ok=True)

    def train_unless_done(attn_type, lock):
        with lock:
            if not (shared / f"{attn_type}.done").exists():
                shutil.rmtree(shared / attn_type, ignore_errors=True)  # a failed attempt: train again, fail alike
                train_run(shared / attn_type, attn_type, data_dir)
                (shared / f"{attn_type}.done").touch()

    locks = {attn_type: filelock.FileLock(f"{shared / attn_type}.lock") for attn_type in TRAINED_STEPS}
    for attn_type, lock in locks.items():  # those nobody trains yet
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue
        try:
            train_unless_done(attn_type, lock)
        finally:
            lock.release()
    for attn_type, lock in locks.items():  # then wait for the others'
        train_unless_done(attn_type, lock)
    return {attn_type: str(shared / attn_type) for attn_type in TRAINED_STEPS}


def train_run(out_dir, attn_type, data_dir):
    run_train(micro_args(data_dir, str(out_dir), attn_type=attn_type, max_iters=TRAINED_STEPS[attn_type],
                         **TRAINED_RUN))
    return str(out_dir)
