"""optimizers.py: which parameters each optimizer takes, and MuonAdamW against torch's own Muon and AdamW."""

import copy

import pytest
import torch

from conftest import MICRO, make_optimizer
from model import GPT, GPTConfig

HIDDEN = {"attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
          "mlp.c_proj.weight"}


def model_with_everything(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**MICRO, "vocab_size": 512, "attn_type": "xsa", "xsa_gate": True, "n_sinks": 2,
                            "n_head": 4, "head_dim": 8, "n_kv_head": 2, "bias": True}))


def groups_by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["algorithm"], g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in optimizer.param_groups]


def test_adamw_decays_only_matrices():
    model = model_with_everything()
    optimizer = make_optimizer(model, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    for algorithm, decay, names in groups_by_name(model, optimizer):
        assert algorithm == "adamw"
        params = dict(model.named_parameters())
        assert all((params[n].dim() >= 2) == (decay == 0.1) for n in names), (decay, names)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = model_with_everything()
    optimizer = make_optimizer(model, optimizer="muon", weight_decay=0.1)
    groups = groups_by_name(model, optimizer)
    muon = set().union(*(names for algorithm, _, names in groups if algorithm == "muon"))
    assert muon == {f"transformer.h.{i}.{name}" for i in range(MICRO["n_layer"]) for name in HIDDEN}
    adamw = {(decay, n) for algorithm, decay, names in groups if algorithm == "adamw" for n in names}
    # the embedding (tied with the output layer) and the sinks are matrices outside the blocks: AdamW, decayed
    assert {n for decay, n in adamw if decay == 0.1} == {"transformer.wte.weight", "sinks"}
    assert {n for decay, n in adamw if decay == 0.0} == {n for n, p in model.named_parameters() if p.dim() < 2}
    assert all(decay == 0.1 for algorithm, decay, _ in groups if algorithm == "muon")


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
    muon = torch.optim.Muon(hidden, lr=muon_lr or 1e-3, weight_decay=0.1, momentum=0.9, adjust_lr_fn=adjust_lr)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
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
