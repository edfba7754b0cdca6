"""configurator.py: config files, --key=value overrides and their errors, through train.py as users run it."""

import subprocess
import sys

import pytest

from conftest import REPO
from configurator import ConfigError, parse_config, read_defaults

DEFAULTS = {"learning_rate": 6e-4, "max_iters": 100, "compile": True, "attn_type": "sa", "head_dim": None}


def run_train_cli(*args):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True)


def test_config_files_then_overrides_in_order(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("learning_rate = 1e-3\nmax_iters = 5\n")
    second.write_text(f"exec(open({str(first)!r}).read())\nattn_type = 'xsa'\n")
    config, files = parse_config(DEFAULTS, [str(second), "--max_iters=7", "--compile=False", "--head_dim=64"])
    assert config == {"learning_rate": 1e-3, "max_iters": 7, "compile": False, "attn_type": "xsa", "head_dim": 64}
    assert files == [str(second)]


def test_int_accepted_for_float_and_bare_strings():
    config, _ = parse_config(DEFAULTS, ["--learning_rate=1", "--attn_type=xsa"])
    assert config["learning_rate"] == 1.0 and type(config["learning_rate"]) is float
    assert config["attn_type"] == "xsa"


@pytest.mark.parametrize("args,message", [
    (["--learnig_rate=1e-3"], "did you mean learning_rate"),
    (["--max_iters=1.5"], "max_iters expects int"),
    (["--compile=1"], "compile expects bool"),
    (["--max_iters"], "--key=value"),
])
def test_bad_overrides_raise(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(DEFAULTS, args)


def test_unknown_key_in_config_file_names_the_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("max_iter = 10\n")
    with pytest.raises(ConfigError, match=r"'max_iter' in .*bad.py; did you mean max_iters"):
        parse_config(DEFAULTS, [str(path)])


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
    (["config/sa_tiny.py", "--learning_rate=1e300"], "learning_rate=1e+300 is not a learning rate for AdamW or Muon: "
                                                      "at most 1000 (the paper's are 3e-4 to 5e-4)"),
    (["config/sa_tiny.py", "--dtype=float16"], "dtype='float16' needs loss scaling, which this trainer does not do; use 'bfloat16' "
                                                    "(GPUs from Ampere on) or 'float32'"),
    (["config/sa_tiny.py", "--device=cuda"], "device='cuda', but torch sees no CUDA GPU on this machine; "
                                                  "use --device=auto or --device=cpu"),
])
def test_train_cli_errors_are_one_line_and_write_nothing(tmp_path, args, message):
    out_dir = tmp_path / "run"
    proc = run_train_cli(*args, f"--out_dir={out_dir}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: {message}"
    assert not out_dir.exists()


def test_read_defaults_takes_literal_keys_and_key_groups_without_running_the_file(tmp_path):
    source = tmp_path / "entry.py"
    source.write_text(
        "import os\n"
        "learning_rate = 6e-4  # peak\n"
        "max_iters = 10_000\n"
        "out_dir = None\n"
        "compile = True\n"
        "_private = 1\n"
        "CONSTANT = 3\n"
        "derived = os.getcwd()  # not a literal: not a key\n"
        "MODEL_KEYS = ('learning_rate', 'max_iters')\n"
        "raise SystemExit('never executed')\n")
    defaults, groups = read_defaults(str(source))
    assert defaults == {"learning_rate": 6e-4, "max_iters": 10000, "out_dir": None, "compile": True}
    assert groups == {"MODEL_KEYS": ("learning_rate", "max_iters")}


def test_train_key_groups_name_only_config_keys():
    defaults, groups = read_defaults()
    assert {"ARCHITECTURE_KEYS", "VARIANT_KEYS", "PAIRING_KEYS", "BOOKKEEPING_KEYS"} <= set(groups)
    for name, keys in groups.items():
        assert set(keys) <= set(defaults), (name, set(keys) - set(defaults))
    # a key is what is trained, how it is paired, or bookkeeping: never two of these
    assert not set(groups["PAIRING_KEYS"]) & set(groups["BOOKKEEPING_KEYS"])
    assert set(groups["VARIANT_KEYS"]) <= set(groups["ARCHITECTURE_KEYS"])


def test_train_help_lists_every_key_with_default_and_comment():
    proc = run_train_cli("--help")
    assert proc.returncode == 0
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[3:]}
    assert set(lines) == set(read_defaults()[0])
    assert "0.1" in lines["weight_decay"] and "AdamW weight decay" in lines["weight_decay"]
    assert "'sa'" in lines["attn_type"] and "exclusive" in lines["attn_type"]


def test_out_dir_that_is_a_file_is_a_config_error(tmp_path):
    path = tmp_path / "run"
    path.write_text("notes")
    proc = run_train_cli("config/sa_tiny.py", f"--out_dir={path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: out_dir '{path}' is a file, not a directory"
    assert path.read_text() == "notes"


def test_a_config_file_with_a_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layer = (4\n")
    proc = run_train_cli(str(bad), f"--out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"config error: config file '{bad}' failed: SyntaxError")
    assert len(proc.stderr.strip().splitlines()) == 1
