"""scripts/memory_plan.py: its estimates against peaks measured on this CPU, each item it can measure against the
bytes a tiny model holds, and the paper configs' plans."""

import json
import os
import subprocess

import pytest

from running import REPO, communicate, preloaded_python

# estimates against peaks measured on this CPU (fp32: 4-byte activations)
SMALL = dict(n_layer=4, n_embd=256, n_head=4, head_dim=64, block_size=256, batch_size=4)  # mostly the loss
WIDE = dict(n_layer=4, n_embd=384, n_head=6, head_dim=64, block_size=512, batch_size=4, vocab_size=4096)  # blocks
MEASURED = {"small": SMALL, "wide": WIDE, "wide-block": dict(WIDE, activation_checkpointing="block"),
            "wide-selective": dict(WIDE, activation_checkpointing="selective")}


@pytest.fixture(scope="module")
def measured():
    """memory_plan.py --measure for each config, run side by side (one process each): {name: result}. The
    processes are forked from the preloaded server: a peak is measured above the process's own resident set
    before the model, so what the server had imported does not count (the same bytes, to 0.1%, as from a new
    interpreter)."""
    python = preloaded_python(start=True)
    procs = {}
    for name, settings in MEASURED.items():
        args = [f"--{k}={v}" for k, v in {**settings, "device": "cpu", "dtype": "float32"}.items()]
        procs[name] = subprocess.Popen([python, "-m", "scripts.memory_plan", *args, "--measure=True",
                                        "--json_output=True"], cwd=REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                       start_new_session=True)
    results = {}
    for name, proc in procs.items():
        out, err = communicate(proc)
        assert proc.returncode == 0, err[-3000:]
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEASURED))
def test_memory_plan_matches_measured_peak(measured, name):
    result = measured[name]
    assert result["dtype"] == "float32" and result["device"] == "cpu"
    assert result["bytes"]["total"] == pytest.approx(result["measured_bytes"], rel=0.25)


@pytest.mark.slow
def test_activation_checkpointing_lowers_measured_peak(measured):
    peak = {name: measured[name]["measured_bytes"] for name in ("wide", "wide-selective", "wide-block")}
    assert peak["wide-block"] < peak["wide-selective"] < peak["wide"]
    assert peak["wide-block"] < 0.75 * peak["wide"]


def test_memory_plan_for_the_paper_configs():
    """Sharding and recomputation lower the planned memory per GPU of the 2.7B model on 8 GPUs."""
    from scripts import memory_plan
    from dataclasses import replace
    from pretrain.train_config import resolve
    c, _ = resolve([os.path.join(REPO, "config", "xsa_2p7b.py")])
    total = {}
    for parallelism in ("ddp", "fsdp"):
        for mode in ("none", "block"):
            run = replace(c, parallelism=parallelism, activation_checkpointing=mode)
            total[parallelism, mode] = memory_plan.plan(run, 8)["total"]
    assert total["fsdp", "none"] < total["ddp", "none"] and total["fsdp", "block"] < total["ddp", "block"]
    assert total["ddp", "block"] < total["ddp", "none"] and total["fsdp", "block"] < total["fsdp", "none"]
    assert 2.7e9 < memory_plan.parameter_counts(c)["total"] < 2.9e9
    budget = 76e9
    assert memory_plan.largest_micro_batch(replace(c, parallelism="ddp"), 8, budget, "cuda", "bfloat16") < \
        memory_plan.largest_micro_batch(replace(c, parallelism="fsdp"), 8, budget, "cuda", "bfloat16")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_memory_plan_items_are_the_bytes_a_model_holds(optimizer):
    """Each item the plan can measure on one CPU process: the parameters, their gradients and the optimizer's
    states in bytes, against the tensors a tiny model really holds after a backward and a step. Under DDP
    (gradient_as_bucket_view=True, parallelize.py) the gradients are the buckets: no item counts them twice."""
    import torch
    from dataclasses import replace
    from model import GPT
    from pretrain.optimizers import build_optimizer
    from pretrain.train_config import make_config, model_config
    from scripts import memory_plan
    c = make_config(n_layer=2, n_embd=64, n_head=2, head_dim=32, vocab_size=512, block_size=16, batch_size=2,
                    total_batch_size=32, optimizer=optimizer, device="cpu", dtype="float32")
    parts = memory_plan.plan(c, 1, "cpu", "float32")
    torch.manual_seed(0)
    model = GPT(model_config(c))
    optimizer_ = build_optimizer(model, c, "cpu")
    x = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size))
    model(x, x)[1].backward()
    optimizer_.step()

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    unique = {id(p): p for p in model.parameters()}.values()  # the tied embedding once
    assert parts["parameters (fp32)"] == nbytes(unique)
    assert parts["gradients (fp32)"] == nbytes(p.grad for p in unique)
    states = [t for s in optimizer_.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    item = "AdamW states (fp32)" if optimizer == "adamw" else "Muon momentum + AdamW states (fp32)"
    assert parts[item] == nbytes(states)
    ddp = memory_plan.plan(replace(c, parallelism="ddp"), 8, "cpu", "float32")
    assert not [name for name in ddp if "bucket" in name]
    assert ddp["gradients (fp32)"] == parts["gradients (fp32)"]
