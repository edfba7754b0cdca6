"""
Where a process runs: device and precision, the torchrun process group, the hardware's
peak FLOP/s for MFU, peak memory, and the provenance every run records.
Shared by train.py, scripts/bench.py and eval/.
"""

import contextlib
import ctypes
import datetime
import os
import platform
import re
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain import exits

# the checkout's top folder (this package's parent), computed here once: git provenance, and the entry points
# that read the repo's own files
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# dense bf16 tensor-core peak FLOP/s per GPU (vendor datasheets, without sparsity: half the "with sparsity"
# figure). A key matches the device name as whole words, the longest key first: "H100 PCIe" before "H100",
# and "B200" never matches a GB200 nor "H20" an H200.
PEAK_BF16_FLOPS = {
    "GB300": 2500e12,  # per GPU: a superchip holds two
    "B300": 2250e12,  # HGX B300
    "GB200": 2500e12,  # per GPU: a superchip holds two
    "B200": 2250e12,  # HGX B200
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H800 PCIe": 756e12,
    "H800": 989e12,  # SXM
    "H20": 148e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


# autocast dtypes a run or an evaluation may ask for; "auto" picks per device (resolve_dtype)
DTYPES = ("auto", "float32", "bfloat16", "float16")


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


class DeviceError(ValueError):
    """A device this machine does not have."""


def pick_device(device="auto", local_rank=None):
    """The device a process runs on; on CUDA always with an index (torch.cuda.set_device refuses a bare
    "cuda"). "auto" is cuda > mps > cpu. Under torchrun (local_rank given) a CUDA process takes GPU
    local_rank of its node; a single process takes the index given ("cuda:1"), else GPU 0."""
    if device == "auto":
        mps = getattr(torch.backends, "mps", None)
        device = "cuda" if torch.cuda.is_available() else "mps" if mps and mps.is_available() else "cpu"
    device_type, _, index = device.partition(":")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device={device!r}, but torch sees no CUDA GPU on this machine; "
                              f"use --device=auto or --device=cpu")
        if local_rank is not None:
            gpu = local_rank
        elif index.isdigit():
            gpu = int(index)
        elif not index:
            gpu = 0
        else:
            raise DeviceError(f"device={device!r}: expected cuda or cuda:<index>")
        if gpu >= torch.cuda.device_count():
            raise DeviceError(f"device={device!r} asks for GPU {gpu}, but only {torch.cuda.device_count()} "
                              f"are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        return f"cuda:{gpu}"
    if device_type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DeviceError(f"device={device!r}, but MPS is not available here; use --device=auto or --device=cpu")
    if device_type not in ("cpu", "mps"):
        raise DeviceError(f"unknown device {device!r}: expected auto, cpu, mps, cuda or cuda:<index>")
    if device_type == "cpu":  # train.py, scripts/bench.py and eval/ all pick their device here
        reuse_freed_memory()
    return device


def reuse_freed_memory():
    """On the CPU, glibc's malloc serves each large tensor (the logits alone are tokens x 50,304 floats)
    with fresh pages from mmap and unmaps them when the tensor is freed, so the kernel faults in and
    zeroes the same memory again every step: half the step time of the tiny configs. Have malloc keep
    large blocks on its heap and reuse them instead; the resident set then stays near its peak. Returns
    whether it could: not where the C library is not glibc, nor with a glibc older than 2.35, which
    caps the threshold at 32 MiB (then malloc is left as it was: its dynamic threshold is better than
    a fixed one that low)."""
    largest = 2**31 - 1
    return set_malloc_thresholds(mmap_bytes=largest, trim_bytes=largest)


def set_malloc_thresholds(mmap_bytes, trim_bytes):
    """glibc's M_MMAP_THRESHOLD (blocks this large or larger get their own mmap, unmapped when freed) and
    M_TRIM_THRESHOLD (free memory at the heap's top beyond this goes back to the OS). Returns whether
    malloc took them; the trim threshold is set only once it took the mmap one. False without glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    if not mallopt(-3, ctypes.c_int(mmap_bytes)):  # M_MMAP_THRESHOLD
        return False
    return bool(mallopt(-1, ctypes.c_int(trim_bytes)))  # M_TRIM_THRESHOLD


def setup_runtime(device="auto", backend="auto", timeout_s=1800):
    """Join the torchrun process group when launched by torchrun (RANK/LOCAL_RANK/WORLD_SIZE),
    else run as a single process. backend "auto" is nccl with CUDA and gloo without. timeout_s: how long a
    collective waits for the slowest process before it fails (NCCL's own default is 10 minutes)."""
    launched = "RANK" in os.environ
    local_rank = int(os.environ["LOCAL_RANK"]) if launched else None
    device = pick_device(device, local_rank)
    device_type = device.split(":")[0]
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not launched:
        return Runtime(0, 0, 1, device, device_type, False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=torch.device(device) if device_type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return Runtime(rank, local_rank, world_size, device, device_type, True)


class StopSignals:
    """SIGTERM (a scheduler's preemption or time limit) and SIGINT (Ctrl-C) ask a run to stop: the first
    is noted, and the training loop ends after its current step with a checkpoint. A second one then
    takes its default action at once (KeyboardInterrupt, termination), unless ignore_repeats (under
    torchrun, whose agent forwards the signal it got to ranks that may have got it already)."""
    def __init__(self, ignore_repeats=False):
        self.received = None
        self.ignore_repeats = ignore_repeats
        self.defaults = {signum: signal.signal(signum, self.note) for signum in exits.SIGNALLED}

    def note(self, signum, frame):
        if self.received is not None:
            return  # ignore_repeats: the handlers stay ours
        self.received = signum
        if not self.ignore_repeats:
            for other, handler in self.defaults.items():
                signal.signal(other, handler)

    @property
    def requested(self):
        return self.received is not None

    @property
    def name(self):
        return signal.Signals(self.received).name if self.requested else None

    @property
    def exit_status(self):
        return exits.SIGNALLED[self.received] if self.requested else None


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
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
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


def peak_flops_of(name):
    """Peak bf16 FLOP/s of a GPU by its name (torch.cuda.get_device_name), None where unknown."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return PEAK_BF16_FLOPS[key]
    return None


def peak_flops(device):
    """Peak bf16 FLOP/s of a CUDA device, None where unknown (CPU, MPS, GPUs not in PEAK_BF16_FLOPS: for those,
    one line says that MFU is n/a and names the device)."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_of(name)
    if peak is None:
        print(f"MFU: n/a: no peak bf16 FLOP/s known for {name!r} (add it to PEAK_BF16_FLOPS in pretrain/runtime.py)",
              file=sys.stderr, flush=True)
    return peak


def reset_peak_memory(device_type):
    """Start a new peak-memory window (train.py reports the peak of each log interval): CUDA's
    allocator statistics, or on Linux the process's resident-set high-water mark."""
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the kernel's peak resident set size
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the whole run


def peak_memory_gb(device_type):
    """Peak memory since the last reset_peak_memory: the CUDA allocator's peak on GPU, the peak
    resident set size on Linux; on other systems the process's peak resident set since it started."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    try:  # Linux: VmHWM, the high-water mark that reset_peak_memory resets
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1e6
    except (OSError, StopIteration):  # elsewhere: the process's peak since it started, never reset
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
        return rss * (1 if sys.platform != "darwin" else 1 / 1024) / 1e6


# git, trusting this repository even where another user owns the checkout (a shared cluster directory):
# it only reads the commit, the dirty flag and the diff
GIT = ["git", "-c", f"safe.directory={REPO}"]


def git_state():
    """(commit, dirty) of the repository this code runs from, or (None, None) outside git."""
    try:
        commit = subprocess.run([*GIT, "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        status = subprocess.run([*GIT, "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout
        return commit, (bool(status.strip()) if commit else None)
    except (OSError, subprocess.SubprocessError):
        return None, None


def git_diff():
    """The uncommitted changes to tracked files (`git diff HEAD`), or None outside git."""
    try:
        return subprocess.run([*GIT, "diff", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


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
