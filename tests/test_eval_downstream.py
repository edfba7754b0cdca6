"""eval/downstream.py: the lm-eval adapter scores exactly what the model computes, the real
lm-eval definitions of the paper's 8 tasks run end to end on tiny local fixtures, the recipe of
docs/evaluation.md for a machine without the Hub runs as written, and task data that cannot be
read (no Hub, a missing, empty or corrupt data file) stops the script in one line before any model
loads."""

import io
import json
import math
import os
import re
import sys

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("lm_eval")
import tiktoken  # noqa: E402
import yaml  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from eval.downstream import PAPER_TABLE2, PAPER_TASK_YAMLS, TASKS, make_adapter_class  # noqa: E402
from fakes.hub import NOWHERE, no_hub_env  # noqa: E402
from helpers import LM_EVAL_FIXTURES as FIXTURES, write_fixture_tasks  # noqa: E402
from pretrain.checkpointer import list_checkpoints, load_model  # noqa: E402
from running import REPO, run_in_process, run_python, run_script  # noqa: E402

VOCAB = 50257


@pytest.fixture(scope="module")
def sa_model(trained_runs):
    model, _ = load_model(trained_runs["sa"], "cpu")
    return model


@pytest.fixture(scope="module")
def corpus_tokens(corpus_docs):
    return tiktoken.get_encoding("gpt2").encode_ordinary(corpus_docs[0][:20_000])


@torch.no_grad()
def brute_force(model, context, continuation):
    """One (context, continuation) pair alone, float64: lm-eval gives the model the last
    block_size tokens before the last continuation token, so each prediction sees as much
    context as fits in the window."""
    window = (context + continuation)[-(model.config.block_size + 1):]
    logits, _ = model(torch.tensor([window[:-1]]))
    log_probs = torch.log_softmax(logits[0, :, :VOCAB].double(), dim=-1)
    first = len(window) - 1 - len(continuation)  # the position whose logits predict continuation[0]
    total, greedy = 0.0, True
    for j, token in enumerate(continuation):
        total += log_probs[first + j, token].item()
        greedy &= log_probs[first + j].argmax().item() == token
    return total, greedy


@torch.no_grad()
def greedy_rollout(model, context, n):
    tokens = list(context)
    for _ in range(n):
        logits, _ = model(torch.tensor([tokens]))
        tokens.append(logits[0, -1, :VOCAB].argmax().item())
    return tokens[len(context):]


@pytest.fixture(scope="module")
def requests_and_expected(sa_model, corpus_tokens):
    """Random slices of text as (context, continuation), short and longer than block_size (32),
    plus greedy continuations so that both values of the greedy flag occur."""
    g = torch.Generator().manual_seed(0)
    requests = []
    for ctx_len, cont_len in [(1, 1), (5, 3), (12, 7), (20, 12), (31, 2), (32, 1), (40, 5), (60, 20),
                              (33, 32), (90, 4), (7, 25), (2, 30)]:
        start = torch.randint(0, len(corpus_tokens) - 200, (1,), generator=g).item()
        context = corpus_tokens[start:start + ctx_len]
        requests.append((None, context, corpus_tokens[start + ctx_len:start + ctx_len + cont_len]))
    for ctx_len, cont_len in [(3, 2), (10, 4), (20, 13)]:  # fits the window: the rollout is what greedy means
        context = corpus_tokens[1000 + ctx_len:1000 + 2 * ctx_len]
        requests.append((None, context, greedy_rollout(sa_model, context, cont_len)))
    expected = [brute_force(sa_model, context, continuation) for _, context, continuation in requests]
    return requests, expected


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_loglikelihoods_match_brute_force(sa_model, requests_and_expected, batch_size):
    requests, expected = requests_and_expected
    adapter = make_adapter_class()(sa_model, "cpu", "float32", batch_size=batch_size)
    got = adapter._loglikelihood_tokens(requests)
    assert len(got) == len(expected)
    for (logprob, greedy), (want_logprob, want_greedy) in zip(got, expected):
        assert logprob == pytest.approx(want_logprob, rel=1e-4, abs=1e-4)
        assert greedy == want_greedy
    assert {greedy for _, greedy in expected} == {True, False}  # both cases were checked


@pytest.mark.slow
def test_loglikelihood_strings_use_end_of_text_for_empty_context(sa_model):
    """The string entry point (lm-eval's TemplateLM) with our tokenizer: an empty context is the
    end-of-text token, as at the start of every training document."""
    enc = tiktoken.get_encoding("gpt2")
    adapter = make_adapter_class()(sa_model, "cpu", "float32", batch_size=2)
    pairs = [("", "To be, or not to be"), ("ROMEO: What light", " through yonder window breaks")]
    got = adapter.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                                disable_tqdm=True)
    assert got[0][0] == pytest.approx(brute_force(sa_model, [enc.eot_token], enc.encode_ordinary(pairs[0][1]))[0],
                                      rel=1e-4)
    context = enc.encode_ordinary(pairs[1][0])
    continuation = enc.encode_ordinary(pairs[1][0] + pairs[1][1])[len(context):]
    assert got[1][0] == pytest.approx(brute_force(sa_model, context, continuation)[0], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("n_tokens", [10, 32, 33, 100])
def test_loglikelihood_rolling_is_the_sum_over_disjoint_windows(sa_model, corpus_tokens, n_tokens):
    """Every token predicted exactly once; the first window starts from end-of-text, every later
    window predicts up to block_size tokens after the block_size tokens before each of them."""
    enc = tiktoken.get_encoding("gpt2")
    text = enc.decode(corpus_tokens[500:500 + n_tokens])
    tokens = enc.encode_ordinary(text)
    block = sa_model.config.block_size
    expected = 0.0
    for start in range(0, len(tokens), block):
        end = min(start + block, len(tokens))
        context = [enc.eot_token] if start == 0 else tokens[max(0, end - 1 - block):start]
        expected += brute_force(sa_model, context, tokens[start:end])[0]
    adapter = make_adapter_class()(sa_model, "cpu", "float32", batch_size=3)
    got = adapter.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0),
                                         Instance("loglikelihood_rolling", {}, ("Hello",), 1)])
    assert got[0] == pytest.approx(expected, rel=1e-4)
    hello = brute_force(sa_model, [enc.eot_token], enc.encode_ordinary("Hello"))[0]
    assert got[1] == pytest.approx(hello, rel=1e-4)


@pytest.mark.slow
def test_generate_until_is_greedy_and_stops_at_stop_strings(sa_model):
    enc = tiktoken.get_encoding("gpt2")
    adapter = make_adapter_class()(sa_model, "cpu", "float32")
    context = "ROMEO:"

    def generate(until):
        request = Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": 8}), 0)
        return adapter.generate_until([request])[0]

    rollout = greedy_rollout(sa_model, enc.encode_ordinary(context), 8)
    rollout = rollout[:rollout.index(enc.eot_token)] if enc.eot_token in rollout else rollout
    assert len(rollout) >= 3
    assert generate(["\x00"]) == enc.decode(rollout)  # a stop string that never comes: max_gen_toks
    stop = enc.decode(rollout[2:3])
    assert generate([stop]) == enc.decode(rollout).split(stop)[0]


@pytest.mark.slow
def test_adapter_draws_a_progress_bar_over_batches_on_a_terminal_unless_quiet(sa_model, requests_and_expected,
                                                                            monkeypatch):
    requests, _ = requests_and_expected

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    batches = math.ceil(len(requests) / 4)
    for quiet in (False, True):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        make_adapter_class()(sa_model, "cpu", "float32", batch_size=4, quiet=quiet)._loglikelihood_tokens(requests)
        if quiet:
            assert terminal.getvalue() == ""
        else:
            assert re.search(rf"100%\|[^\r]*\| {batches}/{batches} \[\d\d:\d\d<\d\d:\d\d", terminal.getvalue())


def test_paper_table_averages_are_the_mean_of_the_eight_tasks():
    for label, values in PAPER_TABLE2.items():
        assert len(values) == len(TASKS) + 1
        assert sum(values[:-1]) / len(TASKS) == pytest.approx(values[-1], abs=0.006), label


def test_the_table_shows_the_tasks_asked_for():
    """Tasks beyond the paper's 8 (a local task under another name, MMLU, a user's own) get columns of their own,
    beside those of the paper's tasks asked for; before, they were scored into downstream.json while the table
    showed the paper's 8 columns, all "-". A task with no accuracy (perplexity only) shows "-"."""
    from eval.downstream import format_table, headline_row, table_columns
    names = ["piqa", "mmlu", "my_task", "lambada_ppl"]
    results = {"piqa": {"acc,none": 0.6, "acc_norm,none": 0.625}, "mmlu": {"acc,none": 0.25},
               "my_task": {"acc,none": 0.5, "acc_norm,none": 0.75}, "lambada_ppl": {"perplexity,none": 30.0}}
    row = headline_row(results)
    assert row == {"PIQA": 62.5, "mmlu": 25.0, "my_task": 75.0}  # acc_norm where a task reports it
    columns = table_columns(names)
    assert columns == ["PIQA", "mmlu", "my_task", "lambada_ppl"]
    lines = format_table({"model": row}, columns).splitlines()
    assert lines[0] == "| model | PIQA | mmlu | my_task | lambada_ppl |"
    assert lines[2] == "| model | 62.50 | 25.00 | 75.00 | - |"
    # the paper's 8: its columns in its order, and its avg; with --paper, all 8 beside any other task
    assert table_columns(list(reversed(TASKS))) == [column for column, _ in TASKS.values()] + ["avg"]
    assert table_columns(["mmlu"], paper=True) == [column for column, _ in TASKS.values()] + ["mmlu", "avg"]


# -----------------------------------------------------------------------------
# the real task definitions on local fixtures

@pytest.fixture(scope="module")
def fixture_tasks(tmp_path_factory):
    return write_fixture_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def downstream_report(trained_runs, fixture_tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("downstream")
    proc = run_in_process(
        ["-m", "eval.downstream", "--sa", trained_runs["sa"], "--xsa", trained_runs["xsa"],
         "--include_path", fixture_tasks, "--no_default_tasks", "--device", "cpu", "--batch_size", "4",
         "--bootstrap_iters", "10", "--paper", "--out", out])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "downstream.json") as f:
        report = json.load(f)
    with open(out / "downstream.md") as f:
        markdown = f.read()
    return report, markdown, proc.stdout


@pytest.mark.slow
def test_eight_tasks_run_end_to_end_on_fixtures(downstream_report):
    report, markdown, stdout = downstream_report
    columns = [column for column, _ in TASKS.values()]
    assert list(report["table"]) == ["SA", "XSA", "delta XSA - SA"]
    for label in ("SA", "XSA"):
        row = report["table"][label]
        assert list(row) == columns + ["avg"]
        assert all(0 <= row[c] <= 100 for c in row)
        assert row["avg"] == pytest.approx(sum(row[c] for c in columns) / 8)
        for task in TASKS:  # every fixture example was scored: the data came from the fixtures
            with open(os.path.join(FIXTURES, f"{task}.jsonl")) as f:
                assert report["models"][label]["n_samples"][task]["effective"] == len(f.readlines())
    for c in columns + ["avg"]:
        delta = report["table"]["XSA"][c] - report["table"]["SA"][c]
        assert report["table"]["delta XSA - SA"][c] == pytest.approx(delta)
    header = "| model | " + " | ".join(columns) + " | avg |"
    assert header in markdown and header in stdout
    assert "| paper 1.3B XSA | 58.84 | 62.29 |" in stdout


def score_strings(model, context, continuation):
    """brute_force on strings, split as lm-eval splits them: encode the whole, then cut at the context's length."""
    enc = tiktoken.get_encoding("gpt2")
    ctx = enc.encode_ordinary(context)
    return brute_force(model, ctx, enc.encode_ordinary(context + continuation)[len(ctx):])[0]


@pytest.mark.slow
@pytest.mark.parametrize("label", ["SA", "XSA"])
def test_task_results_match_brute_force_scoring(downstream_report, trained_runs, label):
    """Two tasks recomputed from their documents with the plain model: BoolQ accuracy (choices
    " no"/" yes") and LAMBADA perplexity (exp of the mean negative log-likelihood of the last word).
    For both models: the tasks' data is loaded once and scored afresh for the second."""
    report, _, _ = downstream_report
    model, _ = load_model(trained_runs[label.lower()], "cpu")
    with open(os.path.join(FIXTURES, "boolq.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    correct = 0
    for doc in docs:
        context = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
        scores = [score_strings(model, context, " no"), score_strings(model, context, " yes")]
        correct += scores.index(max(scores)) == doc["label"]
    assert report["models"][label]["results"]["boolq"]["acc,none"] == pytest.approx(correct / len(docs))

    with open(os.path.join(FIXTURES, "lambada_openai.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    nll = [-score_strings(model, " ".join(t.split(" ")[:-1]), " " + t.split(" ")[-1]) for t in texts]
    assert report["models"][label]["results"]["lambada_openai"]["perplexity,none"] == \
        pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


@pytest.mark.slow
def test_scoring_skips_lm_evals_environment_report(sa_model, fixture_tasks, monkeypatch):
    """simple_evaluate's report of the environment (torch's collect_env, which runs `pip list`) is not made:
    the scores come without it, and lm-eval is left as it was."""
    import lm_eval.evaluator
    import torch.utils.collect_env
    from lm_eval.tasks import TaskManager
    from eval.downstream import evaluate_model
    reports = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "")
    before = lm_eval.evaluator.add_env_info
    results = evaluate_model(sa_model, ["boolq"], "cpu", "float32", batch_size=4, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=fixture_tasks, include_defaults=False))
    assert 0 <= results["results"]["boolq"]["acc,none"] <= 1 and "pretty_env_info" not in results
    assert reports == [] and lm_eval.evaluator.add_env_info is before
    lm_eval.evaluator.add_env_info(results)  # the report the scoring left out, as lm-eval makes it
    assert reports == [1] and "pretty_env_info" in results


def test_hellaswag_fixture_uses_the_installed_process_docs(fixture_tasks):
    """The included YAML's `!function utils.process_docs` resolves next to the installed file."""
    from lm_eval.tasks import TaskManager
    task = TaskManager(include_path=fixture_tasks, include_defaults=False).load(["hellaswag"])["tasks"]["hellaswag"]
    doc = next(iter(task.validation_docs()))
    assert doc["query"].startswith("Making a sandwich: A man lays two slices")
    assert len(doc["choices"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "truncated"])
def test_a_checkpoint_that_cannot_be_loaded_is_named_in_one_line(trained_runs, fixture_tasks, case, tmp_path):
    """A missing path fails before lm-eval indexes its tasks; a truncated file when its turn comes."""
    path = str(tmp_path / "no_such_run")
    if case == "truncated":
        path = str(tmp_path / "truncated.pt")
        with open(list_checkpoints(trained_runs["sa"])[-1], "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 3])
    proc = run_in_process(
        ["-m", "eval.downstream", "--sa", trained_runs["sa"], "--xsa", path, "--tasks", "boolq",
         "--include_path", fixture_tasks, "--no_default_tasks", "--device", "cpu", "--out", tmp_path])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()  # with a truncated file, after lm-eval's progress on SA
    reason = "no such file or directory" if case == "missing" else "truncated"
    assert lines[-1].startswith(f"cannot load checkpoint {path}: ") and reason in lines[-1]
    assert ("evaluating SA" in proc.stdout) == (case == "truncated")  # a mistyped path fails before any work
    assert len(lines) == 1 or case == "truncated"


# -----------------------------------------------------------------------------
# without the Hub


def docs_block(heading):
    """The first bash block under a heading of docs/evaluation.md."""
    with open(os.path.join(REPO, "docs", "evaluation.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(heading):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def offline_env(tmp_path, **extra):
    """No Hub: offline mode, an empty cache of datasets, and an endpoint nothing listens on."""
    return no_hub_env(NOWHERE, tmp_path, **{"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                            "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), **extra})


@pytest.mark.slow
def test_the_documented_recipe_without_the_hub_runs_as_written(trained_runs, tmp_path):
    """The commands of docs/evaluation.md, "Without the Hub", run unchanged from a checkout whose
    out/sa_tiny is a trained run: the YAML's data file, named relative to the YAML's folder, is
    read (not the working directory's), and only the task it defines is evaluated."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in os.listdir(REPO):
        if name not in ("out", "my_tasks"):
            os.symlink(os.path.join(REPO, name), checkout / name)
    (checkout / "out").mkdir()
    os.symlink(trained_runs["sa"], checkout / "out" / "sa_tiny")
    block = docs_block("### Without the Hub")
    assert "--include_path my_tasks/ --no_default_tasks" in block and "--tasks" not in block
    env = offline_env(tmp_path, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = run_script(["bash", "-e", "-c", block], cwd=checkout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(checkout / "out" / "eval" / "downstream.json") as f:
        report = json.load(f)
    assert report["tasks"] == ["hellaswag"]
    with open(os.path.join(FIXTURES, "hellaswag.jsonl")) as f:
        assert report["models"]["out/sa_tiny"]["n_samples"]["hellaswag"]["effective"] == len(f.readlines())
    assert set(report["table"]["out/sa_tiny"]) == {"HSwag"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["Hub unreachable", "offline, not cached"])
def test_without_the_hub_the_paper_tasks_stop_in_one_line_before_any_model(trained_runs, tmp_path, mode):
    """With the Hub out of reach: one line naming the first task's dataset and the ways out, exit 3,
    instead of half a minute of retries and a 40-line traceback. In offline mode without the data in
    the cache: one line naming the task and its dataset."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml
    installed = os.path.join(os.path.dirname(lm_eval.tasks.__file__), PAPER_TASK_YAMLS["arc_easy"])
    dataset = load_yaml(installed, resolve_func=False)["dataset_path"]
    env = offline_env(tmp_path, HF_HUB_OFFLINE=None, HF_DATASETS_OFFLINE=None) if mode == "Hub unreachable" \
        else offline_env(tmp_path)
    proc = run_python(["-m", "eval.downstream", trained_runs["sa"], "--limit", "20", "--device", "cpu",
                       "--out", tmp_path / "out"], env=env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "evaluating" not in proc.stdout, proc.stderr[-3000:]
    if mode == "Hub unreachable":
        assert lines[0].startswith(f"cannot read {dataset} (the data of task arc_easy) from the Hugging Face Hub (")
        assert "HF_DATASETS_OFFLINE=1" in lines[0]
    else:
        assert lines[0].startswith(f"cannot load task arc_easy, {dataset} from the Hub (")
    assert "docs/evaluation.md" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "empty", "not JSON", "not an object"])
def test_a_task_data_file_that_cannot_be_read_is_named_in_one_line(trained_runs, tmp_path, case):
    """A task YAML of --include_path whose data file (relative to it) is missing, empty or not JSON lines."""
    import lm_eval.tasks
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    installed = os.path.join(os.path.dirname(lm_eval.tasks.__file__), PAPER_TASK_YAMLS["boolq"])
    with open(tasks / "boolq.yaml", "w") as f:
        yaml.safe_dump({"include": installed, "dataset_path": "json", "dataset_name": None,
                        "dataset_kwargs": {"data_files": {"train": "boolq.jsonl", "validation": "boolq.jsonl"}}}, f)
    with open(os.path.join(FIXTURES, "boolq.jsonl")) as f:
        good = f.read().splitlines(keepends=True)
    data = tasks / "boolq.jsonl"
    if case == "empty":
        data.write_text("")
    elif case == "not JSON":
        data.write_text(good[0] + '{"question": "is it cut off\n' + "".join(good[1:]))
    elif case == "not an object":
        data.write_text(good[0] + "[1, 2]\n")
    proc = run_python(["-m", "eval.downstream", trained_runs["sa"], "--include_path", tasks,
                       "--no_default_tasks", "--device", "cpu", "--out", tmp_path / "out"], env=offline_env(tmp_path))
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "evaluating" not in proc.stdout, proc.stderr[-3000:]
    reason = {"missing": ": no such file", "empty": ": empty", "not JSON": ", line 2: not valid JSON",
              "not an object": ", line 2: a JSON list, not an object"}[case]
    assert lines[0].startswith(f"{data}{reason}") and "task boolq" in lines[0]


@pytest.mark.slow
def test_an_unknown_task_is_refused_before_any_model_loads(trained_runs, fixture_tasks, tmp_path):
    proc = run_in_process(["-m", "eval.downstream", trained_runs["sa"], "--tasks", "boolq,hellaswa",
                       "--include_path", fixture_tasks, "--no_default_tasks", "--device", "cpu", "--out", tmp_path])
    assert proc.returncode == 2 and "evaluating" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"error: unknown task hellaswa: --include_path {fixture_tasks} does not define it; close: hellaswag")


@pytest.mark.slow
def test_the_paper_tasks_are_indexed_from_their_folders_as_lm_evals_whole_index_has_them(tmp_path):
    """The paper's tasks are found in their folders alone, each the YAML lm-eval's whole index gives its name;
    any other name gets the whole index; a task of include_path takes the place of lm-eval's of its name."""
    from eval.downstream import task_manager_for
    paper = task_manager_for(list(TASKS), None, include_defaults=True)
    whole = task_manager_for(["arc_easy", "arc_challenge"], None, include_defaults=True)  # not a paper task
    assert len(paper.all_tasks) < 100 < len(whole.all_tasks)
    for name in TASKS:
        assert paper.task_index[name].yaml_path == whole.task_index[name].yaml_path, name
    (tmp_path / "boolq.yaml").write_text(yaml.safe_dump({"include": str(paper.task_index["boolq"].yaml_path),
                                                         "task": "boolq"}))
    mine = task_manager_for(["boolq", "piqa"], str(tmp_path), include_defaults=True)
    assert mine.task_index["boolq"].yaml_path.parent == tmp_path and "piqa" in mine.task_index
    assert len(mine.all_tasks) < 100


# -----------------------------------------------------------------------------
# lm-eval's own hf backend on the Hugging Face export (scripts/export_hf.py)

@pytest.fixture(scope="module")
def exported_sa(trained_runs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "hf_sa"
    result = run_in_process(["-m", "scripts.export_hf", trained_runs["sa"], folder])
    assert result.status == 0, result.stderr[-3000:]
    return str(folder)


@pytest.mark.slow
def test_lm_evals_hf_backend_on_the_export_scores_as_the_adapter_on_the_checkpoint(
        exported_sa, sa_model, requests_and_expected, fixture_tasks, downstream_report):
    """The same log-likelihoods request by request (within and past the 32-token window, and the greedy
    flag), and the same accuracy on the eight fixture tasks, as eval/downstream.py on the checkpoint."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    hf = HFLM(pretrained=exported_sa, trust_remote_code=True, device="cpu", dtype="float32", batch_size=4)
    assert hf.max_length == sa_model.config.block_size  # from the export's config
    requests, expected = requests_and_expected
    ours = make_adapter_class()(sa_model, "cpu", "float32", batch_size=4)._loglikelihood_tokens(requests)
    theirs = hf._loglikelihood_tokens(requests)
    for (logprob, greedy), (want, want_greedy), (brute, _) in zip(theirs, ours, expected):
        assert logprob == pytest.approx(want, rel=1e-4, abs=1e-4) and logprob == pytest.approx(brute, rel=1e-4, abs=1e-4)
        assert greedy == want_greedy
    results = simple_evaluate(model=hf, tasks=list(TASKS), task_manager=TaskManager(include_path=fixture_tasks,
                                                                                     include_defaults=False),
                              bootstrap_iters=0)["results"]
    report, _, _ = downstream_report
    for task, (column, metric) in TASKS.items():
        assert 100 * results[task][f"{metric},none"] == pytest.approx(report["table"]["SA"][column], abs=1e-9), task
