"""data/fineweb/download.py: the files it fetches, and its progress bar (with a stand-in for the Hub's
download function). Without the Hub: tests/test_data_without_hub.py."""

import io
import os
import sys

import numpy as np
import pytest

from helpers import ETA, last_bar
from prepare_helpers import DOWNLOAD, load_script
from pretrain.shards import write_shard


def test_download_file_list_is_val_then_numbered_train_shards():
    download = load_script("download")
    assert download.shard_filenames(0) == ["fineweb_val_000000.bin"]
    assert download.shard_filenames(3) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                           "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    assert download.shard_filenames(1030)[-1] == "fineweb_train_001030.bin"


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_download_shows_a_bar_of_the_shards_left(tmp_path, monkeypatch, capsys, quiet):
    """download.py with a stand-in for the Hub: the bar counts the shards to fetch (one is already there)."""
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    download = load_script("download")
    fetched = []

    def fake_hf_hub_download(repo_id, filename, repo_type, local_dir, force_download):
        fetched.append(filename)
        write_shard(os.path.join(local_dir, filename), np.arange(10, dtype=np.uint16))
        return os.path.join(local_dir, filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    monkeypatch.setattr(download, "check_hub", lambda repo_id, instead: None)
    write_shard(str(tmp_path / "fineweb_train_000001.bin"), np.arange(10, dtype=np.uint16))
    monkeypatch.setattr(sys, "argv", [DOWNLOAD, "--shards", "3", "--out_dir", str(tmp_path)] + ["--quiet"] * quiet)
    monkeypatch.setattr(sys, "stderr", Terminal())
    try:
        download.main()
        assert are_progress_bars_disabled() == quiet  # huggingface_hub's bar of each file too
    finally:
        enable_progress_bars()
    assert fetched == ["fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    bar = last_bar(sys.stderr.getvalue())
    if quiet:
        assert bar == ""
    else:
        assert bar.startswith("100%") and " 4/4 " in bar and ETA.search(bar), bar
    assert "done: 4 shards, 40 tokens" in capsys.readouterr().out
