"""train.py's in-loop evaluation: downstream accuracy on fixed examples of lm-eval tasks, the similarity bias
by layer and bits per byte, as rows of metrics.jsonl. Each equals what eval/downstream.py, eval/similarity.py
or an independent computation give on the checkpoint of the same step; two processes and a resumed run log
the same rows; the evaluations leave the training untouched; and a task that cannot be evaluated stops the
run before it writes anything. All offline, on the local copies of the paper's 8 tasks."""

import json
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("lm_eval")
import tiktoken  # noqa: E402

from eval.downstream import TASKS  # noqa: E402
from helpers import write_fixture_tasks  # noqa: E402
from micro import CORPUS, EOT, MICRO, micro_args  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from pretrain.checkpointer import list_checkpoints, load_model  # noqa: E402
from pretrain.dataloader import val_sequences  # noqa: E402
from pretrain.metrics import read_metrics  # noqa: E402
from running import run_in_process, run_train  # noqa: E402
from train import evaluate, token_bytes  # noqa: E402

pytestmark = pytest.mark.slow

# dropout: every step draws random numbers, so an evaluation that moved the RNG would show in the losses
IN_LOOP = dict(max_iters=20, lr_decay_iters=20, eval_interval=10, checkpoint_interval=10, keep_checkpoints=5,
               downstream_interval=10, downstream_limit=3, log_interval=5, dropout=0.1)
LIMIT = IN_LOOP["downstream_limit"]
EVAL_STEPS = [10, 20]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_fixture_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def runs(data_dir, tasks, tmp_path_factory):
    """20-step SA and XSA runs evaluating the 8 tasks and the similarity bias at steps 10 and 20:
    {attn_type: out_dir}."""
    out = {}
    for attn_type in ("sa", "xsa"):
        out[attn_type] = str(tmp_path_factory.mktemp(f"in_loop_{attn_type}"))
        run_train(micro_args(data_dir, out[attn_type], attn_type=attn_type, downstream_include_path=tasks, **IN_LOOP))
    return out


def rows(out_dir, prefix):
    """{step: {key: value}} of the metrics.jsonl keys starting with prefix, at the steps that logged any."""
    found = {}
    for record in read_metrics(os.path.join(out_dir, "metrics.jsonl")):
        keys = {k: v for k, v in record.items() if k.startswith(prefix)}
        if keys:
            found[record["step"]] = keys
    return found


def checkpoint_at(out_dir, step):
    [path] = [p for p in list_checkpoints(out_dir) if p.endswith(f"{step:07d}.pt")]
    return path


def test_the_rows_hold_every_key_at_the_evaluation_steps(runs):
    for attn_type, out_dir in runs.items():
        downstream = rows(out_dir, "downstream/")
        assert sorted(downstream) == EVAL_STEPS
        for values in downstream.values():
            assert set(values) == {f"downstream/{task}" for task in TASKS} | {"downstream/avg"}
            assert all(0.0 <= v <= 1.0 for v in values.values())
            assert values["downstream/avg"] == pytest.approx(sum(values[f"downstream/{t}"] for t in TASKS) / 8)
        similarity = rows(out_dir, "similarity/")
        assert sorted(similarity) == EVAL_STEPS
        per_layer = ["cos_yv", "self_weight"] + (["cos_zv"] if attn_type == "xsa" else [])
        for values in similarity.values():
            assert set(values) == ({f"similarity/layer{i}/{q}" for i in range(MICRO["n_layer"]) for q in per_layer}
                                   | {"similarity/mean_cos_yv"})
            layers = [values[f"similarity/layer{i}/cos_yv"] for i in range(MICRO["n_layer"])]
            assert values["similarity/mean_cos_yv"] == pytest.approx(sum(layers) / len(layers))
        assert sorted(rows(out_dir, "val_bpb")) == sorted(rows(out_dir, "val_loss")) == EVAL_STEPS
        log = open(os.path.join(out_dir, "train.log")).read()
        for step in EVAL_STEPS:  # one line each, with the numbers of the row
            avg = downstream[step]["downstream/avg"]
            assert f"step {step} downstream | avg {avg:.4f} | arc_easy " in log
            assert f"step {step} similarity | mean cos(y, v) {similarity[step]['similarity/mean_cos_yv']:.4f}" in log


@pytest.mark.parametrize("attn_type", ["sa", "xsa"])
def test_in_loop_accuracy_is_eval_downstreams_on_the_checkpoint_of_that_step(runs, tasks, attn_type, tmp_path):
    out_dir = runs[attn_type]
    checkpoints = [checkpoint_at(out_dir, step) for step in EVAL_STEPS]
    result = run_in_process(["-m", "eval.downstream", *checkpoints, "--labels", *map(str, EVAL_STEPS),
                             "--include_path", tasks, "--no_default_tasks", "--limit", str(LIMIT), "--batch_size", "4",
                             "--device", "cpu", "--bootstrap_iters", "0", "--quiet", "--out", tmp_path])
    assert result.status == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "downstream.json").read_text())
    in_loop = rows(out_dir, "downstream/")
    for step in EVAL_STEPS:
        results = report["models"][str(step)]["results"]
        for task, (_, metric) in TASKS.items():
            assert report["models"][str(step)]["n_samples"][task]["effective"] == LIMIT  # the same examples
            assert in_loop[step][f"downstream/{task}"] == results[task][f"{metric},none"], (step, task)


@pytest.mark.parametrize("attn_type", ["sa", "xsa"])
def test_in_loop_similarity_is_eval_similaritys_on_the_checkpoint_of_that_step(runs, attn_type, tmp_path):
    """The fixed batch is the first batch_size (4) validation sequences."""
    out_dir = runs[attn_type]
    in_loop = rows(out_dir, "similarity/")
    for step in EVAL_STEPS:
        result = run_in_process(["-m", "eval.similarity", checkpoint_at(out_dir, step), "--labels", "run",
                                 "--num_sequences", "4", "--batch_size", "2", "--device", "cpu", "--quiet",
                                 "--out", tmp_path])
        assert result.status == 0, result.stdout[-3000:] + result.stderr[-3000:]
        script = json.loads((tmp_path / "similarity.json").read_text())["models"]["run"]
        assert script["num_sequences"] == 4
        for i in range(MICRO["n_layer"]):
            assert in_loop[step][f"similarity/layer{i}/cos_yv"] == pytest.approx(script["cos_yv"][i], rel=1e-5)
            assert in_loop[step][f"similarity/layer{i}/self_weight"] == pytest.approx(script["a_ii"][i], rel=1e-5)
            if attn_type == "xsa":
                assert in_loop[step][f"similarity/layer{i}/cos_zv"] == pytest.approx(script["cos_zv"][i],
                                                                                     rel=1e-3, abs=1e-7)


def test_xsas_output_is_orthogonal_to_its_value_and_sas_is_not(runs):
    for step, values in rows(runs["xsa"], "similarity/").items():
        for i in range(MICRO["n_layer"]):
            assert abs(values[f"similarity/layer{i}/cos_zv"]) < 1e-5, (step, i)
    for step, values in rows(runs["sa"], "similarity/").items():
        assert values["similarity/mean_cos_yv"] > 0.05, step  # attention outputs lean towards their own value


def test_val_bpb_is_the_text_tokens_loss_in_bits_per_byte_of_their_text(runs, data_dir):
    """Recomputed from the checkpoint and the text itself: the loss over every target token but the end-of-text
    token, in bits, over the UTF-8 bytes those tokens decode to."""
    enc = tiktoken.get_encoding("gpt2")
    out_dir = runs["sa"]
    model, config = load_model(checkpoint_at(out_dir, 20))
    x, y = val_sequences(data_dir, config["block_size"], config["val_tokens"])
    with torch.no_grad():
        losses = F.cross_entropy(model(x)[0].double().flatten(0, 1), y.flatten(), reduction="none")
    text = y.flatten() != EOT
    n_bytes = len(enc.decode_bytes(y.flatten()[text].tolist()))
    want = losses[text].sum().item() / math.log(2) / n_bytes
    record = [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if r["step"] == 20][0]
    assert record["val_bpb"] == pytest.approx(want, rel=1e-5)
    assert record["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)


@pytest.mark.parametrize("world_size", [1, 3])
def test_bits_per_byte_leave_out_the_end_of_text_and_padded_ids(world_size):
    """evaluate() on sequences holding document boundaries and ids past GPT-2's vocabulary, which are no text:
    neither their loss nor any bytes count. With several processes, each one's sums add up to the same. Every
    forward has the batch's shape, a short last batch (or none left) included: a compiled model compiles once."""
    enc = tiktoken.get_encoding("gpt2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MICRO)).eval()
    batch_sizes = []
    model.register_forward_pre_hook(lambda module, args: batch_sizes.append(len(args[0])))
    tokens = torch.tensor(enc.encode_ordinary(open(CORPUS[0]).read()[:4000])[:5 * 32 + 1])
    tokens[[10, 70, 131]] = EOT
    tokens[[40, 100]] = 50300  # a padded id
    x, y = tokens[:-1].view(5, 32), tokens[1:].view(5, 32)
    val_bytes = token_bytes(MICRO["vocab_size"], log=None)[y]
    sums = torch.zeros(4, dtype=torch.float64)
    for rank in range(world_size):  # each process's share, then the sums gathered as all_reduce would
        runtime = SimpleNamespace(rank=rank, world_size=world_size, device="cpu", device_type="cpu",
                                  distributed=False)
        loss, bpb = evaluate(model, x, y, runtime, batch_size=2, dtype="float32", val_bytes=val_bytes)
        mine = torch.arange(rank, 5, world_size)
        sums += torch.tensor([loss * y[mine].numel(), y[mine].numel(), bpb * math.log(2) * val_bytes[mine].sum(),
                              val_bytes[mine].sum()], dtype=torch.float64)
    assert set(batch_sizes) == {2} and len(batch_sizes) == world_size * math.ceil(math.ceil(5 / world_size) / 2)
    with torch.no_grad():
        losses = F.cross_entropy(model(x)[0].double().flatten(0, 1), y.flatten(), reduction="none")
    text = (y.flatten() != EOT) & (y.flatten() < enc.n_vocab)
    assert text.sum() == y.numel() - 5
    n_bytes = len(enc.decode_bytes(y.flatten()[text].tolist()))
    assert sums[3] == n_bytes
    assert (sums[2] / math.log(2) / sums[3]).item() == pytest.approx(losses[text].sum().item() / math.log(2) / n_bytes,
                                                                     rel=1e-6)
    assert (sums[0] / sums[1]).item() == pytest.approx(losses.mean().item(), rel=1e-6)


def passes_at_step_4(tasks):
    """4 steps, every in-loop pass at step 4."""
    return dict(max_iters=4, eval_interval=4, checkpoint_interval=0, downstream_interval=4, downstream_limit=LIMIT,
                downstream_include_path=tasks)


@pytest.fixture(scope="module")
def one_process_passes(data_dir, tasks, tmp_path_factory):
    """A one-process run with every pass at step 4: the rows the two-process runs must log."""
    out = str(tmp_path_factory.mktemp("passes_one_process"))
    run_train(micro_args(data_dir, out, **passes_at_step_4(tasks)))
    return out


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_processes_log_the_rows_of_one(data_dir, tasks, one_process_passes, tmp_path, parallelism):
    """The requests split across the processes (each scoring whole batches of the one-process batching) and
    gathered; the similarity sums gathered likewise; under FSDP every process runs the same forwards."""
    run_train(micro_args(data_dir, str(tmp_path / "two"), parallelism=parallelism, **passes_at_step_4(tasks)),
              nproc=2)
    one, two = rows(one_process_passes, ""), rows(str(tmp_path / "two"), "")
    for key in one[4]:
        if key.startswith("downstream/"):
            assert two[4][key] == one[4][key], key  # accuracies: counts of the same verdicts
        elif key.startswith(("similarity/", "val_bpb")):
            assert two[4][key] == pytest.approx(one[4][key], rel=1e-4, abs=1e-6), key
    assert {k for k in two[4] if k.startswith(("downstream/", "similarity/"))} == \
        {k for k in one[4] if k.startswith(("downstream/", "similarity/"))}


def test_a_resumed_run_logs_the_rows_of_the_uninterrupted_one(runs, data_dir, tasks, tmp_path):
    out = str(tmp_path / "run")
    run_train(micro_args(data_dir, out, downstream_include_path=tasks, **{**IN_LOOP, "max_iters": 10}))
    proc = run_train(micro_args(data_dir, out, downstream_include_path=tasks, init_from="resume", **IN_LOOP))
    assert "at step 10" in proc.stdout
    for prefix in ("downstream/", "similarity/", "val_bpb"):
        assert rows(out, prefix) == rows(runs["sa"], prefix), prefix  # exactly


def test_in_loop_evaluation_leaves_the_training_untouched(runs, data_dir, tmp_path):
    """The same run without downstream and similarity passes has the same losses, to the last bit (under
    dropout, a moved RNG would show): lm-eval seeds every generator it knows on each call."""
    out = str(tmp_path / "run")
    run_train(micro_args(data_dir, out, **{**IN_LOOP, "downstream_interval": 0, "similarity_interval": 0}))
    assert not rows(out, "downstream/") and not rows(out, "similarity/")
    losses = [(r["step"], r["train_loss"]) for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    assert losses == [(r["step"], r["train_loss"]) for r in read_metrics(os.path.join(runs["sa"], "metrics.jsonl"))]


@pytest.mark.parametrize("case, status, says", [
    ("unknown task", 2, "unknown task hellaswg: downstream_include_path does not define it; close: hellaswag"),
    ("missing include path", 2, "downstream_include_path"),
    ("no hub", 3, "cannot load task arc_easy"),
    ("a broken task file", 2, "broken.yaml cannot be read (ParserError"),
    ("an empty include folder", 2, "defines no task: it holds no .yaml file"),
])
def test_a_task_that_cannot_be_evaluated_stops_the_run_before_it_writes_anything(data_dir, tasks, tmp_path, case,
                                                                                 status, says):
    broken, empty = tmp_path / "broken_tasks", tmp_path / "empty_tasks"
    shutil.copytree(tasks, broken)
    (broken / "broken.yaml").write_text("task: hellaswag\ndataset_path: [unclosed\n  : :\n")
    os.remove(next(broken.rglob("hellaswag*.yaml")))  # the broken file stands where hellaswag's was
    empty.mkdir()
    settings = {"unknown task": dict(downstream_include_path=tasks, downstream_tasks="arc_easy,hellaswg"),
                "missing include path": dict(downstream_include_path=str(tmp_path / "no_such_folder")),
                "no hub": dict(downstream_tasks="arc_easy"),  # offline, and nothing in the cache
                "a broken task file": dict(downstream_include_path=str(broken), downstream_tasks="hellaswag"),
                "an empty include folder": dict(downstream_include_path=str(empty), downstream_tasks="arc_easy")}[case]
    out = tmp_path / "run"
    result = run_train(micro_args(data_dir, str(out), downstream_interval=5, **settings), check=False,
                       env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                            "HF_HOME": str(tmp_path / "empty_hf_home")})
    assert result.status == status, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert not out.exists()


def test_the_default_tasks_are_the_papers_8_and_the_paper_configs_evaluate_them():
    from pretrain.train_config import TRAIN_KEYS, resolve
    assert TRAIN_KEYS["downstream_tasks"].default.split(",") == list(TASKS)
    for size in ("0p7b", "1p4b", "2p7b"):
        c = resolve([f"config/xsa_{size}.py"])[0]
        assert c.downstream_interval > 0 and c.similarity_interval == c.eval_interval
    assert resolve(["config/xsa_tiny.py"])[0].downstream_interval == 0  # the tiny configs leave it off


@pytest.mark.slow
def test_samples_of_a_model_with_compiled_blocks_run_eagerly():
    """Under FSDP each block is compiled on its own (parallelize.py) and train.py samples from that model:
    decoding with the KV cache, a new length at every token, must not compile (and recompile) the blocks,
    which dynamo would do up to its limit before falling back to eager quietly."""
    from pretrain.parallelize import compile_counts
    from pretrain.runtime import Runtime
    from train import sample_text
    torch._dynamo.reset()
    model = GPT(GPTConfig(**MICRO))
    for block in model.transformer.h:
        block.compile(backend="eager")  # what dynamo traces is the point, not the kernels
    x = torch.randint(0, MICRO["vocab_size"], (2, MICRO["block_size"]))
    model(x, x)  # the training forward: compiled
    graphs = compile_counts()[0]
    assert graphs >= 1
    runtime = Runtime(0, 0, 1, "cpu", "cpu", False)
    text = sample_text(model, runtime, "float32", seed=1, max_new_tokens=12)
    assert isinstance(text, str) and text
    assert compile_counts()[0] == graphs  # nothing compiled for the samples
