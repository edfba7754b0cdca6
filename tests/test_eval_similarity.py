"""eval/similarity.py: the Figure 1 quantities agree with a naive float64 re-implementation of
attention written here from the weights, sinks are not counted as tokens, XSA's output is
orthogonal to the own value vector (gated XSA: what the gate leaves), and the validation data
defaults to the checkpoint's own.
Also what eval/common.py and pretrain/checkpointer.py give every script: a checkpoint that cannot be
loaded, or an --out that cannot be written, is named in one line on stderr with exit status 3 and no
traceback, and progress bars are drawn on a terminal only, never with --quiet."""

import fcntl
import json
import math
import os
import pty
import re
import shutil
import struct
import subprocess
import termios
import traceback

import pytest
import torch

from torch.distributed.checkpoint.api import CheckpointException

from eval.similarity import QUANTITIES, similarity_stats, stats_over_batches
from micro import MICRO
from model import GPT, GPTConfig
from pretrain import checkpointer
from pretrain.checkpoint_format import save_sharded_checkpoint
from pretrain.checkpointer import list_checkpoints, load_model
from pretrain.dataloader import val_sequences
from running import HANG_GUARD_S, REPO, preloaded_python, run_eval, run_in_process


def rotate(x, theta):
    """RoPE, rotate-half pairing (i, i + D/2), position = row index; x: (T, D) float64."""
    T, D = x.shape
    out = torch.empty_like(x)
    for i in range(D // 2):
        angle = torch.arange(T, dtype=torch.float64) * theta ** (-2 * i / D)
        a, b = x[:, i], x[:, i + D // 2]
        out[:, i] = a * angle.cos() - b * angle.sin()
        out[:, i + D // 2] = a * angle.sin() + b * angle.cos()
    return out


@torch.no_grad()
def naive_stats(model, x):
    """Per layer: mean cos(v_i, v_j) (i != j), a_ii and cos(y_i, v_i) over heads, tokens and
    sequences, from each head's rows of the q, k, v weights and a masked softmax, in float64; query
    head h reads key/value head h // (n_head / n_kv_head). In XSA layers also |z_i·v_i| / (|v_i| |y_i|)
    with z = y - g (y·v / |v|^2) v, g = tanh(alpha) of gated XSA or 1, over the tokens after the
    first (None in SA layers). The residual stream is advanced block by block here, not captured
    with hooks."""
    c = model.config
    S, H, D, per_kv = c.n_sinks, c.n_head, c.head_dim, c.n_head // c.n_kv_head
    h = model.transformer.wte(x)
    if S:
        h = torch.cat((model.sinks.expand(len(x), -1, -1), h), dim=1)
    h = model.transformer.ln_emb(h)
    L = h.size(1)
    out = {"cos_vv": [], "a_ii": [], "cos_yv": [], "cos_zv": []}
    for block in model.transformer.h:
        a = block.ln_1(h).double()
        Wq, Wk, Wv = (getattr(block.attn, name).weight.double() for name in ("c_q", "c_k", "c_v"))
        xsa, alpha = block.attn.attn_type == "xsa", block.attn.xsa_alpha
        sums = {name: 0.0 for name in out}
        for b in range(len(x)):
            for head in range(H):
                kv = head // per_kv
                q = a[b] @ Wq[head * D:(head + 1) * D].T
                k, v = (a[b] @ W[kv * D:(kv + 1) * D].T for W in (Wk, Wv))
                q, k = rotate(q, c.rope_theta), rotate(k, c.rope_theta)
                scores = q @ k.T / math.sqrt(D)
                scores[torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)] = float("-inf")
                att = torch.softmax(scores, dim=-1)
                y = att @ v
                v, y, att = v[S:], y[S:], att[S:, S:]
                T = len(v)
                cos_pairs = [torch.dot(v[i], v[j]) / (v[i].norm() * v[j].norm())
                             for i in range(T) for j in range(T) if i != j]
                sums["cos_vv"] += torch.stack(cos_pairs).mean().item()
                sums["a_ii"] += att.diagonal().mean().item()
                sums["cos_yv"] += ((y * v).sum(-1) / (y.norm(dim=-1) * v.norm(dim=-1))).mean().item()
                if xsa:
                    gate = 1.0 if alpha is None else math.tanh(alpha[head].item())
                    z = y - gate * ((y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)) * v
                    ortho = (z * v).sum(-1).abs() / (v.norm(dim=-1) * y.norm(dim=-1))
                    sums["cos_zv"] += ortho[0 if S else 1:].mean().item()  # a sink before it: z is no noise
        for name in out:
            out[name].append(sums[name] / (len(x) * H) if name != "cos_zv" or xsa else None)
        h = block(h, model.rope_cos[:L], model.rope_sin[:L])
    return out


@pytest.fixture(scope="module")
def val_x(data_dir):
    x, _ = val_sequences(data_dir, MICRO["block_size"], 3 * MICRO["block_size"])
    return x


@pytest.mark.slow
def test_sa_statistics_match_naive_attention(trained_runs, val_x):
    model, _ = load_model(trained_runs["sa"], "cpu")
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    assert got["cos_zv"] is None  # no XSA, nothing after it
    for name in ("cos_vv", "a_ii", "cos_yv"):
        assert len(got[name]) == model.config.n_layer
        assert got[name] == pytest.approx(want[name], abs=2e-5), name
    # a trained layer is not trivially uniform: the check above compares non-degenerate numbers
    assert max(abs(v) for v in got["cos_yv"]) > 1e-2


def test_sink_positions_are_not_counted(val_x):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(MICRO, n_sinks=2))).eval()
    with torch.no_grad():
        model.sinks.normal_(0, 1.0)  # sinks that differ from the tokens, so counting them would show
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    for name in ("cos_vv", "a_ii", "cos_yv"):
        assert got[name] == pytest.approx(want[name], abs=2e-5), name


def test_grouped_query_attention_and_xsa_in_some_layers(val_x):
    """GQA (query heads 0, 1 read value head 0; 2, 3 read value head 1) with XSA in the last block
    only: the quantities match the naive attention, and cos_zv is reported for the XSA block alone."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(MICRO, n_head=4, n_kv_head=2, attn_type="xsa", xsa_layers=1))).eval()
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    for name in ("cos_vv", "a_ii", "cos_yv"):
        assert got[name] == pytest.approx(want[name], abs=2e-5), name
    assert got["cos_zv"][0] is None and 0 <= got["cos_zv"][1] < 1e-4
    assert want["cos_zv"][0] is None and got["cos_zv"][1] == pytest.approx(want["cos_zv"][1], abs=2e-5)


def test_gated_xsa_leaves_what_its_gate_says(val_x):
    """Gated XSA removes tanh(alpha) of each head's projection on its value: cos_zv matches the
    naive formula with that gate, and is far from plain XSA's ~0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(MICRO, attn_type="xsa", xsa_gate=True))).eval()
    with torch.no_grad():
        for i, block in enumerate(model.transformer.h):
            block.attn.xsa_alpha.copy_(torch.tensor([0.3, -1.2]) * (i + 1))
    got = similarity_stats(model, val_x)
    want = naive_stats(model, val_x)
    for name in QUANTITIES:
        assert got[name] == pytest.approx(want[name], abs=2e-5), name
    assert min(got["cos_zv"]) > 1e-2


@pytest.mark.slow
def test_xsa_output_is_orthogonal_to_own_value(trained_runs, val_x):
    model, _ = load_model(trained_runs["xsa"], "cpu")
    got = similarity_stats(model, val_x)
    assert len(got["cos_zv"]) == model.config.n_layer
    assert all(0 <= c < 1e-4 for c in got["cos_zv"])
    # before XSA the same outputs do lean on their own values: the after-XSA number is not vacuous
    assert max(abs(c) for c in got["cos_yv"]) > 1e-2


@pytest.mark.slow
def test_cli_writes_every_layer_and_a_plot(trained_runs, data_dir, tmp_path):
    """No --data_dir: each checkpoint is scored on the val shards of the data_dir it was trained on."""
    proc, report = run_eval("similarity.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--num_sequences", "6", "--batch_size", "4", "--device", "cpu", out=tmp_path)
    n_layer = MICRO["n_layer"]
    x, _ = val_sequences(data_dir, MICRO["block_size"], 6 * MICRO["block_size"])
    for label, attn_type in (("SA", "sa"), ("XSA", "xsa")):
        with open(os.path.join(trained_runs[attn_type], "config.json")) as f:
            trained_on = json.load(f)["config"]["data_dir"]  # the session's shards (a parallel worker's copy of them)
        stats = report["models"][label]
        assert stats["num_sequences"] == 6 and stats["data_dir"] == trained_on
        for name in ("cos_vv", "a_ii", "cos_yv"):
            assert len(stats[name]) == n_layer and all(math.isfinite(v) for v in stats[name])
        model, _ = load_model(trained_runs[attn_type], "cpu")
        want = stats_over_batches(model, x, 4, "float32")  # the training data's val tokens, in-process
        assert stats["cos_yv"] == pytest.approx(want["cos_yv"], rel=1e-5)
    assert report["models"]["SA"]["cos_zv"] is None and len(report["models"]["XSA"]["cos_zv"]) == n_layer
    png = tmp_path / "similarity.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| {n_layer - 1} |" in proc.stdout  # the table has a row for the last layer
    assert "%|" not in proc.stderr  # stderr is a pipe here: no progress bars


@pytest.fixture(scope="module")
def other_data_dir(data_dir, tmp_path_factory):
    """Shards whose val split is another text than the training data's val split (its first train shard)."""
    out = tmp_path_factory.mktemp("other_shards")
    shutil.copy(os.path.join(data_dir, "fineweb_train_000001.bin"), out / "fineweb_val_000000.bin")
    return str(out)


@pytest.mark.slow
def test_an_explicit_data_dir_wins_over_the_checkpoints(trained_runs, data_dir, other_data_dir, tmp_path):
    proc = run_in_process(
        ["-m", "eval.similarity", trained_runs["sa"], "--labels", "SA", "--data_dir", other_data_dir,
         "--num_sequences", "4", "--device", "cpu", "--out", tmp_path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "similarity.json") as f:
        stats = json.load(f)["models"]["SA"]
    assert stats["data_dir"] == other_data_dir
    model, _ = load_model(trained_runs["sa"], "cpu")
    block = MICRO["block_size"]
    want = stats_over_batches(model, val_sequences(other_data_dir, block, 4 * block)[0], 4, "float32")
    default = stats_over_batches(model, val_sequences(data_dir, block, 4 * block)[0], 4, "float32")
    assert stats["cos_vv"] == pytest.approx(want["cos_vv"], rel=1e-5)
    assert stats["cos_vv"] != pytest.approx(default["cos_vv"], rel=1e-3)  # the two data sets tell apart


# -----------------------------------------------------------------------------
# checkpoints that cannot be loaded (pretrain/checkpointer.py, load_model_or_exit)


@pytest.fixture(scope="module")
def bad_checkpoints(trained_runs, tmp_path_factory):
    """{case: (path, words the reason must contain)}: a missing path, a directory without
    checkpoints, a truncated file, a file with flipped bytes, a run whose only checkpoint is truncated,
    a sharded (FSDP) checkpoint whose .metadata is overwritten."""
    root = tmp_path_factory.mktemp("bad_checkpoints")
    with open(list_checkpoints(trained_runs["sa"])[-1], "rb") as f:
        good = f.read()
    (root / "truncated.pt").write_bytes(good[:len(good) // 2])
    flipped = bytearray(good)
    flipped[len(good) // 2:len(good) // 2 + 8] = bytes(b ^ 0xFF for b in flipped[len(good) // 2:len(good) // 2 + 8])
    (root / "flipped.pt").write_bytes(bytes(flipped))
    (root / "empty_dir").mkdir()
    (root / "broken_run").mkdir()
    (root / "broken_run" / "ckpt_0000050.pt").write_bytes(good[:1000])
    model = GPT(GPTConfig(**MICRO))
    sharded = save_sharded_checkpoint(model, torch.optim.AdamW(model.parameters()), {"config": dict(MICRO), "step": 1},
                                      str(root / "fsdp_run"), 1)
    load_model(sharded, "cpu")  # it loads before the damage
    metadata = os.path.join(sharded, ".metadata")
    with open(metadata, "r+b") as f:
        f.seek(os.path.getsize(metadata) // 3)
        f.write(b"\x00" * 64)
    return {"missing": (str(root / "no_such_run"), "no such file"),
            "empty directory": (str(root / "empty_dir"), "no checkpoint"),
            "truncated": (str(root / "truncated.pt"), "truncated"),
            "corrupt": (str(root / "flipped.pt"), "checksum"),
            "unreadable run": (str(root / "broken_run"), "ckpt_0000050.pt"),
            "corrupt sharded metadata": (sharded, "")}


def one_line_exit(exit_info, stderr):
    """The message of a script that stopped with one line on stderr and exit status 3."""
    assert exit_info.value.code == 3
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    return stderr.strip()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "empty directory", "truncated", "corrupt", "unreadable run",
                                  "corrupt sharded metadata"])
def test_load_names_the_checkpoint_and_why_it_cannot_be_loaded(bad_checkpoints, case, capsys):
    path, reason = bad_checkpoints[case]
    with pytest.raises(SystemExit) as exit_info:
        checkpointer.load_model_or_exit(path, "cpu")
    message = one_line_exit(exit_info, capsys.readouterr().err)  # the one line is the whole report
    assert message.startswith(f"cannot load checkpoint {path}: ") and reason in message


@pytest.mark.slow
def test_load_reports_a_distributed_checkpoint_exception_in_one_line(trained_runs, monkeypatch, capsys):
    """torch.distributed.checkpoint's CheckpointException derives from BaseException, not Exception;
    the first failing rank's error is the reason given."""
    def unreadable(path, device):
        error = ValueError("the metadata names no shard files")
        raise CheckpointException("load failed", {0: (error, traceback.extract_stack())})

    monkeypatch.setattr(checkpointer, "load_model", unreadable)
    with pytest.raises(SystemExit) as exit_info:
        checkpointer.load_model_or_exit(trained_runs["sa"], "cpu")
    message = one_line_exit(exit_info, capsys.readouterr().err)
    assert message == f"cannot load checkpoint {trained_runs['sa']}: ValueError: the metadata names no shard files"


@pytest.mark.slow
def test_load_warns_in_one_line_about_a_skipped_newer_checkpoint(trained_runs, tmp_path, capsys):
    """A run whose newest checkpoint is truncated loads the one before, and says which it skipped."""
    run = tmp_path / "run"
    run.mkdir()
    older, newest = list_checkpoints(trained_runs["sa"])[-2:]
    shutil.copy(older, run / os.path.basename(older))
    with open(newest, "rb") as f:
        (run / os.path.basename(newest)).write_bytes(f.read()[:1000])
    model, _ = checkpointer.load_model_or_exit(str(run), "cpu")
    want, _ = load_model(older, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and os.path.basename(newest) in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["similarity.py", "position_loss.py", "sample.py"])
@pytest.mark.parametrize("case", ["missing", "truncated"])
def test_scripts_exit_with_one_line_naming_the_checkpoint(trained_runs, bad_checkpoints, script, case, tmp_path):
    path, reason = bad_checkpoints[case]
    # after a good checkpoint for the scripts that take several: a bad one is named, whichever it is
    checkpoints = [path] if script == "sample.py" else [trained_runs["xsa"], path]
    proc = run_in_process(["-m", "eval." + script.removesuffix(".py"), *checkpoints, "--device", "cpu"]
                          + ([] if script == "sample.py" else ["--num_sequences", "2", "--out", tmp_path]))
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line, no traceback
    assert proc.stderr.startswith(f"cannot load checkpoint {path}: ") and reason in proc.stderr


# -----------------------------------------------------------------------------
# where the results go (eval/common.py): --out is a directory that can be written


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no file can be created in: mode 555, or for root (whom modes do not stop) the
    immutable attribute."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    else:
        path.chmod(0o555)
    try:
        (path / "probe").write_text("")
        os.remove(path / "probe")
        pytest.skip("cannot make a read-only directory here (root without chattr)")
    except OSError:
        pass
    yield str(path)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["compare.py", "similarity.py", "position_loss.py", "downstream.py"])
@pytest.mark.parametrize("case", ["a file", "read-only"])
def test_an_out_that_cannot_be_written_is_named_in_one_line(trained_runs, tmp_path, request, script, case):
    """Checked before any model is loaded: a report is never lost at the end of a long evaluation."""
    if case == "a file":
        out = tmp_path / "results.md"
        out.write_text("an earlier report\n")
    else:
        out = request.getfixturevalue("read_only_dir")
    args = [trained_runs["sa"]] if script == "compare.py" else [trained_runs["sa"], "--device", "cpu"]
    proc = run_in_process(["-m", "eval." + script.removesuffix(".py"), *args, "--out", out])
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr  # one line, before any work
    if case == "a file":
        assert proc.stderr.startswith(f"--out {out} is a file; --out names a directory")
        assert out.read_text() == "an earlier report\n"
    else:
        assert proc.stderr.startswith(f"cannot write in --out {out} (") and "writable directory" in proc.stderr
        assert os.listdir(out) == []


# -----------------------------------------------------------------------------
# progress bars (eval/common.py)


def run_on_terminal(args):
    """Run a command from the repo root with its stderr on a 100-column pseudo-terminal and stdout on
    a pipe: (exit status, stdout, what the terminal received)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=terminal, text=True)
    os.close(terminal)
    received = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end closed: the process has exited
            break
        if not chunk:
            break
        received += chunk
    os.close(controller)
    stdout, _ = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, stdout, received.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["similarity.py", "position_loss.py"])
def test_progress_bar_with_eta_on_a_terminal_and_none_with_quiet(trained_runs, tmp_path, script):
    """2 batches per model: a bar per model, labelled with it, counting to 2/2 with the time left."""
    args = [preloaded_python(start=True), "-m", "eval." + script.removesuffix(".py"), trained_runs["sa"],
            trained_runs["xsa"], "--labels", "SA", "XSA",
            "--num_sequences", "4", "--batch_size", "2", "--device", "cpu", "--out", str(tmp_path)]
    status, stdout, terminal = run_on_terminal(args)
    assert status == 0, terminal[-3000:]
    for label in ("SA", "XSA"):
        assert re.search(rf"(^|\r){label}: +100%\|[^\r]*\| 2/2 \[\d\d:\d\d<\d\d:\d\d", terminal), terminal[-3000:]
    assert "|" in stdout  # the results table: on stdout, apart from the bars

    status, _, terminal = run_on_terminal(args + ["--quiet"])
    assert status == 0 and "%|" not in terminal and "batch" not in terminal, terminal[-3000:]
