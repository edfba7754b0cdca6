"""What several test files check alike (beside conftest.py's fixtures, running.py's runners and micro.py's micro
model): test files import these from here, never from one another."""

import os
import re
import shlex

import numpy as np
import pytest
import torch

from eval.downstream import PAPER_TASK_YAMLS
from model import GPT, GPTConfig
from pretrain.metrics import read_metrics
from pretrain.shards import list_shards, read_shard
from running import HANG_GUARD_S, REPO, preloaded_python, run_script

# the document masks' eot_token in the toy vocabularies below: a token of theirs and of GPT-2's
TOY_EOT = 7


# -----------------------------------------------------------------------------
# resumed runs (test_resume.py, test_resume_processes.py)

# dropout makes every step draw random numbers, so a lost RNG state would show in the losses
RESUME = dict(max_iters=8, lr_decay_iters=8, eval_interval=4, checkpoint_interval=4, dropout=0.1)


def losses(out_dir):
    """(step, train_loss) of every record in out_dir's metrics.jsonl."""
    return [(r["step"], r["train_loss"]) for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))]


# -----------------------------------------------------------------------------
# local copies of the paper's 8 lm-eval tasks (test_eval_downstream.py, test_in_loop.py)

LM_EVAL_FIXTURES = os.path.join(REPO, "tests", "fixtures", "lm_eval")


def write_fixture_tasks(out):
    """A task directory in out whose YAMLs include the installed lm-eval task definitions and swap only
    the data source for the jsonl fixtures, mapped to every split name the task declares; returns out."""
    import lm_eval.tasks
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml
    task_dir = os.path.dirname(lm_eval.tasks.__file__)
    os.makedirs(out, exist_ok=True)
    for task, relative in PAPER_TASK_YAMLS.items():
        installed = os.path.join(task_dir, relative)
        config = load_yaml(installed, resolve_func=False)
        assert config["task"] == task, f"{installed} no longer defines {task}"
        data = os.path.join(LM_EVAL_FIXTURES, f"{task}.jsonl")
        split_keys = ("training_split", "validation_split", "test_split")
        splits = {config[key]: data for key in split_keys if config.get(key)}
        with open(os.path.join(out, f"{task}.yaml"), "w") as f:
            yaml.safe_dump({"include": installed, "dataset_path": "json", "dataset_name": None,
                            "dataset_kwargs": {"data_files": splits, "cache_dir": os.path.join(str(out), "hf_cache")}},
                           f)
    return str(out)


# -----------------------------------------------------------------------------
# every variant the repo trains (test_generate.py, test_export.py)

# every variant the repo trains
MODEL_VARIANTS = {
    "sa": {},
    "xsa": dict(attn_type="xsa"),
    "gated": dict(attn_type="xsa", xsa_gate=True),
    "sinks": dict(attn_type="xsa", n_sinks=2),
    "gqa": dict(attn_type="xsa", n_kv_head=2),
    "mqa_sinks_sa": dict(n_kv_head=1, n_sinks=1),
    "xsa_layers": dict(attn_type="xsa", xsa_layers=1),
    "bias_theta": dict(attn_type="xsa", bias=True, rope_theta=500.0, xsa_gate=True),
    "document": dict(attn_mask="document", eot_token=TOY_EOT),
    "document_xsa_sinks_gqa": dict(attn_type="xsa", n_sinks=2, n_kv_head=2, attn_mask="document", eot_token=TOY_EOT),
}


def with_documents(idx):
    """idx with an TOY_EOT every 5 tokens from the fourth on: several documents, the first cut at its start."""
    idx = idx.clone()
    idx[..., 3::5] = TOY_EOT
    return idx


# -----------------------------------------------------------------------------
# documents packed in a window, and the models of the document-mask tests (test_document_mask.py,
# test_flex_attention.py)

DOCUMENT_MODEL = dict(n_layer=2, n_head=4, n_embd=32, head_dim=8, block_size=48, vocab_size=97, eot_token=TOY_EOT)
# the variants the packed == alone proof covers (issue: SA, XSA, gated XSA with GQA, XSA with sinks), and more
DOCUMENT_VARIANTS = {
    "sa": {},
    "xsa": dict(attn_type="xsa"),
    "gated_gqa": dict(attn_type="xsa", xsa_gate=True, n_kv_head=2),
    "xsa_sinks": dict(attn_type="xsa", n_sinks=2),
    "sa_sinks_mqa": dict(n_sinks=1, n_kv_head=1),
    "xsa_layers": dict(attn_type="xsa", xsa_layers=1),
}


def document_model(attn_mask="document", seed=0, dtype=torch.float64, **overrides):
    """Weights far from the near-uniform initialisation (gates open), so that masks make big differences."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**DOCUMENT_MODEL, "attn_mask": attn_mask, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def documents(lengths, seed=1):
    """Documents of the given lengths, each starting with TOY_EOT (as the shards store them); no TOY_EOT inside."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        body = torch.randint(TOY_EOT + 1, DOCUMENT_MODEL["vocab_size"], (n - 1,), generator=g)
        docs.append(torch.cat((torch.tensor([TOY_EOT]), body)))
    return docs


def with_config(model, **overrides):
    """The same weights under another config (attn_mask, say)."""
    other = GPT(GPTConfig(**{**model.config.__dict__, **overrides})).to(model.lm_head.weight.dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def packed_batch():
    """Two windows of several documents each, the second cut mid-document at its start."""
    return torch.stack((torch.cat(documents([5, 1, 12, 6])),
                        torch.cat((documents([4])[0][1:], *documents([8, 13], 4)))))


# every variant a researcher can pick: each must trace whole, or torch.compile runs part of it eagerly
# (test_model.py with the causal mask, test_document_mask.py and test_flex_attention.py with the document mask)
COMPILE_VARIANTS = {"sa": {}, "xsa": dict(attn_type="xsa"), "gated": dict(attn_type="xsa", xsa_gate=True),
                    "gqa": dict(attn_type="xsa", n_kv_head=1, n_head=4, head_dim=8),
                    "sinks": dict(attn_type="xsa", n_sinks=2), "xsa_layers": dict(attn_type="xsa", xsa_layers=1),
                    "sa_sinks_gqa": dict(n_sinks=1, n_kv_head=1)}


def explain(model, *args):
    import torch._dynamo as dynamo
    dynamo.reset()
    return dynamo.explain(lambda *a: model(*a)[1 if len(a) > 1 else 0])(*args)


def assert_similarity_reads_the_document_mask():
    from eval.similarity import similarity_stats
    idx = torch.full((2, 16), TOY_EOT)
    document = document_model(dtype=torch.float32, attn_type="xsa")
    stats = similarity_stats(document, idx)
    assert stats["a_ii"] == pytest.approx([1.0] * DOCUMENT_MODEL["n_layer"], abs=1e-6)
    causal = similarity_stats(with_config(document, attn_mask="causal"), idx)
    assert max(causal["a_ii"]) < 0.9


# -----------------------------------------------------------------------------
# training runs (test_train.py, test_document_runs.py, test_fsdp.py)

def unigram_cross_entropy(data_dir, n_val_tokens, vocab_size=2 ** 16):
    """Loss of the best context-free model: train-set token frequencies (add-1/2 over vocab_size ids) scored on
    the val tokens."""
    train = np.concatenate([np.asarray(read_shard(p)) for p in list_shards(data_dir, "train")])
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 0.5
    val = np.asarray(read_shard(list_shards(data_dir, "val")[0]))[1:n_val_tokens + 1]
    return float(-np.log(counts[val] / counts.sum()).mean())


# the short run that the one- and two-process comparisons train (test_fsdp.py, test_document_runs.py)
PARALLEL_RUN = dict(max_iters=6, lr_decay_iters=6, batch_size=2, total_batch_size=2 * 2 * 32 * 2, checkpoint_interval=2,
                    eval_interval=100, val_tokens=5 * 32)


def records(out_dir):
    return read_metrics(os.path.join(out_dir, "metrics.jsonl"))


def assert_same_training(run, reference, steps, rel=1e-4):
    """Equal train losses and gradient norms at `steps`, and equal final val losses (to rel)."""
    got = {r["step"]: r for r in records(run)}
    want = {r["step"]: r for r in records(reference)}
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], rel=rel), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=rel), step
    assert got[steps[-1]]["val_loss"] == pytest.approx(want[steps[-1]]["val_loss"], rel=rel)


# -----------------------------------------------------------------------------
# progress bars (test_prepare_progress.py, test_download.py)

def last_bar(stderr):
    return re.split(r"[\r\n]+", stderr.strip())[-1]


ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d")  # [elapsed<remaining


# -----------------------------------------------------------------------------
# the sweep scripts (test_sweeps.py, test_launchers.py, test_quickstart.py)

SWEEP_ENV = ("NPROC", "GPUS", "SEEDS", "OUT_ROOT", "DRY_RUN", "PYTHON", "SIZE", "SIZES", "LRS", "LENGTHS", "OPTIMIZERS",
             "SINKS", "MASKS", "TOTAL_BATCH_SIZE", "TOKENS_PER_MICRO", "DATA_DIR", "INPUT", "MAX_TOKENS",
             "CUDA_VISIBLE_DEVICES")


# the scripts' $PYTHON: the interpreter running pytest, through the preloaded server (running.preloaded_python)
SWEEP_PYTHON = preloaded_python()


def sweep_env(**env):
    clean = {k: v for k, v in os.environ.items() if k not in SWEEP_ENV}
    return {**clean, "PYTHON": SWEEP_PYTHON, "NPROC": "1", **env}


def run_sweep(script, *args, check=True, timeout=HANG_GUARD_S, **env):
    proc = run_script([os.path.join(REPO, "scripts", script), *args], env=sweep_env(**env), timeout=timeout,
                      cwd="/", preloaded=True)  # the scripts find the repo themselves
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def dry_run(script, *args, with_output=False, **env):
    """The train.py launches a sweep would make: [{"env", "launcher", "config", "args", "overrides"}] (and the
    sweep's whole Result, with_output)."""
    proc = run_sweep(script, *args, DRY_RUN="1", **env)
    out = proc.stdout
    commands = []
    for line in out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words = shlex.split(line)
        prefix = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            prefix[key] = value
        if "train.py" not in words:
            continue  # prepare.py, compare.py
        at = words.index("train.py")
        args = words[at + 2:]
        overrides = dict(a[2:].split("=", 1) for a in args)  # the last value of a key wins, as in train.py
        commands.append({"env": prefix, "launcher": words[:at + 1], "config": words[at + 1], "args": args,
                         "overrides": overrides})
    return (commands, proc) if with_output else commands


def config_value(config_file, key):
    """A key of a config file, read by executing it (independently of the scripts)."""
    namespace = {}
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        exec(open(config_file).read(), namespace)
    finally:
        os.chdir(cwd)
    return namespace[key]
