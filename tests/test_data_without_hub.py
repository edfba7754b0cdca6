"""prepare.py, download.py and quickstart.sh with the Hugging Face Hub out of reach, in offline mode or
unreachable (tests/fakes/hub.py): one line pointing to local files, at once; and download.py needs no Hub
for a directory that holds its shards already."""

import glob
import os
import sys

import numpy as np
import pytest

from fakes.hub import no_hub_env, unavailable_hub
from prepare_helpers import DOWNLOAD, LOCK, PREPARE
from pretrain.shards import write_shard
from running import HANG_GUARD_S, REPO, run_script


HUB_DOWN = {  # offline mode, and a Hub that is unavailable
    "offline": {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    "unreachable": {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"},
}


# requests a script that gives up at once makes: none offline, else its one check (two requests at most);
# the libraries' own retries make 8 over half a minute
GIVING_UP_AT_ONCE = {"offline": {0}, "unreachable": {1, 2}}


def run_without_hub(cmd, hub, tmp_path, **env):
    """Run cmd with the Hub down; returns the result and how many requests reached the Hub: counting
    them, not the seconds, tells whether the script gave up at once, whatever the machine's speed."""
    with unavailable_hub() as (endpoint, requests):
        env = no_hub_env(endpoint, tmp_path, **{**HUB_DOWN[hub], **env})  # no cached Hub files either
        result = run_script(cmd, env=env, timeout=HANG_GUARD_S)
    return result, len(requests)


def hub_message(result, repo_id):
    """The one line a script without the Hub prints, checked for the form that prepare.py and download.py share."""
    assert result.returncode == 3  # quickstart.sh tells this failure from the others by its status
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith(f"cannot read {repo_id} from the Hugging Face Hub (")
    return message[0]


@pytest.mark.parametrize("hub", HUB_DOWN)
def test_prepare_without_the_hub_says_to_use_input(hub, tmp_path):
    result, requests = run_without_hub([sys.executable, "-m", PREPARE, "--out_dir", tmp_path / "out"], hub, tmp_path)
    assert "--input" in hub_message(result, "HuggingFaceFW/fineweb")
    assert requests in GIVING_UP_AT_ONCE[hub]
    assert not os.path.exists(tmp_path / "out" / LOCK)


@pytest.mark.parametrize("hub", HUB_DOWN)
def test_download_without_the_hub_says_to_use_prepare_input(hub, tmp_path):
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", DOWNLOAD, "--shards", "2", "--out_dir", out_dir]
    result, requests = run_without_hub(cmd, hub, tmp_path)
    assert "python -m data.fineweb.prepare --input" in hub_message(result, "kjj0/fineweb100B-gpt2")
    assert requests in GIVING_UP_AT_ONCE[hub]
    assert not out_dir.exists()


def test_download_of_a_complete_directory_needs_no_hub(tmp_path):
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        write_shard(str(tmp_path / name), np.arange(100, dtype=np.uint16))
    cmd = [sys.executable, "-m", DOWNLOAD, "--shards", "1", "--out_dir", tmp_path]
    result, _ = run_without_hub(cmd, "offline", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "done: 2 shards, 200 tokens" in result.stdout
    assert result.stderr == ""  # no progress bar in a log


@pytest.mark.slow
def test_quickstart_without_the_hub_says_to_set_input(tmp_path):
    data_dir = tmp_path / "data"
    result, _ = run_without_hub(["bash", os.path.join(REPO, "scripts", "quickstart.sh")], "offline", tmp_path,
                                DATA_DIR=str(data_dir))
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert "set INPUT=" in result.stderr.strip().splitlines()[-1]
    assert not glob.glob(os.path.join(data_dir, "*.bin"))
