"""data/fineweb/prepare.py's errors, each one line saying what to do, not a traceback: bad input (naming
the file and line or row), a second writer (refused by the lock on out_dir), an out_dir that cannot be
written, a full disk (the rerun resumes), and tiktoken's BPE files out of reach."""

import errno
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes.hub import closed_port
from micro import CORPUS
from prepare_helpers import LOCK, PREPARE, leftover_temp_files, listed_shards, load_script, prepare_args, run_prepare, shard_bytes
from pretrain.files import DirectoryLock
from running import HANG_GUARD_S, run_script


# -----------------------------------------------------------------------------
# bad input: one line naming the file (and line or row), not a traceback


def write_parquet_without_text(path):
    pq.write_table(pa.table({"content": ["a document"], "url": ["https://example.com/"]}), path)


def write_parquet_with_a_null_text(path):
    pq.write_table(pa.table({"text": ["one", "two", None, "four"]}), path)


BAD_INPUTS = [
    ("latin1.txt", "first line\nsecond line\ncaf\xe9\n".encode("latin-1"),
     "latin1.txt, line 3: not UTF-8 text (byte 0xe9)"),
    ("latin1.jsonl", '{"text": "ok"}\n\n{"text": "caf\xe9"}\n'.encode("latin-1"),
     "latin1.jsonl, line 3: not UTF-8 text"),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": "no end\n', "broken.jsonl, line 3: not valid JSON"),
    ("no_text.jsonl", b'{"text": "ok"}\n\n{"content": "x"}\n', "no_text.jsonl, line 3: no `text` field"),
    ("number.jsonl", b'{"text": 42}\n', "number.jsonl, line 1: `text` is int, not a string"),
    ("no_text.parquet", write_parquet_without_text, "no_text.parquet: no `text` column (its columns: content, url)"),
    ("null.parquet", write_parquet_with_a_null_text, "null.parquet: row 2 (counting from 0) has no text"),
    ("not_parquet.parquet", b"PAR1 but not really", "not_parquet.parquet: not a readable parquet file"),
]


@pytest.mark.parametrize("name, content, error", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_fails_in_one_line_naming_the_file(tmp_path, name, content, error):
    path = tmp_path / name
    content(str(path)) if callable(content) else path.write_bytes(content)
    # after a good file, so that the bad one is met while reading, with the pool running
    result = run_prepare("--input", CORPUS[0], str(path), "--out_dir", tmp_path / "out", "--num_proc", 1, check=False)
    assert result.returncode == 3  # unusable input: running again unchanged cannot fix it (exits.STOPPED)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"{tmp_path}/{error}")  # the error's own line


# -----------------------------------------------------------------------------
# the lock on out_dir, and an out_dir that cannot be written


def test_no_lock_file_is_left_behind(prepared, parquet_file, tmp_path):
    """Finished, with nothing to do, refused, or stopped by bad input: the lock file goes with the run."""
    assert not os.path.exists(os.path.join(prepared, LOCK))
    assert "nothing to do" in run_prepare(*prepare_args([parquet_file], prepared)).stdout
    assert not os.path.exists(os.path.join(prepared, LOCK))
    refused = run_prepare("--input", parquet_file, "--out_dir", prepared, "--shard_size", 7, check=False)
    assert refused.returncode == 2 and "other settings" in refused.stderr  # a command line at odds with out_dir
    assert not os.path.exists(os.path.join(prepared, LOCK))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no text": 1}\n')
    failed = run_prepare("--input", CORPUS[0], str(bad), "--out_dir", tmp_path / "out", "--num_proc", 1, check=False)
    assert failed.returncode == 3 and "no `text` field" in failed.stderr
    assert LOCK not in os.listdir(tmp_path / "out")


def test_a_second_writer_is_refused_and_leaves_the_first_ones_lock(parquet_file, tmp_path):
    out_dir = str(tmp_path / "out")
    os.makedirs(out_dir)
    with DirectoryLock(out_dir, LOCK) as held:
        result = run_prepare(*prepare_args([parquet_file], out_dir), check=False)
        assert result.returncode == 3 and "another prepare.py is writing to" in result.stderr
        assert f"PID {os.getpid()}" in result.stderr
        with open(held.path) as f:  # the refused run neither removed nor rewrote the holder's lock file
            assert f.read() == f"{os.getpid()}\n"
    assert os.listdir(out_dir) == []


def out_dir_under_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "out")


def read_only_dir(tmp_path):
    """Read-only for a user; root writes through the mode bits, so then the case is skipped."""
    if os.geteuid() == 0:
        pytest.skip("root can write to a read-only directory")
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    return str(path)


@pytest.mark.parametrize("make_out_dir", [out_dir_under_a_file, read_only_dir])
def test_an_out_dir_that_cannot_be_written_fails_in_one_line(parquet_file, tmp_path, make_out_dir):
    out_dir = make_out_dir(tmp_path)
    result = run_prepare(*prepare_args([parquet_file], out_dir), check=False)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith(f"cannot write to {out_dir} (")
    assert "choose an --out_dir you can write to" in message[0]


def test_a_full_disk_stops_in_one_line_and_the_rerun_resumes(prepared, parquet_file, tmp_path, monkeypatch, capsys):
    """No space left for the third shard: one line saying what to do, the two shards before it kept, no
    lock left, and the same command finishes the job with the shards of an uninterrupted run."""
    prepare = load_script("prepare")
    out_dir = str(tmp_path / "out")
    write_shard = prepare.shards.write_shard

    def disk_full_at_the_third_shard(path, tokens):
        if path.endswith("_000002.bin"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_shard(path, tokens)
    monkeypatch.setattr(prepare.shards, "write_shard", disk_full_at_the_third_shard)
    monkeypatch.setattr(sys, "argv", [PREPARE, *map(str, prepare_args([parquet_file], out_dir, "--quiet"))])
    with pytest.raises(SystemExit) as stop:
        prepare.main()
    message = capsys.readouterr().err
    assert stop.value.code == 3  # exits.STOPPED
    assert message.startswith(f"cannot write to {out_dir} ([Errno {errno.ENOSPC}] No space left on device)")
    assert "rerun the same command" in message
    assert listed_shards(out_dir) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert not os.path.exists(os.path.join(out_dir, LOCK))
    assert leftover_temp_files(out_dir) == []

    result = run_prepare(*prepare_args([parquet_file], out_dir))
    assert "keeping 2 shards" in result.stdout
    assert shard_bytes(out_dir) == shard_bytes(prepared)


# -----------------------------------------------------------------------------
# tiktoken's BPE files out of reach


def test_prepare_without_the_bpe_files_says_to_set_tiktoken_cache_dir(tmp_path):
    """tiktoken downloads its files on first use; a proxy that refuses connections stands in for no network."""
    proxy = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": proxy, "https_proxy": proxy,
           "NO_PROXY": "", "no_proxy": ""}
    result = run_script([sys.executable, "-m", PREPARE, "--input", CORPUS[0], "--out_dir", tmp_path / "out"], env=env,
                        timeout=HANG_GUARD_S)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert "TIKTOKEN_CACHE_DIR" in result.stderr.strip().splitlines()[-1]
