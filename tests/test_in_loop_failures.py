"""What can go wrong with train.py's in-loop passes (downstream tasks, similarity bias, samples), and how it ends:
everything a pass needs (GPT-2's encoding, tasks that report an accuracy, continuations that fit the context
window, each task once) is checked before step 1, in one line, with nothing written; a pass that fails later
never costs the training (the step is checkpointed first) and ends the run with exit status 3, which no launcher
relaunches, on every process alike. Also the eval scripts without GPT-2's encoding, and a resume whose tasks
differ."""

import os

import pytest
import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from configurator import ConfigError  # noqa: E402
from micro import micro_args  # noqa: E402
from pretrain.checkpointer import list_checkpoints  # noqa: E402
from pretrain.metrics import read_metrics  # noqa: E402
from pretrain.train_config import resolve  # noqa: E402
from running import REPO, run_python, run_ranks, run_train  # noqa: E402

# a few steps, a checkpoint every 2: the passes run at steps 2 and 4
SHORT = dict(max_iters=4, lr_decay_iters=4, eval_interval=2, checkpoint_interval=2, log_interval=1)


def test_a_task_named_twice_is_a_config_error():
    """downstream/avg would count it twice (and bench its examples twice)."""
    with pytest.raises(ConfigError, match="downstream_tasks names piqa more than once"):
        resolve(["config/sa_tiny.py", "--downstream_tasks=piqa,piqa,boolq"])
    assert resolve(["config/sa_tiny.py", "--downstream_tasks=piqa,boolq"])[0].downstream_tasks == "piqa,boolq"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The fixture copies of the paper's 8 tasks, and lambada_ppl: LAMBADA reporting its perplexity alone."""
    pytest.importorskip("lm_eval")
    from helpers import write_fixture_tasks
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_fixture_tasks(folder)
    with open(folder / "lambada_ppl.yaml", "w") as f:
        yaml.safe_dump({"include": "lambada_openai.yaml", "task": "lambada_ppl",
                        "metric_list": [{"metric": "perplexity", "aggregation": "perplexity",
                                         "higher_is_better": False}]}, f)
    return str(folder)


def one_line(result):
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stdout[-2000:] + result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case, status, says", [
    ("perplexity only", 2, "task lambada_ppl reports no acc or acc_norm (its metrics: perplexity)"),
    ("continuation longer than block_size", 2, "longer than block_size 8"),
    ("task named twice", 2, "downstream_tasks names piqa more than once"),
])
def test_a_task_the_loop_cannot_score_stops_the_run_before_it_writes_anything(data_dir, tasks, tmp_path, case,
                                                                              status, says):
    """Each of these failed at the first evaluation (KeyError 'acc,none', the adapter's AssertionError) or
    averaged a task twice."""
    settings = {"perplexity only": dict(downstream_tasks="piqa,lambada_ppl"),
                "continuation longer than block_size": dict(block_size=8),
                "task named twice": dict(downstream_tasks="piqa,piqa,boolq")}[case]
    out = tmp_path / "run"
    result = run_train(micro_args(data_dir, str(out), downstream_interval=2, downstream_limit=3,
                                  downstream_include_path=tasks, **{**SHORT, **settings}), check=False)
    assert result.status == status, result.stdout[-2000:] + result.stderr[-2000:]
    assert says in one_line(result)
    assert not out.exists()


def no_tokenizer_env(tmp_path):
    """This environment with an empty tiktoken cache and no network (a proxy that refuses every connection)."""
    (tmp_path / "empty_tiktoken_cache").mkdir(exist_ok=True)
    nowhere = "http://127.0.0.1:9"
    return {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_tiktoken_cache"), "HTTPS_PROXY": nowhere,
            "https_proxy": nowhere, "HTTP_PROXY": nowhere, "http_proxy": nowhere, "NO_PROXY": "", "no_proxy": ""}


@pytest.mark.slow
@pytest.mark.parametrize("interval", ["downstream_interval", "sample_interval"])
def test_without_gpt2s_encoding_a_run_that_needs_it_stops_before_it_writes_anything(data_dir, tasks, tmp_path,
                                                                                    interval):
    """Its own process: tiktoken keeps a loaded encoding for the process's life. Before, the run trained and
    ended at step 2 in a ConnectionError's traceback, exit 1 (relaunched), without step 2's checkpoint."""
    out = tmp_path / "run"
    result = run_python(["train.py", *micro_args(data_dir, str(out), downstream_limit=3, downstream_include_path=tasks,
                                                 **{**SHORT, interval: 2})], env=no_tokenizer_env(tmp_path))
    assert result.status == 3, result.stdout[-2000:] + result.stderr[-2000:]
    line = one_line(result)
    assert "cannot load GPT-2's encoding" in line and "TIKTOKEN_CACHE_DIR" in line and f"{interval}=0" in line
    assert not out.exists()


@pytest.mark.slow
def test_without_gpt2s_encoding_a_run_that_does_not_need_it_trains_and_logs_no_val_bpb(data_dir, tmp_path):
    """Bits per byte need each token's text; without the encoding the run says so in its log and trains on."""
    out = tmp_path / "run"
    result = run_python(["train.py", *micro_args(data_dir, str(out), **{**SHORT, "max_iters": 2})],
                        env=no_tokenizer_env(tmp_path))
    assert result.status == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "val_bpb is not logged: cannot load GPT-2's encoding" in result.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "val_loss" in r] == [2] and not any("val_bpb" in r for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["eval.downstream", "eval.sample"])
def test_the_eval_scripts_without_gpt2s_encoding_end_in_one_line(data_dir, tasks, tmp_path, script):
    out = str(tmp_path / "run")
    run_train(micro_args(data_dir, out, max_iters=2, checkpoint_interval=2, eval_interval=2))
    extra = ["--include_path", tasks, "--no_default_tasks", "--tasks", "piqa", "--limit", "2",
             "--out", str(tmp_path / "eval")] if script == "eval.downstream" else ["--num_samples", "1"]
    result = run_python(["-m", script, out, "--device", "cpu", *extra], env=no_tokenizer_env(tmp_path))
    assert result.status == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cannot load GPT-2's encoding" in one_line(result)


def records_by_step(out_dir):
    """{step: record} of out_dir's metrics.jsonl (helpers.records: the records in order)."""
    return {r["step"]: r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))}


def steps_checkpointed(out_dir):
    return [int(os.path.basename(p)[5:12]) for p in list_checkpoints(out_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("failing, interval", [("similarity", 2), ("similarity", 3), ("downstream", 2)])
def test_a_failing_in_loop_pass_keeps_the_steps_checkpoint_and_exits_3(data_dir, tasks, tmp_path, monkeypatch,
                                                                       failing, interval):
    """The pass raises at its first step. At a step with a checkpoint due (2) the checkpoint is written before the
    passes; at one without (3) the failure writes it: the training is never lost. The run ends in one line naming
    the pass and the step, exit 3, which train_forever.sh and the sweeps do not relaunch (before: a traceback,
    exit 1, relaunched into the same failure; the similarity pass ran before the checkpoint, which was lost)."""
    import eval.downstream
    import eval.similarity

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    if failing == "similarity":  # train.py, run afresh in this process, imports it from eval.similarity
        monkeypatch.setattr(eval.similarity, "in_loop_record", boom)
        settings = dict(similarity_interval=interval)
    else:  # the main process reads lm-eval's results
        monkeypatch.setattr(eval.downstream, "headline", boom)
        settings = dict(downstream_interval=interval, downstream_limit=2, downstream_include_path=tasks,
                        downstream_tasks="piqa")
    out = str(tmp_path / "run")
    result = run_train(micro_args(data_dir, out, **{**SHORT, **settings}), check=False)
    assert result.status == 3, result.stdout[-2000:] + result.stderr[-2000:]
    line = one_line(result)
    assert f"the in-loop {failing} pass failed at step {interval} (RuntimeError: boom)" in line
    assert f"step {interval} is checkpointed" in line
    assert steps_checkpointed(out) == ([2] if interval == 2 else [2, 3])
    assert max(records_by_step(out)) == interval  # the step's record, with its validation where it had one
    assert ("val_loss" in records_by_step(out)[interval]) == (interval % SHORT["eval_interval"] == 0)
    # and the run continues from there once the pass is fixed
    monkeypatch.undo()
    resumed = run_train(micro_args(data_dir, out, init_from="resume", **{**SHORT, **settings}))
    assert f"at step {interval}" in resumed.stdout
    assert max(records_by_step(out)) == SHORT["max_iters"]


@pytest.mark.slow
def test_a_resume_with_other_downstream_tasks_says_so(data_dir, tasks, tmp_path):
    out = str(tmp_path / "run")
    settings = dict(downstream_interval=2, downstream_limit=2, downstream_include_path=tasks)
    run_train(micro_args(data_dir, out, downstream_tasks="piqa,boolq", **{**SHORT, "max_iters": 2}, **settings))
    same = run_train(micro_args(data_dir, out, init_from="resume", downstream_tasks="boolq,piqa",
                                **{**SHORT, "max_iters": 3}, **settings))
    assert "downstream tasks differ" not in same.stdout  # the same set, in another order
    other = run_train(micro_args(data_dir, out, init_from="resume", downstream_tasks="piqa,arc_easy", **SHORT,
                                 **settings))
    [line] = [x for x in other.stdout.splitlines() if "downstream tasks differ" in x]
    assert "(boolq, piqa -> arc_easy, piqa)" in line and "after step 3" in line


# two gloo processes scoring with InLoopDownstream, lm-eval's results (which only the main process gets) faked
TWO_PROCESSES = r"""
import datetime, sys
from types import SimpleNamespace
import torch, torch.distributed as dist
import eval.downstream as downstream
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
runtime = SimpleNamespace(rank=rank, world_size=2, device="cpu", distributed=True, is_main=rank == 0)
results = {"piqa": {"acc,none": 0.5, "acc_norm,none": 0.75}, "boolq": {"acc,none": 0.25}}
passes = []
downstream.score = lambda *args, **kwargs: passes[-1] if rank == 0 else None
model = torch.nn.Linear(1, 1)
model.config = SimpleNamespace(block_size=32)
evaluation = object.__new__(downstream.InLoopDownstream)
evaluation.names, evaluation.limit, evaluation.tasks, evaluation.task_manager = ["piqa", "boolq"], 3, [], None
passes.append({"results": results, "n-samples": {"piqa": {"effective": 3}, "boolq": {"effective": 2}}})
print(f"rank {rank} scored {evaluation(model, runtime, 'float32', 4)}", flush=True)
# boolq without its acc: headline raises on the main process
passes.append({"results": {**results, "boolq": {"perplexity,none": 3.0}}, "n-samples": passes[0]["n-samples"]})
try:
    evaluation(model, runtime, "float32", 4)
    print(f"rank {rank} scored", flush=True)
except Exception as e:
    print(f"rank {rank} raised {type(e).__name__}: {e}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_failure_reading_the_results_on_the_main_process_ends_every_process(tmp_path):
    """Before, headline raised on rank 0 alone while rank 1 waited in the broadcast of the scores."""
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES)
    result = run_ranks(str(script), [], 2, env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert result.status == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank} scored {{'downstream/piqa': 0.75, 'downstream/boolq': 0.25, 'downstream/avg': 0.5}}"
                in result.stdout), result.stdout
    assert "rank 0 raised KeyError" in result.stdout and "task boolq reports no acc or acc_norm" in result.stdout
    assert "rank 1 raised RuntimeError: the main process could not read lm-eval's results" in result.stdout
