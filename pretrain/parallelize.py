"""
Fitting a plain GPT (model.py knows nothing of this) onto the processes of a run, as torchtitan
does: activation checkpointing, torch.compile, then DDP or FSDP2, applied in that order.

    ddp   every process holds the whole model, its gradients and AdamW's states; gradients are
          all-reduced after the backward of the last micro-step
    fsdp  FSDP2 (torch.distributed.fsdp.fully_shard), per block then the root (embedding, final
          norm, tied output layer): parameters, gradients and optimizer states are split over the
          processes; each block's parameters are all-gathered just before its forward and its
          backward, and gradients are reduce-scattered

Activation checkpointing keeps only a block's input in the forward and recomputes the block in
the backward: "block" does so for every block (activations of about one block instead of all),
"selective" for every other block, from the first (half the saving for half the recompute).
scripts/memory_plan.py estimates what each choice costs per GPU.
"""

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from pretrain.train_config import ACTIVATION_CHECKPOINTING, PARALLELISMS


def local_shard(t):
    """This process's part of a tensor: a DTensor's local shard (FSDP), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def checkpointed_blocks(n_layer, mode):
    """Indices of the blocks whose activations are recomputed in the backward."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, got {mode!r}")
    return {"none": [], "block": list(range(n_layer)), "selective": list(range(0, n_layer, 2))}[mode]


def recompute_in_backward(forward):
    """`forward` run under torch.utils.checkpoint (non-reentrant; RNG state kept, so dropout draws the
    same masks when recomputed). A function of our own, not a partial of checkpoint: torch.compile
    skips torch's checkpoint when it is the frame being compiled, but traces it (as one recomputed
    region) when our function calls it."""
    def checkpointed(*args):
        return checkpoint(forward, *args, use_reentrant=False)
    return checkpointed


def apply_activation_checkpointing(model, mode):
    """Recompute the chosen blocks in the backward. The block's forward is replaced rather than the
    block wrapped, so parameter names, and so checkpoints, are the same with or without it."""
    for i in checkpointed_blocks(len(model.transformer.h), mode):
        block = model.transformer.h[i]
        block.forward = recompute_in_backward(block.forward)


def apply_fsdp(model, runtime, dtype, reshard_after_forward=True):
    """Shard every block, then the root. With bf16 (or fp16), on CUDA and on the CPU alike, parameters are
    all-gathered in that dtype and gradients reduced in fp32 (the fp32 sharded parameters are the master
    copy); with float32 everything stays fp32. Unlike DDP under autocast, which casts a weight to bf16 only
    for the ops autocast runs in bf16 (matmuls), every gathered parameter is bf16 here, LayerNorm's and the
    embedding's too: tests/test_fsdp.py compares the two. Inputs are not cast: the residual stream and the
    RoPE tables stay fp32, and autocast picks each op's precision."""
    low_precision = dtype != "float32"
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype) if low_precision else None,
                                     reduce_dtype=torch.float32 if low_precision else None,
                                     cast_forward_inputs=False)
    mesh = init_device_mesh(runtime.device_type, (runtime.world_size,))
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        # the last block's backward comes right after the forward: resharding it would only gather it again
        fully_shard(block, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    # the root (embedding, final norm, tied output layer) keeps FSDP2's default: its parameters stay
    # gathered from the forward to the backward, where the output layer needs them again first thing;
    # resharding it would add an exposed all-gather of the embedding per micro-step
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def parallelize(model, runtime, dtype, parallelism="ddp", compile=False, activation_checkpointing="none",
                reshard_after_forward=True):
    """Apply activation checkpointing, compile and the parallelism to `model` (in place where possible).
    Returns (model to evaluate, model to train): the compiled model and its DDP wrapper, or the sharded
    model twice under FSDP. Parameters keep their names throughout, and `model` itself stays the module
    whose state_dict and parameters the optimizer and checkpoints use. With one process there is
    nothing to replicate or shard: parallelism only matters under torchrun."""
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism must be one of {PARALLELISMS}, got {parallelism!r}")
    apply_activation_checkpointing(model, activation_checkpointing)
    if parallelism == "fsdp" and runtime.distributed:
        if compile:  # per block, so that FSDP's all-gathers stay between the compiled regions
            for block in model.transformer.h:
                block.compile()
        apply_fsdp(model, runtime, dtype, reshard_after_forward)
        return model, model
    compiled = torch.compile(model) if compile else model
    if not runtime.distributed:
        return compiled, compiled
    # gradients live in DDP's communication buckets (no second copy, 4 bytes per parameter saved); the
    # only buffers are the RoPE tables, equal on every process: nothing to broadcast each forward
    ddp = DDP(compiled, device_ids=[runtime.local_rank] if runtime.device_type == "cuda" else None,
              gradient_as_bucket_view=True, broadcast_buffers=False)
    return compiled, ddp


def is_sharded(model):
    return isinstance(model, FSDPModule)


def gradient_sync(train_model, sync):
    """Context for one micro-step's backward: gradients are reduced over the processes only when
    `sync` (the last micro-step); before that they accumulate locally (DDP's no_sync; under FSDP
    unsharded, in fp32, until the reduce-scatter)."""
    if isinstance(train_model, DDP) and not sync:
        return train_model.no_sync()
    if isinstance(train_model, FSDPModule):
        train_model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def clip_grad_norm(parameters, max_norm):
    """Clip the global gradient norm over all processes; returns the norm before clipping as a
    plain tensor. Under FSDP the gradients are DTensor shards: clip_grad_norm_ reduces their norms
    over the processes and returns a replicated DTensor, made local with full_tensor()."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def compile_counts():
    """(graphs compiled, graph breaks, {break reason: count}) so far in this process, from dynamo's
    counters. A graph break leaves the code around it to run eagerly."""
    from torch._dynamo.utils import counters
    breaks = dict(counters["graph_break"])
    return counters["stats"]["unique_graphs"], sum(breaks.values()), breaks


def compile_summary():
    """What torch.compile has made of the model so far, for the log, with the reasons of any break."""
    graphs, n_breaks, breaks = compile_counts()
    reasons = "; ".join(f"{reason.splitlines()[0]} (x{n})" for reason, n in breaks.items())
    return f"torch.compile: {graphs} graphs, {n_breaks} graph breaks" + (f": {reasons}" if reasons else "")
