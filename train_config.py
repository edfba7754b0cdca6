"""
Every config key of a training run, in one place: its default, its type, what it means (shown by
`python train.py --help`), its group, and the checks its value must pass. The keys are dataclass
fields, grouped by what they decide; the model's keys are model.GPTConfig's fields, read from there.
Config files and overrides set any key by its name (configurator.py):

    python train.py config/xsa_0p7b.py --learning_rate=3e-4

train.py, bench.py, checkpoint.py, eval/compare.py, scripts/memory_plan.py and the sweep scripts all
take the keys from here. docs/extending.md lists what adding a key or an attention variant touches.
"""

import os
from dataclasses import dataclass, fields
from typing import Literal

from configurator import ConfigError, keys_of, parse_config
from model import GPTConfig

# the choices of a few keys, which optimizers.py and parallelize.py also check
OPTIMIZERS = ("adamw", "muon")
PARALLELISMS = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")


@dataclass
class Run:
    """Where a run lives and what it writes there.

    Attributes:
        out_dir: run directory (checkpoints, logs); None derives out/<config file name>
        init_from: "scratch", or "resume" from the newest checkpoint in out_dir
        overwrite: from scratch in an out_dir holding checkpoints: move them aside (else refused)
        eval_interval: optimizer steps between validation-loss evaluations (and at the last step)
        log_interval: optimizer steps between log lines and metrics.jsonl records
        sample_interval: optimizer steps between text samples printed to the log; 0: never
        checkpoint_interval: optimizer steps between checkpoints (and at the last step); 0: last only
        keep_checkpoints: newest checkpoints kept in out_dir (and always the best validation loss's)
    """
    out_dir: str | None = None
    init_from: Literal["scratch", "resume"] = "scratch"
    overwrite: bool = False
    eval_interval: int = 1000
    log_interval: int = 10
    sample_interval: int = 0
    checkpoint_interval: int = 1000
    keep_checkpoints: int = 2


@dataclass
class Guards:
    """When a run stops itself rather than train on (docs/training.md, Guards).

    Attributes:
        skip_nonfinite_steps: optimizer steps with a non-finite loss or gradient norm to skip before stopping
        loss_spike_factor: a train loss above this multiple of its recent mean is a spike (not checkpointed); 0: off
        loss_spike_steps: spikes in a row that stop the run (exit 3)
    """
    skip_nonfinite_steps: int = 0
    loss_spike_factor: float = 3.0
    loss_spike_steps: int = 3


@dataclass
class Wandb:
    """Weights & Biases logging.

    Attributes:
        wandb_log: send metrics and the config to Weights & Biases
        wandb_project: wandb project
        wandb_group: wandb group; None: the config name without its variant prefix, shared by SA and XSA
        wandb_run_name: wandb run name; None: the config file name
    """
    wandb_log: bool = False
    wandb_project: str = "xsa"
    wandb_group: str | None = None
    wandb_run_name: str | None = None


@dataclass
class Data:
    """What a run trains and is evaluated on.

    Attributes:
        data_dir: directory of llm.c token shards (*_train_*.bin, *_val_*.bin)
        val_tokens: validation tokens per evaluation, capped at the val shards, split across ranks
    """
    data_dir: str = "data/fineweb/fineweb100B"
    val_tokens: int = 10_485_760


@dataclass
class Step:
    """One optimizer step: its tokens and its precision.

    Attributes:
        total_batch_size: tokens per optimizer step over all processes (paper: 256 x 2048)
        batch_size: sequences per process per micro-step; gradient accumulation makes up the rest
        dtype: "auto" (bfloat16 on GPUs that support it, else float32), "float32" or "bfloat16"; "float16" is
            refused (there is no loss scaling)
    """
    total_batch_size: int = 524_288
    batch_size: int = 8
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


@dataclass
class Optimizer:
    """AdamW (or Muon for the blocks' matrices, optimizers.py), linear warmup, cosine decay to min_lr.

    Attributes:
        optimizer: "adamw" (the paper's), or "muon": Muon for the blocks' matrices, AdamW for the rest
        learning_rate: peak learning rate
        max_iters: total optimizer steps
        warmup_iters: steps of linear warmup from 0
        lr_decay_iters: step where the cosine reaches min_lr; None means max_iters
        min_lr: final learning rate; None means learning_rate / 10
        weight_decay: AdamW weight decay on matrices (not norms, biases, gates or sinks)
        beta1: AdamW beta1
        beta2: AdamW beta2
        grad_clip: clip the global gradient norm to this value; 0 disables clipping
        muon_learning_rate: Muon's peak learning rate, on the same schedule; None means learning_rate
        muon_weight_decay: Muon's weight decay; None: weight_decay with match_rms_adamw, 0.1 x that with original
        muon_momentum: Muon's Nesterov momentum
        muon_adjust_lr: Muon's per-matrix LR rule: "match_rms_adamw" (AdamW's LR carries over) or "original"
    """
    optimizer: Literal[OPTIMIZERS] = "adamw"
    learning_rate: float = 6e-4
    max_iters: int = 200_000
    warmup_iters: int = 2000
    lr_decay_iters: int | None = None
    min_lr: float | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    muon_learning_rate: float | None = None
    muon_weight_decay: float | None = None
    muon_momentum: float = 0.95
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"


@dataclass
class System:
    """Where and how the steps run; none of it changes what is trained.

    Attributes:
        device: "auto" (cuda > mps > cpu), or e.g. "cpu", "cuda", "cuda:1"
        compile: torch.compile the model
        backend: torch.distributed backend; "auto" is nccl with CUDA and gloo without
        parallelism: "ddp": a full replica per process; "fsdp": FSDP2, parameters/gradients/optimizer sharded
        reshard_after_forward: fsdp: free gathered block parameters after forward (False: more memory, less traffic)
        activation_checkpointing: "none", "block" (recompute every block in the backward), "selective" (every other)
    """
    device: str = "auto"
    compile: bool = True
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    parallelism: Literal[PARALLELISMS] = "ddp"
    reshard_after_forward: bool = True
    activation_checkpointing: Literal[ACTIVATION_CHECKPOINTING] = "none"


@dataclass
class Seeds:
    """Two runs with the same seeds start from the same weights and see the same batches.

    Attributes:
        seed: initialisation and dropout seed
        data_seed: shard order seed; None means seed (SA and XSA with one seed see the same batches)
    """
    seed: int = 1337
    data_seed: int | None = None


# the keys, in the order --help lists them and config.json records them
SECTIONS = (Run, Data, Wandb, GPTConfig, Step, Optimizer, Guards, System, Seeds)
TRAIN_KEYS = keys_of(*SECTIONS)
MODEL_KEYS = tuple(f.name for f in fields(GPTConfig))

# -----------------------------------------------------------------------------
# key groups (checkpoint.py, eval/compare.py)

# what the parameters are and compute, every model key but two a trained model may continue with other
# values of (a longer context: RoPE has no learned positions; dropout): a checkpoint resumes only into a
# run with the same values
ARCHITECTURE_KEYS = tuple(k for k in MODEL_KEYS if k not in ("block_size", "dropout"))
# the attention variant, which a comparison sets against the SA baseline within one setting
VARIANT_KEYS = ("attn_type", "xsa_gate", "xsa_layers")
# runs of two variants with the same values here form a pair: same initialisation, same batches
PAIRING_KEYS = tuple(f.name for f in fields(Seeds))
# where and how a run is named, logged, launched, guarded or parallelised: never what it trains
BOOKKEEPING_KEYS = tuple(f.name for section in (Run, Wandb, Guards, System) for f in fields(section))


def variant_name(config):
    """The attention variant of a config, as run names, labels and legends spell it: "sa", "xsa",
    "xsa_gate", "xsa_last6" (XSA in the last 6 blocks), "xsa_blocks0-5-11" (in blocks 0, 5 and 11),
    "xsa_gate_last6". Keys a config lacks (runs of an older train.py) have their defaults."""
    value = lambda key: config.get(key, TRAIN_KEYS[key].default)
    parts = [value("attn_type")]
    if value("xsa_gate"):
        parts.append("gate")
    layers = value("xsa_layers")
    if layers is not None:
        parts.append(f"last{layers}" if isinstance(layers, int) else "blocks" + str(layers).replace(",", "-"))
    return "_".join(parts)


def derive_names(config, config_files):
    """out_dir, wandb run name and group from the config file's name where not set. Config files are
    named <attn_type>_<setting> (sa_0p7b.py, xsa_0p7b.py): the runs of one setting share its group."""
    name = os.path.splitext(os.path.basename(config_files[-1]))[0] if config_files else "run"
    config["out_dir"] = config["out_dir"] or os.path.join("out", name)
    config["wandb_run_name"] = config["wandb_run_name"] or name
    if config["wandb_group"] is None:
        config["wandb_group"] = name.removeprefix(config["attn_type"] + "_")


# -----------------------------------------------------------------------------
# checks beyond the types (a ConfigError exits with 2, before anything runs or is written)

MAX_LEARNING_RATE = 1e3  # far above any that trains these models (1e300 would overflow AdamW's fp32 step)


def check(c):
    """Ranges of a resolved config, the model's own checks among them."""
    positive = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "total_batch_size", "batch_size",
                "max_iters", "eval_interval", "log_interval", "val_tokens", "keep_checkpoints", "learning_rate",
                "rope_theta", "muon_learning_rate")
    non_negative = ("n_sinks", "warmup_iters", "checkpoint_interval", "sample_interval", "skip_nonfinite_steps",
                    "seed", "data_seed", "weight_decay", "muon_weight_decay", "grad_clip", "min_lr",
                    "lr_decay_iters", "loss_spike_factor", "loss_spike_steps")
    for key in positive:
        if c[key] is not None and not c[key] > 0:
            raise ConfigError(f"{key} must be positive, got {c[key]!r}")
    for key in non_negative:
        if c[key] is not None and not c[key] >= 0:
            raise ConfigError(f"{key} must not be negative, got {c[key]!r}")
    for key in ("beta1", "beta2", "dropout", "muon_momentum"):
        if not 0 <= c[key] < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {c[key]!r}")
    for key in ("learning_rate", "min_lr", "muon_learning_rate"):
        if c[key] is not None and not c[key] <= MAX_LEARNING_RATE:  # also catches nan and inf
            raise ConfigError(f"{key}={c[key]!r} is not a learning rate for AdamW or Muon: at most "
                              f"{MAX_LEARNING_RATE:g} (the paper's are 3e-4 to 5e-4)")
    if c["dtype"] == "float16":  # its 5-bit exponent underflows small gradients without a loss scaler
        raise ConfigError("dtype='float16' needs loss scaling, which this trainer does not do; use 'bfloat16' "
                          "(GPUs from Ampere on) or 'float32'")
    if c["loss_spike_factor"] and c["loss_spike_factor"] <= 1:
        raise ConfigError(f"loss_spike_factor must be above 1 (or 0: off), got {c['loss_spike_factor']!r}")
    if os.path.exists(c["out_dir"]) and not os.path.isdir(c["out_dir"]):
        raise ConfigError(f"out_dir {c['out_dir']!r} is a file, not a directory")


def model_config(config):
    """The GPTConfig of a config (a dict holding at least the model keys; a run's, or a checkpoint's)."""
    return GPTConfig(**{k: config[k] for k in MODEL_KEYS if k in config})


def fill_derived(c):
    """Set the keys whose None means a value derived from other keys; returns c."""
    c["data_seed"] = c["seed"] if c["data_seed"] is None else c["data_seed"]
    c["min_lr"] = c["learning_rate"] / 10 if c["min_lr"] is None else c["min_lr"]
    if c["muon_weight_decay"] is None:  # Muon's reference recipe decays 10x less under its own LR rule
        c["muon_weight_decay"] = c["weight_decay"] * (0.1 if c["muon_adjust_lr"] == "original" else 1.0)
    return c


def resolve(argv, keys=TRAIN_KEYS, prog="train.py"):
    """A run's config from the command line: the keys' defaults, then the config files and overrides
    of argv; names and derived values filled in; checked. Returns (config, config files); ConfigError."""
    c, config_files = parse_config(keys, argv, prog)
    derive_names(c, config_files)
    fill_derived(c)
    try:
        c["xsa_layers"] = model_config(c).xsa_layers  # the model's checks; "0,5,11" for a list of blocks
    except ValueError as e:
        raise ConfigError(str(e)) from e
    check(c)
    return c, config_files
