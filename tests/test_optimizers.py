"""optimizers.py: which parameters each optimizer takes, and MuonAdamW against torch's own Muon and AdamW."""

import copy
import os
import sys

import pytest
import torch

from micro import MICRO, make_optimizer
from model import GPT, GPTConfig
from running import REPO, run_ranks

HIDDEN = {"attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
          "mlp.c_proj.weight"}


def model_with_everything(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**MICRO, "vocab_size": 512, "attn_type": "xsa", "xsa_gate": True, "n_sinks": 2,
                            "n_head": 4, "head_dim": 8, "n_kv_head": 2, "bias": True}))


def groups_by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["algorithm"], g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in optimizer.param_groups]


def test_adamw_decays_only_weight_matrices():
    """Linear and embedding weights decay; norms, biases, gates and the sinks (2-D, but the model's
    learned inputs, not a layer's weights) do not."""
    model = model_with_everything()
    optimizer = make_optimizer(model, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    weights = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    for algorithm, decay, names in groups_by_name(model, optimizer):
        assert algorithm == "adamw"
        assert all((n.rsplit(".", 1)[0] in weights and n.endswith(".weight")) == (decay == 0.1) for n in names), names
    assert any("sinks" in names and decay == 0.0 for _, decay, names in groups_by_name(model, optimizer))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = model_with_everything()
    optimizer = make_optimizer(model, optimizer="muon", weight_decay=0.1)
    groups = groups_by_name(model, optimizer)
    muon = set().union(*(names for algorithm, _, names in groups if algorithm == "muon"))
    assert muon == {f"transformer.h.{i}.{name}" for i in range(MICRO["n_layer"]) for name in HIDDEN}
    adamw = {(decay, n) for algorithm, decay, names in groups if algorithm == "adamw" for n in names}
    # the embedding (tied with the output layer) is a matrix outside the blocks: AdamW, decayed; the sinks
    # are AdamW's too, not decayed
    assert {n for decay, n in adamw if decay == 0.1} == {"transformer.wte.weight"}
    assert {n for decay, n in adamw if decay == 0.0} == {n for n, p in model.named_parameters() if p.dim() < 2} | {"sinks"}
    assert all(decay == 0.1 for algorithm, decay, _ in groups if algorithm == "muon")


@pytest.mark.parametrize("adjust_lr,weight_decay,muon_weight_decay,expected", [
    ("match_rms_adamw", 0.1, None, 0.1),  # AdamW's learning rate and decay carry over
    ("original", 0.1, None, 0.01),  # Muon's own learning rate (about 0.02): its reference decay, 2e-4 per step
    ("original", 0.1, 0.05, 0.05)])
def test_muon_weight_decay_defaults_to_what_its_learning_rate_rule_needs(adjust_lr, weight_decay, muon_weight_decay,
                                                                         expected):
    model = model_with_everything()
    optimizer = make_optimizer(model, optimizer="muon", muon_adjust_lr=adjust_lr, weight_decay=weight_decay,
                               muon_weight_decay=muon_weight_decay)
    decays = {g["algorithm"]: g["weight_decay"] for g in optimizer.param_groups if g["decay"]}
    assert decays == {"muon": pytest.approx(expected), "adamw": weight_decay}


@pytest.mark.parametrize("adjust_lr,muon_lr", [("match_rms_adamw", None), ("original", 0.02)])
def test_muon_adamw_steps_as_torch_muon_and_adamw_side_by_side(adjust_lr, muon_lr):
    """The reference: torch.optim.Muon on the blocks' matrices and torch.optim.AdamW on the rest,
    two optimizers stepping clones of the same model on the same gradients."""
    settings = dict(optimizer="muon", learning_rate=1e-3, weight_decay=0.1, muon_adjust_lr=adjust_lr,
                    muon_learning_rate=muon_lr, muon_momentum=0.9)
    model = model_with_everything()
    reference = copy.deepcopy(model)
    optimizer = make_optimizer(model, **settings)
    hidden = [p for n, p in reference.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2]
    rest = [p for n, p in reference.named_parameters() if not (n.startswith("transformer.h.") and p.dim() == 2)]
    muon_decay = 0.1 if adjust_lr == "match_rms_adamw" else 0.01  # muon_weight_decay's defaults
    muon = torch.optim.Muon(hidden, lr=muon_lr or 1e-3, weight_decay=muon_decay, momentum=0.9, adjust_lr_fn=adjust_lr)
    decayed = [p for n, p in reference.named_parameters() if p.dim() >= 2 and n != "sinks"]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if any(p is q for q in decayed)], "weight_decay": 0.1},
                               {"params": [p for p in rest if not any(p is q for q in decayed)], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95))
    x = torch.randint(0, 512, (2, MICRO["block_size"] + 1))
    for step in range(3):
        for group in optimizer.param_groups:  # as train.py's schedule does
            group["lr"] = 1e-3 * group["lr_scale"]
        for m, opts in ((model, [optimizer]), (reference, [muon, adamw])):
            m(x[:, :-1], x[:, 1:])[1].backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


def test_muon_adamw_state_dict_resumes_exactly():
    model = model_with_everything()
    optimizer = make_optimizer(model, optimizer="muon")
    x = torch.randint(0, 512, (2, MICRO["block_size"] + 1))

    def step(m, opt):
        m(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(model, optimizer)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert {"momentum_buffer"} in [set(s) for s in saved_optimizer["state"].values()]  # Muon's
    assert {"step", "exp_avg", "exp_avg_sq"} in [set(s) for s in saved_optimizer["state"].values()]  # AdamW's
    step(model, optimizer)
    resumed = model_with_everything(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = make_optimizer(resumed, optimizer="muon")
    resumed_optimizer.load_state_dict(saved_optimizer)
    step(resumed, resumed_optimizer)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# -----------------------------------------------------------------------------
# Muon's Newton-Schulz split over 2 processes (gloo): each matrix orthogonalised by one process

SPLIT_MODEL = dict(MICRO, n_layer=3, vocab_size=512, n_embd=48, n_head=3, head_dim=16, n_kv_head=1)


def fixed_grads(model, step):
    """Gradients that depend only on the parameter's name and the step, equal on every process."""
    grads = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        grads[name] = torch.randn(p.shape, generator=g)
    return grads


def split_muon_worker(out_dir, parallelism):
    """One rank of the split (running.run_ranks starts this file as the ranks' script, with torchrun's variables):
    three Muon steps on fixed gradients; writes its count of orthogonalised matrices and the weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from pretrain.optimizers import Muon, is_hidden_matrix
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SPLIT_MODEL))
        if parallelism == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        hidden = [(n, p) for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
        muon = Muon([p for _, p in hidden], lr=0.02, weight_decay=0.1, momentum=0.9)
        for step in range(3):
            grads = fixed_grads(model, step)
            for name, p in hidden:
                full = grads[name]
                p.grad = distribute_tensor(full, p.device_mesh, p.placements) if parallelism == "fsdp" else full
            muon.step()
        weights = {n: (p.full_tensor() if parallelism == "fsdp" else p).detach().clone() for n, p in hidden}
        torch.save((muon.matrices_orthogonalised, weights), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_split_muon_matches_torch_muon_and_each_process_orthogonalises_its_share(tmp_path, parallelism):
    """Two processes, each orthogonalising about half the matrices and exchanging the bf16 results, end
    with the weights of torch.optim.Muon run whole in one process (whole matrices under DDP; rows of
    every matrix under FSDP2)."""
    from pretrain.optimizers import is_hidden_matrix
    ranks = run_ranks(__file__, [str(tmp_path), parallelism], 2,
                      env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})  # the repo's modules too
    assert ranks.status == 0, ranks.stderr[-3000:]
    by_rank = {rank: torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)}

    torch.manual_seed(0)
    reference = GPT(GPTConfig(**SPLIT_MODEL))
    hidden = [(n, p) for n, p in reference.named_parameters() if is_hidden_matrix(n, p)]
    muon = torch.optim.Muon([p for _, p in hidden], lr=0.02, weight_decay=0.1, momentum=0.9)
    for step in range(3):
        grads = fixed_grads(reference, step)
        for name, p in hidden:
            p.grad = grads[name]
        muon.step()
    for rank in (0, 1):
        for name, p in hidden:
            # Newton-Schulz's bf16 result crosses processes as it is: the weights agree to fp32 rounding
            torch.testing.assert_close(by_rank[rank][1][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    shapes = {}
    for _, p in hidden:
        shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    counts = [by_rank[rank][0] for rank in (0, 1)]
    assert sum(counts) == 3 * len(hidden)  # each matrix orthogonalised once per step, by one process
    # per shape, matrices alternate between the processes: rank 0 takes the odd one out
    assert counts == [3 * sum((n + 1) // 2 for n in shapes.values()), 3 * sum(n // 2 for n in shapes.values())]


if __name__ == "__main__":  # a rank of test_split_muon_matches_torch_muon_and_each_process_orthogonalises_its_share
    split_muon_worker(*sys.argv[1:])
