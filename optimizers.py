"""
The optimizer of a run, from its config: AdamW (the paper's), or Muon for the hidden matrices with
AdamW for everything else.

    optimizer = "adamw"  AdamW on every parameter; weight decay on matrices only (not on norms,
                         biases or XSA gates)
    optimizer = "muon"   torch.optim.Muon on the 2-D weights inside the blocks (c_q, c_k, c_v and
                         c_proj of attention, c_fc and c_proj of the MLP, each orthogonalised as its
                         own matrix), AdamW on the token embedding (tied with the output layer), the
                         sinks, the norms and the XSA gates

Muon's learning rate per matrix follows `muon_adjust_lr` (torch's adjust_lr_fn), applied to the
schedule's learning rate times muon_learning_rate / learning_rate:
    "match_rms_adamw"  lr * 0.2 * sqrt(max(A, B)) for an A x B matrix: the update has the RMS of an
                       AdamW update, so AdamW's learning rate and weight decay carry over (Moonshot,
                       "Muon is Scalable for LLM Training"); the default, with muon_learning_rate None
    "original"         lr * sqrt(max(1, A / B)) (Keller Jordan's Muon), with a Muon-sized
                       muon_learning_rate (about 0.02) beside the AdamW one
Weight decay is decoupled in both (p -= lr * weight_decay * p, with the unscaled lr).

Both kinds live in one torch.optim.Optimizer (MuonAdamW): one state_dict, one list of param_groups
(each says its "algorithm"), so checkpoints, resume and the learning-rate schedule treat a Muon run
like an AdamW one.
"""

import inspect

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

OPTIMIZERS = ("adamw", "muon")


def is_hidden_matrix(name, p):
    """A 2-D weight inside a transformer block: what Muon orthogonalises."""
    return p.dim() == 2 and name.startswith("transformer.h.")


def param_groups(model, optimizer):
    """[{"params", "algorithm"}]: AdamW's matrices (decayed) and the rest (not), then Muon's matrices."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if optimizer == "muon" and is_hidden_matrix(n, p)]
    taken = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in taken]
    groups = [("adamw", [p for p in rest if p.dim() >= 2]), ("adamw", [p for p in rest if p.dim() < 2]),
              ("muon", muon)]
    return [{"params": params, "algorithm": algorithm} for algorithm, params in groups if params]


def build_optimizer(model, c, device_type):
    """The optimizer c["optimizer"] names, for `model` (plain, or sharded by FSDP2), with the
    hyperparameters of c (see set_hyperparameters)."""
    if c["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {c['optimizer']!r}")
    groups = param_groups(model, c["optimizer"])
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw_options = {"lr": c["learning_rate"], "fused": True} if fused else {"lr": c["learning_rate"]}
    adamw_groups = [g for g in groups if g["algorithm"] == "adamw"]
    if c["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(adamw_groups, **adamw_options)
    else:
        optimizer = MuonAdamW([g for g in groups if g["algorithm"] == "muon"], adamw_groups, adamw_options)
    set_hyperparameters(optimizer, c)
    return optimizer


def set_hyperparameters(optimizer, c):
    """Weight decay, betas, momentum and Muon's learning-rate rule from the config c: at the start and
    again after a resume, so that the config given now decides them (a group whose weight decay was 0
    in the checkpoint gets the new value). Matrices decay; norms, biases and gates never do.
    train.py sets group["lr"] = the schedule's learning rate * group["lr_scale"] at every step."""
    muon_lr = c["muon_learning_rate"] if c["muon_learning_rate"] is not None else c["learning_rate"]
    for group in optimizer.param_groups:
        group["weight_decay"] = c["weight_decay"] if all(p.dim() >= 2 for p in group["params"]) else 0.0
        if group.setdefault("algorithm", "adamw") == "muon":  # checkpoints from before Muon name none
            group.update(momentum=c["muon_momentum"], adjust_lr_fn=c["muon_adjust_lr"],
                         lr_scale=muon_lr / c["learning_rate"])
        else:
            group.update(betas=(c["beta1"], c["beta2"]), lr_scale=1.0)


class Muon(torch.optim.Muon):
    """torch.optim.Muon, whose Newton-Schulz iteration also sees whole matrices when FSDP2 shards the
    parameters: a shard's update is all-gathered, orthogonalised whole (by every process alike), and
    each process keeps its own rows. Orthogonalising a shard alone would give another update."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        for group in self.param_groups:  # torch's single-tensor Muon step, on gathered matrices
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                whole = _zeropower_via_newtonschulz(update.full_tensor(), group["ns_coefficients"],
                                                    group["ns_steps"], group["eps"])
                mesh = p.device_mesh
                update = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
                update = update.redistribute(mesh, p.placements)  # Replicate -> Shard: a local slice
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


class MuonAdamW(torch.optim.Optimizer):
    """Muon on some parameters and AdamW on the others, as one optimizer. Its param_groups and state
    are those of the two inner optimizers, which step their own groups."""

    def __init__(self, muon_groups, adamw_groups, adamw_options):
        self.muon = Muon(muon_groups, lr=adamw_options["lr"])
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_options)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})
        self.link_inner_optimizers()

    def link_inner_optimizers(self):
        """The inner optimizers work on this one's group dicts and state (load_state_dict replaces both)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.link_inner_optimizers()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss
