"""
Where a process runs: device and precision, the torchrun process group, the hardware's
peak FLOP/s for MFU, peak memory, and the provenance every run records.
Shared by train.py, bench.py and eval/.
"""

import contextlib
import os
import platform
import resource
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.abspath(__file__))

# dense bf16 tensor-core peak FLOP/s per device (vendor datasheets, no sparsity)
PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


@dataclass
class Runtime:
    rank: int  # global process index (0 when not launched by torchrun)
    local_rank: int  # process index on this node, selects the GPU
    world_size: int  # number of processes
    device: str  # e.g. "cuda:3", "mps", "cpu"
    device_type: str  # "cuda", "mps" or "cpu"
    distributed: bool  # a process group is initialised

    @property
    def is_main(self):
        return self.rank == 0


def pick_device(device="auto"):
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def setup_runtime(device="auto", backend="auto"):
    """Join the torchrun process group when launched by torchrun (RANK/LOCAL_RANK/WORLD_SIZE),
    else run as a single process. backend "auto" is nccl with CUDA and gloo without."""
    device = pick_device(device)
    device_type = device.split(":")[0]
    if "RANK" not in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(torch.device(device))
        return Runtime(0, 0, 1, device, device_type, False)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=torch.device(device) if device_type == "cuda" else None)
    return Runtime(rank, local_rank, world_size, device, device_type, True)


def teardown_runtime(runtime):
    """Leave the process group cleanly; without it gloo can abort at interpreter exit."""
    if runtime.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def resolve_dtype(dtype, device_type):
    """"auto" is bfloat16 on GPUs that support it, float32 elsewhere."""
    if dtype == "auto":
        if device_type == "cuda" and torch.cuda.is_bf16_supported():
            return "bfloat16"
        return "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dtype


def autocast(device_type, dtype):
    """Mixed-precision context for forward passes: parameters stay fp32, matmuls run in dtype."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def enable_tf32():
    """Leftover fp32 matmuls (outside autocast) use TF32 tensor cores on Ampere and newer."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def peak_flops(device):
    """Peak bf16 FLOP/s of a CUDA device by name, None where unknown (CPU, MPS, other GPUs)."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():  # ordered so that "H100 PCIe" is tried before "H100"
        if key in name:
            return flops
    return None


def peak_memory_gb(device_type):
    """Peak memory of this process so far: CUDA allocator peak on GPU, max resident set on CPU."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return rss_kb * (1 if sys.platform != "darwin" else 1 / 1024) / 1e6


def git_state():
    """(commit, dirty) of the repository this code runs from, or (None, None) outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout
        return commit, (bool(status.strip()) if commit else None)
    except (OSError, subprocess.SubprocessError):
        return None, None


def provenance(runtime=None):
    """What produced a run: code version, libraries and hardware."""
    commit, dirty = git_state()
    devices = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if torch.cuda.is_available() else [platform.processor() or platform.machine()])
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "devices": devices,
        "world_size": runtime.world_size if runtime else 1,
        "hostname": platform.node(),
    }
