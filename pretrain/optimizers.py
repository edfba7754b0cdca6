"""
The optimizer of a run, from its config: AdamW (the paper's), or Muon for the hidden matrices with
AdamW for everything else.

    optimizer = "adamw"  AdamW on every parameter; weight decay on weight matrices only (not on norms,
                         biases, XSA gates or sinks)
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
Weight decay is decoupled in both (p -= lr * weight_decay * p, with the unscaled lr); Muon's matrices
decay by muon_weight_decay, which defaults to weight_decay under "match_rms_adamw" and to a tenth of
it under "original" (Muon's reference recipe: lr 0.02, decay 0.01, 2e-4 per step).

Both kinds live in one torch.optim.Optimizer (MuonAdamW): one state_dict, one list of param_groups
(each says its "algorithm"), so checkpoints, resume and the learning-rate schedule treat a Muon run
like an AdamW one.
"""

import inspect

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from pretrain.parallelize import local_shard
from pretrain.train_config import OPTIMIZERS


def is_hidden_matrix(name, p):
    """A 2-D weight inside a transformer block: what Muon orthogonalises."""
    return p.dim() == 2 and name.startswith("transformer.h.")


def is_decayed(name, p):
    """Weight decay on the weight matrices of linear layers and the embedding; not on norms, biases,
    XSA gates, or the learned sinks (2-D, but inputs of the model rather than weights of a layer)."""
    return p.dim() >= 2 and name != "sinks"


def param_groups(model, optimizer):
    """[{"params", "algorithm", "decay"}]: AdamW's decayed matrices and the rest, then Muon's matrices."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if optimizer == "muon" and is_hidden_matrix(n, p)]
    taken = {id(p) for p in muon}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    groups = [("adamw", True, [p for n, p in rest if is_decayed(n, p)]),
              ("adamw", False, [p for n, p in rest if not is_decayed(n, p)]), ("muon", True, muon)]
    return [{"params": params, "algorithm": algorithm, "decay": decay} for algorithm, decay, params in groups if params]


def build_optimizer(model, c, device_type):
    """The optimizer c.optimizer names, for `model` (plain, or sharded by FSDP2), with the
    hyperparameters of c (see set_hyperparameters)."""
    if c.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {c.optimizer!r}")
    groups = param_groups(model, c.optimizer)
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw_options = {"lr": c.learning_rate, "fused": True} if fused else {"lr": c.learning_rate}
    adamw_groups = [g for g in groups if g["algorithm"] == "adamw"]
    if c.optimizer == "adamw":
        optimizer = torch.optim.AdamW(adamw_groups, **adamw_options)
    else:
        optimizer = MuonAdamW([g for g in groups if g["algorithm"] == "muon"], adamw_groups, adamw_options)
    set_hyperparameters(optimizer, c)
    return optimizer


def set_hyperparameters(optimizer, c):
    """Weight decay, betas, momentum and Muon's learning-rate rule from the config c: at the start and
    again after a resume, so that the config given now decides them (a group whose weight decay was 0
    in the checkpoint gets the new value). Weight matrices decay; norms, biases, gates and sinks never do.
    train.py sets group["lr"] = the schedule's learning rate * group["lr_scale"] at every step."""
    muon_lr = c.muon_learning_rate if c.muon_learning_rate is not None else c.learning_rate
    for group in optimizer.param_groups:
        if group["algorithm"] == "muon":
            group.update(momentum=c.muon_momentum, adjust_lr_fn=c.muon_adjust_lr,
                         lr_scale=muon_lr / c.learning_rate, weight_decay=c.muon_weight_decay)
        else:
            group.update(betas=(c.beta1, c.beta2), lr_scale=1.0,
                         weight_decay=c.weight_decay if group["decay"] else 0.0)


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz work split over the processes of a run (modded-nanogpt's
    scheme). Newton-Schulz must see a whole matrix (a shard alone would give another update) and would
    otherwise be computed alike by every process, so process r orthogonalises matrices r, r + W,
    r + 2W, ... of each shape, and the results are exchanged in bf16:
    - DDP (every process holds whole matrices and the same gradients): the owner orthogonalises, an
      all-gather hands the result to the others;
    - FSDP2 (each process holds some rows of every matrix): an all-to-all brings each matrix's rows to
      its owner, which orthogonalises it whole, and a second all-to-all returns every process its rows.
    Newton-Schulz casts its input to bf16 and returns bf16, so the bf16 exchange loses nothing: every
    process ends with the update it would have computed alone. A single process exchanges nothing.
    Each owner's Newton-Schulz runs while the exchanges of other matrices are in flight."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.matrices_orthogonalised = 0  # by this process, over all steps: about 1/W of them

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]  # alike on every process
            updates = self.orthogonalise([local_shard(self.momentum_update(p, group)) for p in params], params, group)
            for p, update in zip(params, updates):  # as torch.optim.Muon, on this process's rows
                weights = local_shard(p)
                weights.mul_(1 - group["lr"] * group["weight_decay"])
                weights.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss

    def momentum_update(self, p, group):
        """The momentum buffer's update of p, Nesterov's by default (element-wise: a shard under FSDP)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def newton_schulz(self, matrix, group):
        self.matrices_orthogonalised += 1
        return _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def orthogonalise(self, updates, params, group):
        """The orthogonalised updates, each shaped as this process's part of its parameter."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if world == 1:
            return [self.newton_schulz(u, group) for u in updates]
        by_shape = {}
        for i, p in enumerate(params):
            by_shape.setdefault((tuple(p.shape), isinstance(p, DTensor)), []).append(i)
        chunks = [(indices[start:start + world], shape, sharded) for (shape, sharded), indices in by_shape.items()
                  for start in range(0, len(indices), world)]  # one matrix per process (the last may have fewer)
        # FSDP: every chunk's rows travel to their owners at once
        arrivals = [self.send_rows_to_owner([updates[i] for i in chunk], shape, world) if sharded else None
                    for chunk, shape, sharded in chunks]
        exchanges = [self.return_rows(arrival, len(chunk), shape, rank, world, group) if sharded
                     else self.share_whole([updates[i] for i in chunk], rank, world, group)
                     for (chunk, shape, sharded), arrival in zip(chunks, arrivals)]
        results = [None] * len(updates)
        for (chunk, _, _), finish in zip(chunks, exchanges):
            for i, update in zip(chunk, finish()):
                results[i] = update
        return results

    def share_whole(self, matrices, rank, world, group):
        """DDP: this process orthogonalises matrices[rank]; an all-gather shares them all."""
        mine = self.newton_schulz(matrices[rank], group) if rank < len(matrices) else \
            torch.zeros_like(matrices[0], dtype=torch.bfloat16)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        work = dist.all_gather(gathered, mine, async_op=True)

        def finish():
            work.wait()
            return gathered[:len(matrices)]
        return finish

    @staticmethod
    def row_counts(rows, world):
        """Rows of a matrix on each process under FSDP2's dim-0 sharding (torch.chunk: the last fewer, or none)."""
        counts = [len(piece) for piece in torch.arange(rows).chunk(world)]
        return counts + [0] * (world - len(counts))

    def send_rows_to_owner(self, shards, shape, world):
        """FSDP: all-to-all of this process's rows of each matrix of a chunk (matrix j to process j),
        padded to equal blocks. Returns (received blocks, their work handle)."""
        rows, cols = shape
        pad = max(self.row_counts(rows, world))
        send = torch.zeros(world, pad, cols, dtype=torch.bfloat16, device=shards[0].device)
        for j, shard in enumerate(shards):
            send[j, :shard.size(0)] = shard
        received = torch.empty_like(send)  # received[j]: process j's rows of the matrix this process owns
        return received, dist.all_to_all_single(received, send, async_op=True)

    def return_rows(self, arrival, n_matrices, shape, rank, world, group):
        """FSDP: orthogonalise the whole matrix this process owns, send every process its rows back."""
        received, work = arrival
        counts = self.row_counts(shape[0], world)
        work.wait()
        back = torch.zeros_like(received)
        if rank < n_matrices:
            whole = self.newton_schulz(torch.cat([received[j, :counts[j]] for j in range(world)]), group)
            for j, rows in enumerate(whole.split(counts)):
                back[j, :counts[j]] = rows
        mine = torch.empty_like(back)  # mine[j]: this process's rows of matrix j, from its owner
        work = dist.all_to_all_single(mine, back, async_op=True)

        def finish():
            work.wait()
            return [mine[j, :counts[rank]] for j in range(n_matrices)]
        return finish


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
        loss = self.muon.step(closure)  # the closure, if any, runs once, there
        self.adamw.step()
        return loss
