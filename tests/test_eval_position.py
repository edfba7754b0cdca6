"""eval/position_loss.py: per-position losses average to the plain validation loss, each position's
loss is what the model predicts there, the buckets partition the positions, and the validation data
defaults to the first checkpoint's own."""

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from eval.position_loss import bucket_losses, position_losses
from micro import MICRO, micro_args
from pretrain.checkpointer import load_model
from pretrain.dataloader import val_sequences
from running import run_eval, run_in_process, run_train


@pytest.fixture(scope="module")
def sa_model_and_data(trained_runs, data_dir):
    model, _ = load_model(trained_runs["sa"], "cpu")
    x, y = val_sequences(data_dir, MICRO["block_size"], 13 * MICRO["block_size"])
    return model, x, y


@pytest.mark.slow
@torch.no_grad()
def test_mean_over_positions_is_the_validation_loss(sa_model_and_data):
    model, x, y = sa_model_and_data
    per_position = position_losses(model, x, y, batch_size=5)  # 13 sequences: a partial last batch
    assert per_position.shape == (x.size(1),)
    _, loss = model(x, y)
    # other batch shapes change fp32 matmul rounding; any real error (a dropped position) is ~1e-2
    assert per_position.mean().item() == pytest.approx(loss.item(), rel=1e-4)


@pytest.mark.slow
@torch.no_grad()
def test_each_position_is_scored_from_its_own_prefix(sa_model_and_data):
    """Position t's loss equals the loss of a forward pass on the first t + 1 tokens alone."""
    model, x, y = sa_model_and_data
    per_position = position_losses(model, x, y, batch_size=16)
    for t in (0, 7, x.size(1) - 1):
        logits, _ = model(x[:, :t + 1])
        want = F.cross_entropy(logits[:, -1].double(), y[:, t])
        assert per_position[t].item() == pytest.approx(want.item(), rel=1e-4)  # batch-shape rounding only


def test_buckets_partition_the_positions():
    per_position = torch.arange(32, dtype=torch.float64) ** 2  # distinct values expose misplaced bounds
    for n_buckets in (1, 5, 8, 32, 50):
        buckets = bucket_losses(per_position, n_buckets)
        assert len(buckets) == min(n_buckets, 32)
        assert buckets[0]["start"] == 0 and buckets[-1]["end"] == 32
        assert all(a["end"] == b["start"] for a, b in zip(buckets, buckets[1:]))
        sizes = [b["end"] - b["start"] for b in buckets]
        assert max(sizes) - min(sizes) <= 1
        for b in buckets:
            assert b["loss"] == pytest.approx(per_position[b["start"]:b["end"]].mean().item())
        weighted = sum(b["loss"] * (b["end"] - b["start"]) for b in buckets) / 32
        assert weighted == pytest.approx(per_position.mean().item())


@pytest.mark.slow
def test_cli_writes_tables_and_plot(trained_runs, data_dir, tmp_path):
    """No --data_dir: the models are scored on the val shards of the data_dir they were trained on."""
    proc, report = run_eval("position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--num_sequences", "8", "--buckets", "4", "--device", "cpu", out=tmp_path)
    with open(os.path.join(trained_runs["sa"], "config.json")) as f:
        trained_on = json.load(f)["config"]["data_dir"]  # the session's shards (a parallel worker's copy of them)
    assert report["num_sequences"] == 8 and report["data_dir"] == trained_on
    x, y = val_sequences(data_dir, MICRO["block_size"], 8 * MICRO["block_size"])
    for label, attn_type in (("SA", "sa"), ("XSA", "xsa")):
        result = report["models"][label]
        assert len(result["buckets"]) == 4 and len(result["per_position"]) == MICRO["block_size"]
        assert result["mean"] == pytest.approx(sum(result["per_position"]) / MICRO["block_size"])
        assert f"mean validation loss {result['mean']:.4f}" in proc.stdout
        model, _ = load_model(trained_runs[attn_type], "cpu")
        with torch.no_grad():
            _, loss = model(x, y)  # the model's own loss on the training data's val tokens
        assert result["mean"] == pytest.approx(loss.item(), rel=1e-4)
    assert "%|" not in proc.stderr  # stderr is a pipe here: no progress bars
    markdown = (tmp_path / "position_loss.md").read_text()
    assert "| positions | SA | XSA | XSA - SA |" in markdown and "| all (mean) |" in markdown
    png = tmp_path / "position_loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_an_explicit_data_dir_wins_over_the_checkpoints(trained_runs, data_dir, tmp_path):
    other = tmp_path / "other_shards"  # a val split of other text: the training data's first train shard
    other.mkdir()
    shutil.copy(os.path.join(data_dir, "fineweb_train_000001.bin"), other / "fineweb_val_000000.bin")
    proc = run_in_process(
        ["-m", "eval.position_loss", trained_runs["sa"], "--labels", "SA", "--data_dir", other,
         "--num_sequences", "8", "--device", "cpu", "--out", tmp_path / "out"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "out" / "position_loss.json") as f:
        report = json.load(f)
    assert report["data_dir"] == str(other)
    model, _ = load_model(trained_runs["sa"], "cpu")
    with torch.no_grad():
        _, want = model(*val_sequences(str(other), MICRO["block_size"], 8 * MICRO["block_size"]))
        _, default = model(*val_sequences(data_dir, MICRO["block_size"], 8 * MICRO["block_size"]))
    assert report["models"]["SA"]["mean"] == pytest.approx(want.item(), rel=1e-4)
    assert abs(want.item() - default.item()) > 1e-2  # the two data sets tell apart


@pytest.mark.slow
@pytest.mark.parametrize("given", ["--block_size", "first checkpoint"])
def test_sequences_longer_than_a_models_context_are_refused_in_one_line(trained_runs, data_dir, tmp_path, given):
    """--block_size 64 on a 32-token model, or a second model with a shorter context than the first
    one's block_size that sets the sequence length: one line naming the checkpoint and the fix."""
    if given == "--block_size":
        args, source = [trained_runs["sa"], "--block_size", "64"], "--block_size 64"
    else:
        longer = str(tmp_path / "run_64")
        run_train(micro_args(data_dir, longer, block_size=64, max_iters=1, eval_interval=1, checkpoint_interval=1,
                             val_tokens=1024))
        args, source = [longer, trained_runs["sa"]], "the first checkpoint's block_size 64"
    proc = run_in_process(["-m", "eval.position_loss", *args, "--num_sequences", "2", "--device", "cpu",
                       "--out", tmp_path / "out"])
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [f"{source} is longer than the context of {trained_runs['sa']} "
                                                 f"({MICRO['block_size']} tokens); use --block_size "
                                                 f"{MICRO['block_size']} or less, or --extend_context to score "
                                                 f"past it"], proc.stderr
    assert not os.path.exists(tmp_path / "out" / "position_loss.json")


@pytest.mark.slow
def test_scoring_past_the_training_length_extends_the_context_and_splits_the_report_there(trained_runs, tmp_path):
    """--block_size 4x: sequences 4 times the 32 tokens trained on, the RoPE tables extended; per-position
    losses as the extended model computes them, buckets that never straddle position 32, and each model's
    mean inside and beyond it."""
    proc, report = run_eval("position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--block_size", "4x", "--num_sequences", "4", "--buckets", "8", "--device", "cpu",
                            out=tmp_path)
    T, trained = 4 * MICRO["block_size"], MICRO["block_size"]
    assert report["block_size"] == T
    model, config = load_model(trained_runs["xsa"], "cpu")
    model.extend_context(T)
    x, y = val_sequences(config["data_dir"], T, 4 * T)
    with torch.no_grad():
        want = F.cross_entropy(model(x)[0].transpose(1, 2), y, reduction="none").double().mean(dim=0)
    xsa = report["models"]["XSA"]
    assert xsa["per_position"] == pytest.approx(want.tolist(), rel=1e-5)
    for label in ("SA", "XSA"):
        per_position = torch.tensor(report["models"][label]["per_position"])
        assert report["models"][label]["inside"] == pytest.approx(per_position[:trained].mean().item())
        assert report["models"][label]["beyond"] == pytest.approx(per_position[trained:].mean().item())
        assert any(b["start"] == trained for b in report["models"][label]["buckets"])  # split at the training length
    inside_delta = xsa["inside"] - report["models"]["SA"]["inside"]
    assert f"| inside the training length ({trained}) |" in proc.stdout and f"{inside_delta:.4f} |" in proc.stdout
    assert (tmp_path / "position_loss.png").exists()


# -----------------------------------------------------------------------------
# --by document: the position within the token's own document

V, EOT, WORD = 16, 0, 1


class PositionInDocumentModel(torch.nn.Module):
    """A model whose only guess is WORD, surer the deeper into a document: logit a(p) = 0.5 p for WORD at
    position p (from 0) of a document, 0 elsewhere. Its loss at each token is known in closed form."""

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, V)
        for b in range(idx.size(0)):
            p = 0
            for t in range(idx.size(1)):
                p = 0 if t == 0 or idx[b, t] == EOT else p + 1
                logits[b, t, WORD] = 0.5 * p
        return logits, None


def test_loss_by_position_in_document_on_a_constructed_case():
    """Documents EOT WORD WORD ... of known lengths, packed and cut into windows: each token's loss is
    -log(e^a / (e^a + V - 1)) when WORD follows and -log(1 / (e^a + V - 1)) when the next document's EOT does,
    with a = 0.5 (its position in the document); the buckets' means, token and document counts follow."""
    from eval.position_loss import document_buckets, document_positions, log_buckets, token_losses
    lengths = [3, 70, 1, 40, 130, 9, 300, 2, 90]
    stream = [tok for n in lengths for tok in [EOT] + [WORD] * (n - 1)] + [EOT]
    T = 96
    n_windows = (len(stream) - 1) // T
    x = torch.tensor([stream[i * T:(i + 1) * T] for i in range(n_windows)])
    y = torch.tensor([stream[i * T + 1:(i + 1) * T + 1] for i in range(n_windows)])
    expected = {}  # bucket -> (losses, documents: the stream's, a document two windows cut is one)
    doc = 0
    for w in range(n_windows):
        p = 0
        for t in range(T):
            if x[w, t] == EOT:
                p, doc = 0, doc + 1
            elif t > 0:
                p += 1
            a = 0.5 * p
            loss = math.log(math.exp(a) + V - 1) - (a if y[w, t] == WORD else 0.0)
            bucket = (1, 63) if p + 1 <= 63 else (64, T)
            losses, docs = expected.setdefault(bucket, ([], set()))
            losses.append(loss)
            docs.add(doc)
    assert log_buckets(T) == [(1, 63), (64, 96)]
    losses = token_losses(PositionInDocumentModel(), x, y, batch_size=3)
    positions, documents = document_positions(x, EOT)
    rows = document_buckets(losses, positions, documents, log_buckets(T))
    for row, bucket in zip(rows, log_buckets(T)):
        want, docs = expected[bucket]
        assert (row["start"], row["end"] - 1) == bucket
        assert row["tokens"] == len(want) and row["documents"] == len(docs)
        assert row["loss"] == pytest.approx(sum(want) / len(want), rel=1e-6)  # float32 cross-entropy


def test_log_buckets_are_powers_of_four_up_to_the_block_size():
    from eval.position_loss import log_buckets
    assert log_buckets(1024) == [(1, 63), (64, 255), (256, 1023), (1024, 1024)]
    assert log_buckets(16384) == [(1, 63), (64, 255), (256, 1023), (1024, 4095), (4096, 16383), (16384, 16384)]
    assert log_buckets(40) == [(1, 40)]


def test_the_difference_interval_treats_a_document_as_one_draw():
    """Documents of equal size: the interval is Student's t interval of the documents' mean differences;
    of unequal sizes, the estimate is still the mean over tokens."""
    import scipy.stats
    from eval.position_loss import difference_by_document
    torch.manual_seed(0)
    documents = torch.arange(6).repeat_interleave(10)[None]  # six documents of 10 tokens in one row
    positions = torch.arange(1, 11).repeat(6)[None]
    a, b = torch.rand(1, 60, dtype=torch.float64), torch.rand(1, 60, dtype=torch.float64)
    row, = difference_by_document(b, a, positions, documents, [(1, 63)])
    per_document = (b - a).view(6, 10).mean(dim=1)
    want = scipy.stats.t.interval(0.95, 5, loc=per_document.mean().item(),
                                  scale=per_document.std().item() / math.sqrt(6))
    assert row["documents"] == 6 and row["difference"] == pytest.approx(per_document.mean().item(), rel=1e-12)
    assert row["ci"] == pytest.approx(want, rel=1e-9)
    uneven = torch.tensor([[0, 0, 0, 0, 1, 2, 2]])
    row, = difference_by_document(b[:, :7], a[:, :7], torch.ones_like(uneven), uneven, [(1, 63)])
    assert row["difference"] == pytest.approx((b[:, :7] - a[:, :7]).mean().item(), rel=1e-12)
    assert row["ci"][0] < row["difference"] < row["ci"][1]


@pytest.mark.slow
def test_cli_by_document_reports_buckets_counts_and_intervals(trained_runs, data_dir, tmp_path):
    proc, report = run_eval("position_loss.py", trained_runs["sa"], trained_runs["xsa"], "--labels", "SA", "XSA",
                            "--by", "document", "--num_sequences", "8", "--device", "cpu", out=tmp_path)
    T = MICRO["block_size"]
    assert report["by"] == "document" and report["eot_token"] == 50256 and report["block_size"] == T
    for label in ("SA", "XSA"):
        buckets = report["models"][label]["buckets"]
        assert [(b["start"], b["end"] - 1) for b in buckets] == [(1, T)]  # 32 tokens: one bucket, 1-63 cut at 32
        assert sum(b["tokens"] for b in buckets) == 8 * T
        assert buckets[0]["loss"] == pytest.approx(report["models"][label]["mean"], rel=1e-12)
    difference, = report["models"]["XSA"]["differences"]
    assert difference["difference"] == pytest.approx(report["models"]["XSA"]["mean"] - report["models"]["SA"]["mean"])
    # the fixture's val tokens: whole plays, so the 8 windows hold the end of one and maybe the start of the next
    x, _ = val_sequences(data_dir, T, 8 * T)
    tokens = x.flatten().tolist()
    documents = tokens.count(50256) + (tokens[0] != 50256)
    assert difference["documents"] == documents
    if documents > 1:
        assert difference["ci"][0] < difference["difference"] < difference["ci"][1]
    else:  # one document is one draw: no interval
        assert difference["ci"] is None and "[" not in proc.stdout.splitlines()[-3]
    assert "| position in document | tokens | documents | SA | XSA | XSA - SA [95% CI] |" in proc.stdout
    assert (tmp_path / "position_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_says_where_a_bucket_has_2_documents_only():
    """With 2 documents the document interval covers less than 95% (tests/test_interval_coverage.py): the table
    names those buckets and the measured coverage, and says nothing where every bucket has more."""
    from eval.position_loss import DOCUMENT_COVERAGE, format_document_table

    def results(counts):
        buckets = [{"start": s, "end": e, "tokens": 100, "documents": n, "loss": 3.0}
                   for (s, e), n in zip([(1, 64), (64, 256)], counts)]
        differences = [{"start": b["start"], "end": b["end"], "difference": -0.1, "ci": (-0.2, 0.0),
                        "documents": b["documents"], "df": 1.0} for b in buckets]
        return {"SA": {"buckets": buckets, "mean": 3.0},
                "XSA": {"buckets": buckets, "mean": 2.9, "differences": differences}}

    table = format_document_table(results([9, 2]))
    note = table.splitlines()[-1]
    assert "Bucket 64-255: 2 documents only" in note and f"{100 * DOCUMENT_COVERAGE[2]:.0f}%" in note
    assert "documents only" not in format_document_table(results([9, 3]))
