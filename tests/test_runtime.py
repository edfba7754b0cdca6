"""runtime.py: the device a process picks (CUDA checked with a faked GPU count), per-interval peak memory."""

import ctypes
import mmap
import os
import re
import sys

import numpy as np
import pytest
import torch

from pretrain import runtime
from pretrain.runtime import DeviceError, pick_device, setup_runtime
from running import REPO, run_script


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA GPUs, as torch reports it; set_device calls are recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return chosen


@pytest.mark.parametrize("device,local_rank,expected", [
    ("cuda", None, "cuda:0"), ("auto", None, "cuda:0"), ("cuda:1", None, "cuda:1"),  # one process
    ("cuda", 1, "cuda:1"), ("auto", 1, "cuda:1"), ("cuda:0", 1, "cuda:1"),  # torchrun: the node's local rank
    ("cpu", None, "cpu"), ("cpu", 1, "cpu")])
def test_cuda_device_always_gets_an_index(two_gpus, device, local_rank, expected):
    assert pick_device(device, local_rank) == expected


def test_single_process_on_one_gpu_sets_an_indexed_device(two_gpus):
    """`python train.py` on a GPU machine: torch.cuda.set_device refuses a bare torch.device("cuda")."""
    rt = setup_runtime("cuda")
    assert (rt.device, rt.device_type, rt.distributed) == ("cuda:0", "cuda", False)
    assert two_gpus == [torch.device("cuda:0")] and two_gpus[0].index == 0


@pytest.mark.parametrize("device,message", [("cuda:2", "asks for GPU 2, but only 2 are visible"),
                                            ("cuda:x", "expected cuda or cuda:<index>"),
                                            ("tpu", "unknown device 'tpu'")])
def test_a_device_the_machine_lacks_is_a_clear_error(two_gpus, device, message):
    with pytest.raises(DeviceError, match=message):
        pick_device(device)


def test_cuda_on_a_machine_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        pick_device("cuda")


def test_peak_memory_is_reset_for_each_interval():
    """A large allocation freed before the reset is not part of the next interval's peak."""
    runtime.reset_peak_memory("cpu")
    baseline = runtime.peak_memory_gb("cpu")
    # 0.4 GB of fresh pages, touched: mapped here rather than taken from malloc, which may hand back
    # memory the process already holds (resident, so not a new peak)
    block = mmap.mmap(-1, 400_000_000)
    pages = np.frombuffer(block, dtype=np.uint8)
    pages[:] = 1
    with_block = runtime.peak_memory_gb("cpu")
    del pages
    block.close()
    assert with_block > baseline + 0.35
    assert runtime.peak_memory_gb("cpu") == pytest.approx(with_block, abs=0.01)  # a peak outlives the memory
    runtime.reset_peak_memory("cpu")
    assert runtime.peak_memory_gb("cpu") < with_block - 0.35


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2: malloc's own account of its memory."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def test_on_the_cpu_large_tensors_reuse_mallocs_heap_instead_of_fresh_mmaps():
    """Else every step's logits come from a new mmap whose pages the kernel zeroes again (runtime.py)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc 2.33 or newer")
    mallinfo2.restype = MallInfo2
    pick_device("cpu")
    if not runtime.reuse_freed_memory():
        pytest.skip("this glibc caps malloc's mmap threshold at 32 MiB")
    before = mallinfo2().hblkhd  # bytes in blocks that have a mapping of their own
    block = torch.ones(100_000_000, dtype=torch.uint8)  # far above the 32 MiB that malloc's mmap threshold reaches by default
    assert mallinfo2().hblkhd - before < 1_000_000 and mallinfo2().arena >= 100_000_000
    del block


def test_provenance_reads_a_checkout_that_another_user_owns(tmp_path):
    """A shared cluster directory or a container's mount: git refuses such a checkout ("dubious
    ownership") unless trusted; runtime trusts the one it runs from, for the commit and dirty flag."""
    import shutil
    import subprocess
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("giving the checkout to another user needs root")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", REPO, str(clone)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    for root, dirs, files in os.walk(clone):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), 65534, 65534)  # nobody
    os.lchown(clone, 65534, 65534)
    no_trust = tmp_path / "gitconfig"
    no_trust.write_text("")  # not the tests' trusting config: the user's situation
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(no_trust)}
    refused = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, env=env)
    assert "dubious ownership" in refused.stderr  # the situation is real
    result = run_script([sys.executable, "-c", "from pretrain import runtime; print(runtime.git_state())"], cwd=clone,
                        env=env)
    assert result.stdout.strip() == repr((head, False)), result.stderr
    shutil.rmtree(clone, ignore_errors=True)


@pytest.mark.parametrize("name,flops", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H20", 148e12), ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA GB200", 2500e12), ("NVIDIA B300 SXM6 AC", 2250e12), ("NVIDIA GB300", 2500e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_match_the_device_name_as_whole_words(name, flops):
    """A GB200 is not a B200, an H20 not an H200, an H100 PCIe not an SXM H100; an unknown GPU has no peak."""
    assert runtime.peak_flops_of(name) == flops


def test_an_unknown_gpu_logs_mfu_as_not_available_in_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(runtime.torch.cuda, "get_device_name", lambda device: "NVIDIA Mystery X1")
    assert runtime.peak_flops("cuda:0") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MFU: n/a" in err[0] and "NVIDIA Mystery X1" in err[0]
    assert runtime.peak_flops("cpu") is None and not capsys.readouterr().err


def test_dist_timeout_s_reaches_the_process_group(monkeypatch):
    """Under torchrun, init_process_group gets dist_timeout_s as its timeout (NCCL's own default is 10 minutes,
    less than rank 0 may spend writing a 0.7B DDP checkpoint on a slow filesystem)."""
    import datetime
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    rt = setup_runtime("cpu", "gloo", timeout_s=1234)
    assert rt.distributed and seen["backend"] == "gloo" and seen["timeout"] == datetime.timedelta(seconds=1234)
    from configurator import format_help
    from pretrain.train_config import TRAIN_KEYS
    assert re.search(r"^  dist_timeout_s +1800 ", format_help(TRAIN_KEYS, "train.py"), re.M)  # what --help prints
