"""configurator.py and train_config.py: the schema of the config keys, config files, --key=value overrides
and their errors, through train.py as users run it."""

import os
from dataclasses import dataclass, fields
from typing import Literal

import pytest
import torch

from configurator import ConfigError, config_class, key, keys_of, parse_config, positive, resolve
from running import REPO, preloaded_python, run_in_process


@dataclass
class Example:
    """A small schema."""
    learning_rate: float = key(6e-4, "peak learning rate", check=positive)
    max_iters: int = key(100, "total steps")
    compile: bool = key(True, "torch.compile the model")
    attn_type: Literal["sa", "xsa"] = key("sa", "the attention")
    head_dim: int | None = key(None, "width of one head; None means n_embd // n_head")
    layers: int | str | list[int] | None = key(None, "the last k blocks, or the blocks listed")


KEYS = keys_of(Example)


@dataclass
class Derived:
    """Keys derived from the others, and text keys."""
    min_lr: float | None = key(None, "final learning rate; None means learning_rate / 10",
                               derive=lambda c, name: c.learning_rate / 10)
    run_name: str | None = key(None, "a name")
    note: str = key("", "some text")


def run_train_cli(*args, cwd=REPO):
    """train.py as a user runs it: its exit status and what it printed (in this process, see conftest)."""
    return run_in_process([os.path.join(REPO, "train.py"), *args], cwd=cwd)


def test_keys_come_with_default_type_meaning_and_checks():
    assert list(KEYS) == [f.name for f in fields(Example)]
    assert KEYS["max_iters"].default == 100 and KEYS["max_iters"].type is int
    assert KEYS["head_dim"].help == "width of one head; None means n_embd // n_head"
    assert KEYS["learning_rate"].section == "A small schema."
    assert KEYS["learning_rate"].checks == (positive,) and KEYS["max_iters"].checks == ()


def test_a_field_without_a_meaning_is_a_schema_error():
    @dataclass
    class Undocumented:
        """One key forgotten."""
        documented: int = key(1, "yes")
        forgotten: int = 2
    with pytest.raises(TypeError, match="Undocumented.forgotten"):
        keys_of(Undocumented)


def test_a_resolved_config_is_read_by_attribute_with_derived_values_and_checks(tmp_path):
    Config = config_class("Config", Example, Derived)
    c, files = resolve(Config, ["--learning_rate=2e-3"])
    assert c.learning_rate == 2e-3 and c.min_lr == pytest.approx(2e-4) and files == []
    assert c.to_dict()["min_lr"] == c.min_lr and Config.from_dict({**c.to_dict(), "gone": 1}) == c
    assert resolve(Config, ["--min_lr=0"])[0].min_lr == 0  # a value given is never derived over
    with pytest.raises(ConfigError, match="learning_rate must be positive, got 0"):
        resolve(Config, ["--learning_rate=0"])


def test_text_keys_take_numeric_looking_values_as_text():
    Config = config_class("Config", Example, Derived)
    c, _ = resolve(Config, ["--run_name=2024", "--note=1e-3", "--layers=3"])
    assert c.run_name == "2024" and c.note == "1e-3"
    assert c.layers == 3  # an int where the key takes one


def test_config_files_then_overrides_in_order(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("learning_rate = 1e-3\nmax_iters = 5\n")
    second.write_text(f"exec(open({str(first)!r}).read())\nattn_type = 'xsa'\n")
    config, files = parse_config(KEYS, [str(second), "--max_iters=7", "--compile=False", "--head_dim=64"])
    assert config == {"learning_rate": 1e-3, "max_iters": 7, "compile": False, "attn_type": "xsa", "head_dim": 64,
                      "layers": None}
    assert files == [str(second)]


def test_int_accepted_for_float_tuple_for_list_and_bare_strings():
    config, _ = parse_config(KEYS, ["--learning_rate=1", "--attn_type=xsa", "--layers=0,2"])
    assert config["learning_rate"] == 1.0 and type(config["learning_rate"]) is float
    assert config["attn_type"] == "xsa" and config["layers"] == [0, 2]
    assert parse_config(KEYS, ["--layers=3"])[0]["layers"] == 3 and parse_config(KEYS, ["--layers=[1]"])[0]["layers"] == [1]


@pytest.mark.parametrize("args,message", [
    (["--learnig_rate=1e-3"], "did you mean learning_rate"),
    (["--max_iters=1.5"], "max_iters expects int"),
    (["--max_iters=True"], "max_iters expects int"),  # a bool is no int
    (["--compile=1"], "compile expects bool"),
    (["--head_dim=a"], "head_dim expects int or None \\(default None\\), got str 'a'"),  # None-default keys are typed too
    (["--layers=True"], "layers expects int or str or list of int or None"),
    (["--attn_type=gsa"], "attn_type must be one of 'sa', 'xsa'; got 'gsa'"),
    (["--max_iters"], "--key=value"),
])
def test_bad_overrides_raise(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(KEYS, args)


def test_unknown_key_in_config_file_names_the_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("max_iter = 10\n")
    with pytest.raises(ConfigError, match=r"'max_iter' in .*bad.py; did you mean max_iters"):
        parse_config(KEYS, [str(path)])


def test_config_files_find_what_they_include_from_any_directory(tmp_path, monkeypatch):
    """config/xsa_tiny.py reads config/sa_tiny.py by a path from the repository root; a file of one's own
    may read a file beside it. Neither depends on the working directory."""
    from pretrain import train_config
    monkeypatch.chdir(tmp_path)
    c, _ = train_config.resolve([os.path.join(REPO, "config", "xsa_tiny.py")])
    assert (c.attn_type, c.n_layer, c.out_dir) == ("xsa", 4, os.path.join("out", "xsa_tiny"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.py").write_text("n_layer = 3\n")
    (tmp_path / "mine" / "xsa_mine.py").write_text("exec(open('base.py').read())\nattn_type = 'xsa'\n")
    monkeypatch.chdir(REPO)
    c, _ = train_config.resolve([str(tmp_path / "mine" / "xsa_mine.py")])
    assert (c.n_layer, c.attn_type, c.wandb_group) == (3, "xsa", "mine")
    (tmp_path / "mine" / "broken.py").write_text("exec(open('missing.py').read())\n")
    with pytest.raises(ConfigError, match="'missing.py' is neither beside .*broken.py nor in a folder above it"):
        train_config.resolve([str(tmp_path / "mine" / "broken.py")])


@pytest.mark.parametrize("args,message", [
    (["config/sa_tiny.py", "--learnig_rate=1e-3"], "unknown config key 'learnig_rate' in the command line; did you mean learning_rate, muon_learning_rate?"),
    (["config/sa_tiny.py", "--n_layer=2.5"], "n_layer expects int (default 12), got float 2.5"),
    (["config/does_not_exist.py"], "config file 'config/does_not_exist.py' does not exist"),
    (["config/sa_tiny.py", "--batch_size=0"], "batch_size must be positive, got 0"),
    (["config/sa_tiny.py", "--eval_interval=0"], "eval_interval must be positive, got 0"),
    (["config/sa_tiny.py", "--log_interval=-5"], "log_interval must be positive, got -5"),
    (["config/sa_tiny.py", "--val_tokens=0"], "val_tokens must be positive, got 0"),
    (["config/sa_tiny.py", "--data_seed=-1"], "data_seed must not be negative, got -1"),
    (["config/sa_tiny.py", "--beta2=1.0"], "beta2 must be in [0, 1), got 1.0"),
    (["config/sa_tiny.py", "--parallelism=zero3"], "parallelism must be one of 'ddp', 'fsdp'; got 'zero3'"),
    (["config/sa_tiny.py", "--head_dim=15"], "head_dim must be even for RoPE, got 15"),
    (["config/sa_tiny.py", "--n_kv_head=a"], "n_kv_head expects int or None (default None), got str 'a'"),
    (["config/xsa_tiny.py", "--xsa_layers=True"], "xsa_layers expects int or str or list of int or None "
                                                  "(default None), got bool True"),
    (["config/xsa_tiny.py", "--xsa_layers=0"], "xsa_layers=0 puts XSA in no block, which is SA: use attn_type='sa'"),
    (["config/sa_tiny.py", "--optimizer=sgd"], "optimizer must be one of 'adamw', 'muon'; got 'sgd'"),
    (["config/sa_tiny.py", "--learning_rate=1e300"], "learning_rate=1e+300 is not a learning rate for AdamW or Muon: "
                                                      "at most 1000 (the paper's are 3e-4 to 5e-4)"),
    (["config/sa_tiny.py", "--dtype=float16"], "dtype='float16' needs loss scaling, which this trainer does not do; use 'bfloat16' "
                                                    "(GPUs from Ampere on) or 'float32'"),
    pytest.param(["config/sa_tiny.py", "--device=cuda"], "device='cuda', but torch sees no CUDA GPU on this machine; "
                 "use --device=auto or --device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
@pytest.mark.slow
def test_train_cli_errors_are_one_line_and_write_nothing(tmp_path, args, message):
    out_dir = tmp_path / "run"
    proc = run_train_cli(*args, f"--out_dir={out_dir}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: {message}"
    assert not out_dir.exists()


def test_train_key_groups_name_only_config_keys():
    from pretrain import train_config
    keys = train_config.TRAIN_KEYS
    groups = {name: getattr(train_config, name) for name in
              ("ARCHITECTURE_KEYS", "VARIANT_KEYS", "PAIRING_KEYS", "BOOKKEEPING_KEYS")}
    for name, group in groups.items():
        assert group and set(group) <= set(keys), (name, set(group) - set(keys))
    # a key is what is trained, how it is paired, or bookkeeping: never two of these
    assert not set(groups["PAIRING_KEYS"]) & set(groups["BOOKKEEPING_KEYS"])
    assert not set(groups["ARCHITECTURE_KEYS"]) & set(groups["BOOKKEEPING_KEYS"])
    assert set(groups["VARIANT_KEYS"]) <= set(groups["ARCHITECTURE_KEYS"])


def test_every_model_field_but_context_and_dropout_is_checked_on_resume():
    """A new GPTConfig field is an architecture key unless listed as one a checkpoint may continue with:
    a checkpoint with another value of it is refused."""
    from pretrain.checkpointer import architecture_mismatch
    from model import GPTConfig
    from pretrain import train_config
    assert set(train_config.MODEL_KEYS) == {f.name for f in fields(GPTConfig)} <= set(train_config.TRAIN_KEYS)
    base = {k: train_config.TRAIN_KEYS[k].default for k in train_config.MODEL_KEYS}
    for name in train_config.MODEL_KEYS:
        changed = {**base, name: "another value"}
        assert (name in architecture_mismatch(base, changed)) == (name not in ("block_size", "dropout")), name


def test_a_checkpoint_older_than_a_model_key_has_its_default():
    """A checkpoint written before attn_mask and eot_token existed computed the causal mask: it resumes into
    a causal run and is refused by a document-masked one."""
    from pretrain.checkpointer import architecture_mismatch
    from pretrain import train_config
    base = {k: train_config.TRAIN_KEYS[k].default for k in train_config.MODEL_KEYS}
    older = {k: v for k, v in base.items() if k not in ("attn_mask", "eot_token")}
    assert architecture_mismatch(older, base) == {}
    assert architecture_mismatch(older, {**base, "attn_mask": "document"}) == {"attn_mask": ("causal", "document")}


@pytest.mark.parametrize("value,expected", [("0,2", "0,2"), ("[2, 0]", "0,2"), ("(0,)", "0"), ("'1'", "1"), ("2", 2)])
def test_xsa_layers_takes_an_int_or_the_blocks_in_any_spelling(value, expected):
    from pretrain import train_config
    c, _ = train_config.resolve(["config/xsa_tiny.py", f"--xsa_layers={value}"])
    assert c.xsa_layers == expected
    assert train_config.variant_name(c) == (f"xsa_last{expected}" if isinstance(expected, int)
                                            else "xsa_blocks" + expected.replace(",", "-"))


@pytest.mark.slow
def test_train_help_lists_every_key_with_default_and_meaning():
    from pretrain import train_config
    proc = run_train_cli("--help")
    assert proc.returncode == 0
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[3:] if line.startswith("  ") and
             line.split()[0] in train_config.TRAIN_KEYS}
    assert set(lines) == set(train_config.TRAIN_KEYS)
    assert "0.1" in lines["weight_decay"] and "AdamW weight decay" in lines["weight_decay"]
    assert "'sa'" in lines["attn_type"] and "exclusive" in lines["attn_type"]
    assert "The model's hyperparameters" in proc.stdout  # the model keys under GPTConfig's heading


@pytest.mark.slow
def test_out_dir_that_is_a_file_is_a_config_error(tmp_path):
    path = tmp_path / "run"
    path.write_text("notes")
    proc = run_train_cli("config/sa_tiny.py", f"--out_dir={path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: out_dir '{path}' is a file, not a directory"
    assert path.read_text() == "notes"


@pytest.mark.slow
def test_a_config_file_with_a_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layer = (4\n")
    proc = run_train_cli(str(bad), f"--out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"config error: config file '{bad}' failed: SyntaxError")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_train_text_keys_take_numbers_as_text():
    from pretrain import train_config
    c, _ = train_config.resolve(["config/sa_tiny.py", "--wandb_run_name=2024", "--out_dir=123", "--wandb_group=7"])
    assert (c.wandb_run_name, c.out_dir, c.wandb_group) == ("2024", "123", "7")
    assert train_config.resolve(["--wandb_group=None"])[0].wandb_group == "run"  # None: derived, as the default


@pytest.mark.slow
@pytest.mark.parametrize("program", [["train.py"], ["-m", "scripts.bench"]])
def test_help_into_a_closed_pipe_is_not_an_error(program):
    """`python train.py --help | head`: the reader goes away before the text is written; --help still exits 0, with
    no BrokenPipeError traceback."""
    import subprocess
    proc = subprocess.Popen([preloaded_python(start=True), *program, "--help"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is printed
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr
