"""
Every config key of a training run, in one place. A key is a dataclass field: its default, its type,
its meaning (shown by `python train.py --help`), the checks its value must pass and, where None stands
for a value derived from other keys, that derivation, all at the field. The keys are grouped by what
they decide; the model's keys are model.GPTConfig's fields (checked by GPTConfig itself). Config files
and overrides set any key by its name (configurator.py):

    python train.py config/xsa_0p7b.py --learning_rate=3e-4

The resolved config is a TrainConfig, read by attribute: `c.learning_rate`. train.py, scripts/bench.py,
checkpointer.py, eval/compare.py, scripts/memory_plan.py and the sweep scripts all take the keys from
here. docs/extending.md lists what adding a key or an attention variant touches.
"""

import os
from dataclasses import dataclass, fields
from typing import Literal

import configurator
from configurator import ConfigError, Config, config_class, fraction, key, non_negative, positive
from model import GPTConfig
from pretrain.runtime import DTYPES

# the choices of a few keys, which optimizers.py and parallelize.py also check
OPTIMIZERS = ("adamw", "muon")
PARALLELISMS = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")

MAX_LEARNING_RATE = 1e3  # far above any that trains these models (1e300 would overflow AdamW's fp32 step)


def learning_rate_bound(name, value):
    if not value <= MAX_LEARNING_RATE:  # also catches nan and inf
        return (f"{name}={value!r} is not a learning rate for AdamW or Muon: at most {MAX_LEARNING_RATE:g} "
                f"(the paper's are 3e-4 to 5e-4)")


def trainable_dtype(name, value):
    if value == "float16":  # its 5-bit exponent underflows small gradients without a loss scaler
        return ("dtype='float16' needs loss scaling, which this trainer does not do; use 'bfloat16' "
                "(GPUs from Ampere on) or 'float32'")


def spike_factor(name, value):
    if value and not value > 1:
        return f"{name} must be above 1 (or 0: off), got {value!r}"


def a_directory(name, value):
    if os.path.exists(value) and not os.path.isdir(value):
        return f"{name} {value!r} is a file, not a directory"


def an_existing_directory(name, value):
    if not os.path.isdir(value):
        return f"{name} {value!r}: no such directory"


def task_list(name, value):
    tasks = value.replace(",", " ").split()
    if not tasks:
        return f"{name} names no task; give lm-eval task names, comma separated"
    repeated = sorted({task for task in tasks if tasks.count(task) > 1})
    if repeated:  # downstream/avg would count it twice
        return f"{name} names {', '.join(repeated)} more than once; give each task once"


@dataclass
class RunKeys:
    """Where a run lives and what it writes there."""
    out_dir: str | None = key(None, "run directory (checkpoints, logs); None derives out/<config file name>",
                              check=a_directory, derive=lambda c, name: os.path.join("out", name))
    init_from: Literal["scratch", "resume"] = key("scratch", '"scratch", or "resume" from the newest checkpoint in out_dir')
    overwrite: bool = key(False, "from scratch in an out_dir holding checkpoints: move them aside (else refused)")
    eval_interval: int = key(1000, "optimizer steps between validation-loss evaluations (and at the last step)",
                             check=positive)
    log_interval: int = key(10, "optimizer steps between log lines and metrics.jsonl records", check=positive)
    sample_interval: int = key(0, "optimizer steps between text samples printed to the log; 0: never",
                               check=non_negative)
    checkpoint_interval: int = key(1000, "optimizer steps between checkpoints (and at the last step); 0: last only",
                                   check=non_negative)
    keep_checkpoints: int = key(2, "newest checkpoints kept in out_dir (and always the best validation loss's)",
                                check=positive)


# the paper's 8 zero-shot tasks (Table 2), as lm-eval names them, in the paper's column order (eval/downstream.py's
# TASKS gives each its column and headline metric)
PAPER_TASKS = ("arc_easy", "boolq", "hellaswag", "lambada_openai", "openbookqa", "piqa", "social_iqa", "winogrande")


@dataclass
class InLoopKeys:
    """What a run measures besides the loss while it trains (docs/training.md, "In-loop evaluation")."""
    similarity_interval: int | None = key(None, "optimizer steps between similarity-bias passes (cos(y_i, v_i) per "
                                                "layer, on a fixed val batch); None: eval_interval; 0: never",
                                          check=non_negative, derive=lambda c, name: c.eval_interval)
    downstream_interval: int = key(0, "optimizer steps between zero-shot downstream evaluations (lm-eval, and at "
                                      "the last step); 0: never", check=non_negative)
    downstream_tasks: str = key(",".join(PAPER_TASKS), "lm-eval task names, comma separated; default: the paper's 8",
                                check=task_list)
    downstream_limit: int = key(500, "examples per task: the first ones, the same at every evaluation",
                                check=positive)
    downstream_include_path: str | None = key(None, "a folder of lm-eval task YAMLs (local task copies, offline); "
                                                    "the tasks then come from it alone",
                                              check=an_existing_directory)


@dataclass
class DataKeys:
    """What a run trains and is evaluated on."""
    data_dir: str = key("data/fineweb/fineweb100B", "directory of llm.c token shards (*_train_*.bin, *_val_*.bin)")
    val_tokens: int = key(10_485_760, "validation tokens per evaluation, capped at the val shards, split across ranks",
                          check=positive)


@dataclass
class WandbKeys:
    """Weights & Biases logging."""
    wandb_log: bool = key(False, "send metrics and the config to Weights & Biases")
    wandb_project: str = key("xsa", "wandb project")
    # config files are named <attn_type>_<setting> (sa_0p7b.py, xsa_0p7b.py): a setting's runs share a group
    wandb_group: str | None = key(None, "wandb group; None: the config name without its variant prefix, shared by "
                                        "SA and XSA", derive=lambda c, name: name.removeprefix(c.attn_type + "_"))
    wandb_run_name: str | None = key(None, "wandb run name; None: the config file name", derive=lambda c, name: name)


@dataclass
class StepKeys:
    """One optimizer step: its tokens and its precision."""
    total_batch_size: int = key(524_288, "tokens per optimizer step over all processes (paper: 256 x 2048)",
                                check=positive)
    batch_size: int = key(8, "sequences per process per micro-step; gradient accumulation makes up the rest",
                          check=positive)
    dtype: Literal[DTYPES] = key("auto", '"auto" (bfloat16 on GPUs that support it, else float32), "float32" or '
                                         '"bfloat16"; "float16" is refused (there is no loss scaling)',
                                 check=trainable_dtype)


@dataclass
class OptimizerKeys:
    """AdamW (or Muon for the blocks' matrices, optimizers.py), linear warmup, cosine decay to min_lr."""
    optimizer: Literal[OPTIMIZERS] = key("adamw", '"adamw" (the paper\'s), or "muon": Muon for the blocks\' '
                                                  'matrices, AdamW for the rest')
    learning_rate: float = key(6e-4, "peak learning rate", check=(positive, learning_rate_bound))
    max_iters: int = key(200_000, "total optimizer steps", check=positive)
    warmup_iters: int = key(2000, "steps of linear warmup from 0", check=non_negative)
    lr_decay_iters: int | None = key(None, "step where the cosine reaches min_lr; None means max_iters",
                                     check=non_negative)
    min_lr: float | None = key(None, "final learning rate; None means learning_rate / 10",
                               check=(non_negative, learning_rate_bound), derive=lambda c, name: c.learning_rate / 10)
    weight_decay: float = key(0.1, "AdamW weight decay on matrices (not norms, biases, gates or sinks)",
                              check=non_negative)
    beta1: float = key(0.9, "AdamW beta1", check=fraction)
    beta2: float = key(0.95, "AdamW beta2", check=fraction)
    grad_clip: float = key(1.0, "clip the global gradient norm to this value; 0 disables clipping", check=non_negative)
    muon_learning_rate: float | None = key(None, "Muon's peak learning rate, on the same schedule; None means "
                                                 "learning_rate", check=(positive, learning_rate_bound))
    # Muon's reference recipe decays 10x less under its own LR rule
    muon_weight_decay: float | None = key(
        None, "Muon's weight decay; None: weight_decay with match_rms_adamw, 0.1 x that with original",
        check=non_negative,
        derive=lambda c, name: c.weight_decay * (0.1 if c.muon_adjust_lr == "original" else 1.0))
    muon_momentum: float = key(0.95, "Muon's Nesterov momentum", check=fraction)
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = key(
        "match_rms_adamw", 'Muon\'s per-matrix LR rule: "match_rms_adamw" (AdamW\'s LR carries over) or "original"')


@dataclass
class GuardKeys:
    """When a run stops itself rather than train on (docs/training.md, GuardKeys)."""
    skip_nonfinite_steps: int = key(0, "optimizer steps with a non-finite loss or gradient norm to skip before "
                                       "stopping", check=non_negative)
    loss_spike_factor: float = key(1.5, "a train loss above this multiple of the run's floor (the lowest its moving "
                                        "average reached) plus loss_spike_margin is a spike; 0: off",
                                   check=(non_negative, spike_factor))
    loss_spike_margin: float = key(0.5, "nats added to the spike threshold, for the noise of small batches",
                                   check=non_negative)
    loss_spike_steps: int = key(3, "spikes in a row that stop the run (exit 3)", check=positive)


@dataclass
class SystemKeys:
    """Where and how the steps run; none of it changes what is trained."""
    device: str = key("auto", '"auto" (cuda > mps > cpu), or e.g. "cpu", "cuda", "cuda:1"')
    compile: bool = key(True, "torch.compile the model")
    backend: Literal["auto", "nccl", "gloo"] = key("auto", 'torch.distributed backend; "auto" is nccl with CUDA '
                                                           'and gloo without')
    parallelism: Literal[PARALLELISMS] = key("ddp", '"ddp": a full replica per process; "fsdp": FSDP2, '
                                                    'parameters/gradients/optimizer sharded')
    reshard_after_forward: bool = key(True, "fsdp: free gathered block parameters after forward (False: more "
                                            "memory, less traffic)")
    activation_checkpointing: Literal[ACTIVATION_CHECKPOINTING] = key(
        "none", '"none", "block" (recompute every block in the backward), "selective" (every other)')
    dist_timeout_s: int = key(1800, "seconds a process waits in a collective for the others before the run stops "
                                    "(rank 0 writes DDP's checkpoint alone meanwhile)", check=positive)


@dataclass
class SeedKeys:
    """Two runs with the same seeds start from the same weights and see the same batches."""
    seed: int = key(1337, "initialisation and dropout seed", check=non_negative)
    data_seed: int | None = key(None, "shard order seed; None means seed (SA and XSA with one seed see the same "
                                      "batches)", check=non_negative, derive=lambda c, name: c.seed)


# the keys, in the order --help lists them and config.json records them
SECTIONS = (RunKeys, InLoopKeys, DataKeys, WandbKeys, GPTConfig, StepKeys, OptimizerKeys, GuardKeys, SystemKeys,
            SeedKeys)
MODEL_KEYS = tuple(f.name for f in fields(GPTConfig))
MODEL_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)}


class RunConfig(Config):
    """A config that builds a model: TrainConfig, and the configs of scripts/bench.py and memory_plan.py,
    which add their own keys to train.py's."""

    def model_config(self):
        return model_config(self)


TrainConfig = config_class("TrainConfig", *SECTIONS, base=RunConfig)
TRAIN_KEYS = TrainConfig.keys

# -----------------------------------------------------------------------------
# key groups (checkpointer.py, eval/compare.py)

# what the parameters are and compute, every model key but two a trained model may continue with other
# values of (a longer context: RoPE has no learned positions; dropout): a checkpoint resumes only into a
# run with the same values
ARCHITECTURE_KEYS = tuple(k for k in MODEL_KEYS if k not in ("block_size", "dropout"))
# the attention variant, which a comparison sets against the SA baseline within one setting: the model keys
# whose field says how run names spell them
VARIANT_KEYS = tuple(f.name for f in fields(GPTConfig) if f.metadata.get("variant"))
# runs of two variants with the same values here form a pair: same initialisation, same batches
PAIRING_KEYS = tuple(f.name for f in fields(SeedKeys))
# where and how a run is named, logged, measured, launched, guarded or parallelised: never what it trains
BOOKKEEPING_KEYS = tuple(f.name for section in (RunKeys, InLoopKeys, WandbKeys, GuardKeys, SystemKeys)
                         for f in fields(section))


def variant_name(config):
    """The attention variant of a config (a TrainConfig, or a dict: config.json's), as run names, labels
    and legends spell it: "sa", "xsa", "xsa_gate", "xsa_last6" (XSA in the last 6 blocks),
    "xsa_blocks0-5-11" (in blocks 0, 5 and 11), "xsa_gate_last6". Keys a config lacks (runs of an older
    train.py) have their defaults."""
    values = config if isinstance(config, dict) else config.to_dict()
    spellings = {f.name: f.metadata["variant"] for f in fields(GPTConfig) if f.name in VARIANT_KEYS}
    parts = [spell(values.get(name, TRAIN_KEYS[name].default)) for name, spell in spellings.items()]
    return "_".join(part for part in parts if part is not None)


def model_config(config):
    """The GPTConfig of a run's config (a TrainConfig, or a dict: a checkpoint's or config.json's)."""
    values = config if isinstance(config, dict) else config.to_dict()
    return GPTConfig(**{k: values[k] for k in MODEL_KEYS if k in values})


def resolve(argv, config_class=TrainConfig, prog="train.py"):
    """A run's config from the command line: the keys' defaults, then the config files and overrides of
    argv; names and derived values filled in; checked, the model's own checks among them. Returns
    (config, config files); ConfigError."""
    c, config_files = configurator.resolve(config_class, argv, prog)
    try:
        c.xsa_layers = c.model_config().xsa_layers  # the model's checks; "0,5,11" for a list of blocks
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return c, config_files


def make_config(**values):
    """A TrainConfig of the defaults and `values`, derived and checked as resolve's (tests, notebooks)."""
    return resolve([f"--{name}={value!r}" for name, value in values.items()])[0]
