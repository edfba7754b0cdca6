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
import functools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

PARALLELISMS = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")


def checkpointed_blocks(n_layer, mode):
    """Indices of the blocks whose activations are recomputed in the backward."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, got {mode!r}")
    return {"none": [], "block": list(range(n_layer)), "selective": list(range(0, n_layer, 2))}[mode]


def apply_activation_checkpointing(model, mode):
    """Run the chosen blocks' forward under torch.utils.checkpoint (non-reentrant; RNG state kept,
    so dropout draws the same masks when recomputed). The block's forward is replaced rather than
    the block wrapped, so parameter names, and so checkpoints, are the same with or without it."""
    for i in checkpointed_blocks(len(model.transformer.h), mode):
        block = model.transformer.h[i]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_fsdp(model, runtime, dtype, reshard_after_forward=True):
    """Shard every block, then the root. On CUDA with bf16 (or fp16), parameters are all-gathered in
    that dtype and gradients reduced in fp32 (the fp32 sharded parameters are the master copy); on
    CPU everything stays fp32. Inputs are not cast: the residual stream and the RoPE tables stay
    fp32 and autocast picks each op's precision, as under DDP."""
    low_precision = runtime.device_type == "cuda" and dtype != "float32"
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype) if low_precision else None,
                                     reduce_dtype=torch.float32 if low_precision else None,
                                     cast_forward_inputs=False)
    mesh = init_device_mesh(runtime.device_type, (runtime.world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)


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
    return compiled, DDP(compiled, device_ids=[runtime.local_rank] if runtime.device_type == "cuda" else None)


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
