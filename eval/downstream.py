"""
Zero-shot downstream evaluation of checkpoints on the paper's 8 tasks, with
lm-evaluation-harness (`pip install "lm-eval>=0.4.13"`) as the scoring engine.

One checkpoint (a file, or a run directory: its newest checkpoint):
    python -m eval.downstream out/xsa_0p7b
SA against XSA, with the per-task difference and the paper's Table 2 beside ours:
    python -m eval.downstream --sa out/sa_0p7b --xsa out/xsa_0p7b --paper
A quick look on a subset of each task:
    python -m eval.downstream out/sa_tiny out/xsa_tiny --labels SA XSA --limit 200
Without the Hub, on local copies of the tasks (docs/evaluation.md, "Without the Hub"):
    python -m eval.downstream out/sa_tiny --include_path my_tasks/ --no_default_tasks

The table has the paper's layout: one headline metric per task (acc or acc_norm, as the
paper says), in percent. Everything lm-eval reports (both metrics, standard errors) goes to
the JSON file next to the markdown table in --out.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.downstream", file=sys.stderr)
    sys.exit(2)

import contextlib
import difflib
import glob
import io
import json
import math
import os
import re
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from configurator import ConfigError
from eval import common
from pretrain import checkpointer, exits
from pretrain.runtime import autocast
from pretrain.train_config import PAPER_TASKS

# the paper's tasks (train_config.PAPER_TASKS: arc_easy, boolq, hellaswag, lambada_openai, openbookqa, piqa,
# social_iqa, winogrande) -> (column, headline metric), in the paper's column order
TASKS = dict(zip(PAPER_TASKS, (("ARC-E", "acc_norm"), ("BoolQ", "acc"), ("HSwag", "acc_norm"), ("LAMBADA", "acc"),
                               ("OBQA", "acc_norm"), ("PIQA", "acc_norm"), ("SIQA", "acc"), ("WinoG", "acc")),
                 strict=True))

# where lm-eval (0.4.13) defines each of the paper's tasks, under lm_eval/tasks: indexing these folders alone takes a
# hundredth of a second, lm-eval's whole index (~15,000 tasks) ten seconds on a CPU core
PAPER_TASK_YAMLS = dict(zip(PAPER_TASKS, ("arc/arc_easy.yaml", "super_glue/boolq/default.yaml",
                                          "hellaswag/hellaswag.yaml", "lambada/lambada_openai.yaml",
                                          "openbookqa/openbookqa.yaml", "piqa/piqa.yaml", "siqa/siqa.yaml",
                                          "winogrande/default.yaml"), strict=True))

# the paper's Table 2 (docs/paper.md), in percent, columns in the order of TASKS then avg
PAPER_TABLE2 = {
    "paper 0.7B SA": [51.26, 61.07, 55.68, 52.82, 35.00, 74.05, 40.02, 55.88, 53.22],
    "paper 0.7B XSA": [52.69, 61.19, 56.29, 54.07, 32.20, 73.78, 41.45, 56.20, 53.48],
    "paper 1.3B SA": [56.19, 65.47, 60.69, 56.24, 34.60, 75.90, 41.40, 58.80, 56.16],
    "paper 1.3B XSA": [58.84, 62.29, 62.41, 58.57, 36.00, 76.61, 42.84, 59.98, 57.19],
    "paper 2.7B SA": [58.59, 60.98, 66.20, 60.18, 37.00, 76.61, 42.94, 61.96, 58.06],
    "paper 2.7B XSA": [60.65, 64.86, 67.40, 62.04, 38.40, 77.80, 41.45, 62.75, 59.42],
}

GPT2_VOCAB = 50257  # the model's vocabulary is padded to 50304; the extra logits are never real tokens


def make_adapter_class():
    """The lm-eval adapter, built on first use so that lm-eval stays an optional dependency."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import Collator
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class GPTAdapter(TemplateLM):
        """Our GPT with tiktoken's gpt2 encoding, as lm-eval's scoring engine sees a model."""

        def __init__(self, model, device="cpu", dtype="float32", batch_size=16, quiet=True, rank=0, world_size=1):
            super().__init__()
            self.model, self.batch_size, self.dtype, self.quiet = model, int(batch_size), dtype, quiet
            # under torchrun (train.py's in-loop evaluation): this process's share of the batches, whose
            # results it gathers; lm-eval itself sees a process of its own (rank 0 of 1)
            self.process, self.processes = rank, world_size
            self.forward_tokens = 0  # positions run through the model, padding included (scripts/bench.py)
            self._device = torch.device(device)
            self.device_type = self._device.type
            self.enc = common.gpt2_encoding()
            self.max_length = model.config.block_size

        @property
        def eot_token_id(self):
            return self.enc.eot_token  # 50256, also the prefix of every training document

        @property
        def tokenizer_name(self):
            return "tiktoken-gpt2"

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return self.enc.encode_ordinary(string)  # as the training shards were tokenized

        def tok_decode(self, tokens):
            return self.enc.decode(tokens)

        def loglikelihood(self, requests, disable_tqdm=False):
            # lm-eval's own bar (tokenizing) follows --quiet too
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not common.bars_shown(self.quiet))

        @torch.no_grad()
        def log_probs(self, idx):
            """Log-probabilities over the real vocabulary, (B, T, 50257) float32."""
            self.forward_tokens += idx.numel()
            with autocast(self.device_type, self.dtype):
                logits, _ = self.model(idx)
            return F.log_softmax(logits[..., :GPT2_VOCAB].float(), dim=-1)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            """requests: ((context, continuation), context tokens, continuation tokens).
            Returns (sum of the continuation's log-probs, whether greedy decoding produces it).
            With several processes, process r scores batches r, r + W, ... of the same batching as one
            process (each request's numbers are those of one process, bit for bit) and the results are
            gathered; every process runs the same number of forwards (FSDP's forward is collective)."""
            # longest first, so the first batch shows whether memory suffices
            collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
            chunks = list(collator.get_batched(n=self.batch_size))
            rounds = math.ceil(len(chunks) / self.processes)
            scored = torch.full((rounds, self.batch_size, 2), math.nan, dtype=torch.float64)  # log-prob, greedy
            for i in common.progress(range(rounds), self.quiet or disable_tqdm, desc="log-likelihoods", unit="batch"):
                index = i * self.processes + self.process
                if index >= len(chunks):  # this process has run out of batches: a forward all the same
                    self.log_probs(torch.full((1, 1), self.eot_token_id, device=self._device))
                    continue
                for j, (logprob, greedy) in enumerate(self.score_batch(chunks[index])):
                    scored[i, j] = torch.tensor([logprob, greedy])
            if self.processes > 1:
                gathered = [torch.empty_like(scored, device=self._device) for _ in range(self.processes)]
                dist.all_gather(gathered, scored.to(self._device))
                scored = torch.stack(gathered, dim=1).flatten(0, 1).cpu()  # batch i * W + r at row i * W + r
            results = []
            for chunk, rows in zip(chunks, scored):
                for (request, _, _), (logprob, greedy) in zip(chunk, rows.tolist()):
                    results.append((logprob, bool(greedy)))
                    if request is not None:  # rolling windows have no request strings to cache
                        self.cache_hook.add_partial("loglikelihood", request, (logprob, bool(greedy)))
            return collator.get_original(results)

        def score_batch(self, chunk):
            """[(sum of the continuation's log-probs, greedy)] for one batch of requests, in one forward."""
            rows, cont_lens = [], []
            for _, context, continuation in chunk:
                assert 0 < len(continuation) <= self.max_length, "continuation longer than the context window"
                # the input is everything but the last token, cut from the left to fit the window
                rows.append((context + continuation)[-(self.max_length + 1):][:-1])
                cont_lens.append(len(continuation))
            width = max(len(r) for r in rows)
            # right padding: a causal model's logits at real positions never see the padding
            idx = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for i, r in enumerate(rows):
                idx[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            log_probs = self.log_probs(idx.to(self._device))
            results = []
            for i, ((_, _, continuation), row, n) in enumerate(zip(chunk, rows, cont_lens)):
                lp = log_probs[i, len(row) - n:len(row)]  # the positions that predict the continuation
                target = torch.tensor(continuation, dtype=torch.long, device=lp.device)
                results.append((lp.gather(-1, target[:, None]).double().sum().item(),
                                bool((lp.argmax(dim=-1) == target).all())))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            """Log-likelihood of whole documents (perplexity tasks): non-overlapping windows of
            block_size predictions, the first conditioned on the end-of-text token."""
            windows, owner = [], []
            for i, request in enumerate(requests):
                tokens = self.tok_encode(request.args[0])
                for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=tokens, prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                    windows.append((None, context, continuation))
                    owner.append(i)
            totals = [0.0] * len(requests)
            for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
                totals[i] += logprob
            for request, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm=False):
            """Greedy decoding, one request at a time, until a stop string, end-of-text or
            max_gen_toks. Simple rather than fast: none of the paper's tasks generate."""
            outputs = []
            for request in common.progress(requests, self.quiet or disable_tqdm, desc="generation", unit="request"):
                context, gen_kwargs = request.args
                until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                idx = torch.tensor([self.tok_encode(context) or [self.eot_token_id]], device=self._device)
                new_tokens, text = [], ""
                for _ in range(int(gen_kwargs.get("max_gen_toks", 256))):
                    next_id = self.log_probs(idx[:, -self.max_length:])[0, -1].argmax().item()
                    if next_id == self.eot_token_id:
                        break
                    new_tokens.append(next_id)
                    idx = torch.cat((idx, torch.tensor([[next_id]], device=self._device)), dim=1)
                    text = self.tok_decode(new_tokens)
                    if any(stop in text for stop in until):
                        break
                for stop in until:
                    text = text.split(stop)[0]
                outputs.append(text)
                self.cache_hook.add_partial("generate_until", request.args, text)
            return outputs

    return GPTAdapter


def evaluate_model(model, tasks, device, dtype, batch_size=16, limit=None, task_manager=None, bootstrap_iters=1000,
                   quiet=True, rank=0, world_size=1):
    """lm-eval's results for one model on device: {"results": {task: {metric: value}}, ...}.
    tasks: task names, or the Task objects load_tasks returns (their data loaded once for all models).
    rank, world_size: this process's place under torchrun, which scores its share of the requests."""
    adapter = make_adapter_class()(model, device, dtype, batch_size, quiet, rank, world_size)
    return score(adapter, tasks, limit, task_manager, bootstrap_iters)


def score(adapter, tasks, limit, task_manager, bootstrap_iters):
    """lm-eval's zero-shot evaluation of tasks through adapter (a GPTAdapter): its results, on the processes
    whose LOCAL_RANK is 0 (lm-eval's rule), else None."""
    from lm_eval import evaluator
    # simple_evaluate adds torch's environment report to its results (collect_env: `pip list`, nvidia-smi), a
    # second or more of subprocesses on every call, in-loop passes included; nothing here reads it
    add_env_info, evaluator.add_env_info = evaluator.add_env_info, lambda results: None
    try:
        return evaluator.simple_evaluate(model=adapter, tasks=list(tasks), num_fewshot=0, limit=limit,
                                         task_manager=task_manager, bootstrap_iters=bootstrap_iters,
                                         log_samples=False)
    finally:
        evaluator.add_env_info = add_env_info


def headline_metric(task, metric_names):
    """The name of a task's headline metric among metric_names (what it reports): the paper's for its 8 tasks
    (TASKS), else acc_norm where the task reports it, else acc; None where it reports none of these (a
    perplexity-only task)."""
    wanted = [TASKS[task][1]] if task in TASKS else ["acc_norm", "acc"]
    return next((metric for metric in wanted if metric in metric_names), None)


def headline(task, metrics):
    """(metric name, value as a fraction) of a task's headline metric in lm-eval's results (metrics: the task's
    entry, {"acc,none": ...}); KeyError naming the task where it reports no headline metric."""
    metric = headline_metric(task, {name.split(",")[0] for name in metrics})
    if metric is None:
        raise KeyError(f"task {task} reports no acc or acc_norm (it reports {', '.join(sorted(metrics))})")
    return metric, metrics[f"{metric},none"]


@contextlib.contextmanager
def rng_kept(device):
    """lm-eval seeds Python's, NumPy's and torch's generators on every call: a training run's must come out
    as they went in (evaluation never changes what a run trains on)."""
    import random

    import numpy
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def bars_dropped():
    """lm-eval draws a progress bar per task as it builds the requests, with no way to turn it off: in a training
    log they would be noise. What else it writes to stderr (a warning) passes through."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        for line in buffer.getvalue().replace("\r", "\n").splitlines():
            if line.strip() and not re.search(r"\d+%\|.*\|", line):
                print(line, file=sys.stderr)


class InLoopDownstream:
    """train.py's in-loop downstream evaluation (its downstream_* keys): the tasks indexed and their data
    loaded once, before step 1, so that a wrong name or unreadable data stops the run before it trains;
    then, at each evaluation, evaluate_model on the first `limit` examples of each task, the same ones
    every time, with the requests split across the processes. Its accuracy at a step is this script's
    with --limit on the checkpoint of that step, example for example."""

    def __init__(self, tasks, limit, include_path, runtime, block_size):
        """tasks: comma-separated lm-eval names (train_config refuses a repeated one). ConfigError for an unknown
        task, a missing lm-eval, a task with no accuracy to log or whose examples do not fit block_size
        (check_in_loop_tasks); data that cannot be read (no Hub, a broken local file) exits in one line with status 3
        (load_tasks). Under torchrun every process ends the same way: each one loads and checks the tasks."""
        try:
            import lm_eval.tasks  # noqa: F401
        except ImportError:
            raise ConfigError('downstream_interval > 0 needs lm-evaluation-harness: pip install "lm-eval>=0.4.13"') \
                from None
        self.names = tasks.replace(",", " ").split()
        self.limit = limit
        include_path = os.path.abspath(include_path) if include_path else None
        self.task_manager = task_manager_for(self.names, include_path, include_defaults=include_path is None)
        for name in self.names:
            if name not in self.task_manager.task_index:
                where = "downstream_include_path does not define it" if include_path else "lm-eval does not define it"
                raise ConfigError(include_path_problem(include_path) or unknown_task(name, self.task_manager, where))
        import datasets
        datasets.disable_progress_bars()  # its bars for preparing the tasks' data: noise in a training log
        if runtime.distributed and not runtime.is_main:
            dist.barrier()  # the main process fills the datasets cache, the others then read it
        try:
            with hub_bars_off():  # the Hub's download bars too, while the tasks load (and no longer)
                self.tasks = load_tasks(self.task_manager, self.names)
        finally:  # also when it fails: the others then fail on their own, instead of waiting here
            if runtime.distributed and runtime.is_main:
                dist.barrier()
        for task in self.tasks:  # zero-shot, as evaluate_model asks (lm-eval warns when it changes a task's setting)
            task.set_config(key="num_fewshot", value=0)
        check_in_loop_tasks(self.tasks, self.names, limit, block_size)

    def __call__(self, model, runtime, dtype, batch_size):
        """{"downstream/<task>": headline metric, a fraction; "downstream/avg": their mean}, on every process."""
        model.eval()
        adapter = make_adapter_class()(model, runtime.device, dtype, batch_size, True, runtime.rank,
                                       runtime.world_size)
        # eager: the requests' many lengths would recompile the blocks that FSDP runs compiled
        with rng_kept(runtime.device), bars_dropped(), torch.compiler.set_stance("force_eager"):
            results = score(adapter, self.tasks, self.limit, self.task_manager, bootstrap_iters=0)
        model.train()
        self.forward_tokens = adapter.forward_tokens  # this process's, for scripts/bench.py
        # lm-eval returns the results on the processes with LOCAL_RANK 0 only: the main one's, sent to all, with
        # whether it could read them (last), so that a failure there ends every process, not the main one alone
        scores = torch.full((len(self.names) + 1,), math.nan, dtype=torch.float64)
        problem = None
        if results:
            try:
                self.examples = sum(results["n-samples"][task]["effective"] for task in set(self.names))  # each once
                scores[:-1] = torch.tensor([headline(task, results["results"][task])[1] for task in self.names],
                                           dtype=torch.float64)
                scores[-1] = 0
            except Exception as e:
                problem = e
        scores = scores.to(runtime.device)
        if runtime.distributed:
            dist.broadcast(scores, src=0)
        if problem is not None:
            raise problem
        if scores[-1].item() != 0:
            raise RuntimeError("the main process could not read lm-eval's results (its error says why)")
        scores = scores[:-1]
        record = {f"downstream/{task}": value for task, value in zip(self.names, scores.tolist())}
        return dict(record, **{"downstream/avg": scores.mean().item()})


def check_in_loop_tasks(tasks, names, limit, block_size):
    """ConfigError unless every task can be scored in the loop: it scores log-likelihoods (multiple choice, or a
    loglikelihood task like LAMBADA), it reports a headline accuracy (acc or acc_norm, as the paper's 8 do: a
    perplexity-only task has none) and every continuation of its first `limit` examples fits block_size
    tokens (a context is cut from the left to fit; a continuation is scored whole)."""
    adapter = make_adapter_class()(SimpleNamespace(config=SimpleNamespace(block_size=block_size)))
    for name, task in zip(names, tasks):
        if task.OUTPUT_TYPE not in ("loglikelihood", "multiple_choice"):
            raise ConfigError(f"task {name} is a {task.OUTPUT_TYPE} task: the in-loop evaluation logs the accuracy "
                              f"of loglikelihood and multiple_choice tasks; drop it from downstream_tasks")
        metrics = sorted(task.higher_is_better())
        if headline_metric(name, metrics) is None:
            wanted = TASKS[name][1] if name in TASKS else "acc or acc_norm"
            raise ConfigError(f"task {name} reports no {wanted} (its metrics: {', '.join(metrics) or 'none'}): the "
                              f"in-loop evaluation logs one accuracy per task; drop it from downstream_tasks")
        with bars_dropped():
            task.build_all_requests(limit=limit)
        longest = max((len(continuation_tokens(adapter, *instance.args)) for instance in task.instances), default=0)
        if longest > block_size:
            raise ConfigError(f"task {name} has a continuation of {longest} tokens in its first {limit} examples, "
                              f"longer than block_size {block_size}: a continuation is scored whole; raise "
                              f"block_size or drop {name} from downstream_tasks")


def continuation_tokens(adapter, context, continuation):
    """The tokens of a request's continuation as lm-eval's TemplateLM.loglikelihood makes them for adapter."""
    if context == "":
        tokens = adapter.tok_encode(continuation)
        return tokens[1:] if tokens[:1] == [adapter.prefix_token_id] else tokens
    return adapter._encode_pair(context, continuation)[1]


# -----------------------------------------------------------------------------
# the tasks and their data, checked before any model is loaded


LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' loaders of local files
NO_HUB_HINT = "without Hub access, evaluate local copies of the tasks (docs/evaluation.md, \"Without the Hub\")"


def task_manager_for(names, include_path, include_defaults):
    """lm-eval's TaskManager for the tasks names (None: whatever include_path defines), indexing include_path
    (absolute) and, with include_defaults, lm-eval's own tasks: only the paper's tasks' folders where names are
    among them and each is found there, else the whole index (other names, and the close names suggested for
    a wrong one). include_path comes last either way, so its tasks take the place of lm-eval's of their name."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager
    extra = [include_path] if include_path else []
    if include_defaults and names and set(names) <= set(PAPER_TASK_YAMLS):
        installed = os.path.dirname(lm_eval.tasks.__file__)
        folders = sorted({os.path.join(installed, os.path.dirname(p)) for p in PAPER_TASK_YAMLS.values()})
        manager = TaskManager(include_path=folders + extra, include_defaults=False)
        if all(name in manager.task_index for name in names):
            return manager
    return TaskManager(include_path=extra or None, include_defaults=include_defaults)


def asked_tasks(args):
    """--tasks, or by default the paper's 8 tasks; None with --no_default_tasks and no --tasks: those that
    --include_path defines (task_names)."""
    if args.tasks:
        return args.tasks.replace(",", " ").split()
    return None if args.no_default_tasks else list(TASKS)


def task_names(parser, args, task_manager):
    """asked_tasks; with --no_default_tasks and no --tasks, those of the paper's 8 that --include_path defines
    (every task there if it defines none of them)."""
    names = asked_tasks(args)
    if names is None:
        names = [t for t in TASKS if t in task_manager.task_index] or task_manager.all_subtasks
    if not names:
        parser.error(f"--include_path {args.include_path} defines no task")
    for name in names:
        if name not in task_manager.task_index:
            where = f"--include_path {args.include_path} does not define it" if args.no_default_tasks else \
                "lm-eval and --include_path do not define it"
            problem = include_path_problem(args.include_path)
            parser.error((problem.replace("downstream_include_path", "--include_path") if problem else None)
                         or unknown_task(name, task_manager, where))
    return names


@contextlib.contextmanager
def hub_bars_off():
    """huggingface_hub's progress bars off inside, as they were after (a global setting of the process)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            enable_progress_bars()


def include_path_problem(include_path):
    """Why a folder of task YAMLs may not define a task it was meant to, in one line, or None: it holds no YAML
    file, or one that does not parse (lm-eval skips such a file, so its task reads as unknown)."""
    if not include_path:
        return None
    import yaml

    class AnyTags(yaml.SafeLoader):  # lm-eval's YAMLs tag functions (!function utils.process_docs)
        pass
    AnyTags.add_multi_constructor("", lambda loader, suffix, node: None)
    files = sorted(glob.glob(os.path.join(include_path, "**", "*.yaml"), recursive=True))
    if not files:
        return f"downstream_include_path {shown(include_path)} defines no task: it holds no .yaml file"
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                yaml.load(f, Loader=AnyTags)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            return f"task file {shown(path)} cannot be read ({exits.one_line(e)}): lm-eval skips it"
    return None


def unknown_task(name, task_manager, where):
    """The one line for a task name that task_manager does not know, with the close names it does."""
    close = difflib.get_close_matches(name, task_manager.all_tasks, n=3)
    return f"unknown task {name}: {where}" + (f"; close: {', '.join(close)}" if close else "")


def task_config(entry):
    """The merged YAML config of one task from lm-eval's index, or {} for a group, a tag or a task
    defined in Python."""
    config = entry.cfg or {}
    return config if entry.yaml_path and isinstance(config.get("task"), str) else {}


def data_files(entry):
    """The local files a task's YAML reads (dataset_kwargs.data_files: a path, a list, or one per
    split), relative ones joined to the YAML's folder."""
    files = (task_config(entry).get("dataset_kwargs") or {}).get("data_files") or []
    files = list(files.values()) if isinstance(files, dict) else files
    flat = [f for group in (files if isinstance(files, list) else [files])
            for f in (group if isinstance(group, list) else [group])]
    return sorted({os.path.join(entry.yaml_path.parent, f) for f in flat})


def shown(path):
    """path as the user would type it: relative to the working directory when under it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def check_data_file(pattern, task, yaml_path):
    """Exit with one line naming the file if a task's data file is missing, empty or, for JSON, not
    one JSON document or one JSON object per line: datasets would end in StopIteration without a name."""
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    whose = f"a data file of task {task} ({shown(str(yaml_path))})"
    for path in map(shown, paths):
        if not os.path.isfile(path):
            exits.fail(f"{path}: no such file, {whose}; data_files are read from the YAML's folder")
        json_file = path.endswith((".json", ".jsonl"))
        if os.path.getsize(path) == 0:
            exits.fail(f"{path}: empty, {whose}; it needs the task's examples"
                       + (", one JSON object per line" if json_file else ""))
        if not json_file:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            json.loads(text)  # one JSON document (a list of examples) is data too
            continue
        except UnicodeDecodeError as e:
            exits.fail(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}), {whose}")
        except ValueError:
            pass
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except ValueError as e:
                exits.fail(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno}), {whose}; "
                           f"it needs one JSON object per line")
            if not isinstance(example, dict):
                exits.fail(f"{path}, line {number}: a JSON {type(example).__name__}, not an object, {whose}; "
                           f"it needs one JSON object per line")


def hub_dataset(entry):
    """The Hub dataset a task reads, or None for local files (or a group of tasks)."""
    path = task_config(entry).get("dataset_path")
    return None if not path or path in LOCAL_LOADERS or os.path.exists(path) else path


def check_task_hub(repo_id, task):
    """Exit at once when the Hub cannot be read (exits.hub_problem). In offline mode datasets reads
    its local cache and makes no request: nothing to check."""
    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in offline):
        return
    problem = exits.hub_problem(repo_id)
    if problem:
        exits.fail(f"cannot read {repo_id} (the data of task {task}) from the Hugging Face Hub ({problem}); "
                   f"with the data in the local cache, set HF_DATASETS_OFFLINE=1; {NO_HUB_HINT}")


@contextlib.contextmanager
def working_dir(path):
    """datasets reads relative data_files from the working directory: make it the YAML's folder."""
    cwd = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(cwd)


def root_cause(e):
    """The innermost exception of a chain: datasets wraps the one that says what is wrong."""
    while e.__cause__ or e.__context__:
        e = e.__cause__ or e.__context__
    return e


def load_tasks(task_manager, names):
    """lm-eval Task objects with their data loaded, or exit with one line naming the task that failed
    and why. Data files are checked first; a task's relative data_files are read from its YAML's folder."""
    entries = {name: task_manager.task_index[name] for name in names}
    for name, entry in entries.items():
        for pattern in data_files(entry):
            check_data_file(pattern, name, entry.yaml_path)
    hub = {name: hub_dataset(entry) for name, entry in entries.items() if hub_dataset(entry)}
    if hub:
        name, repo_id = next(iter(hub.items()))
        check_task_hub(repo_id, name)
    tasks = []
    for name, entry in entries.items():
        folder = entry.yaml_path.parent if data_files(entry) else os.getcwd()
        try:
            with working_dir(folder):
                tasks += task_manager.load([name])["tasks"].values()
        except Exception as e:
            cause = root_cause(e)
            reason = exits.one_line(e) + (f"; {exits.one_line(cause)}" if cause is not e else "")
            if name in hub:
                exits.fail(f"cannot load task {name}, {hub[name]} from the Hub ({reason}); offline, its data must be "
                           f"in the local cache (a run with Hub access puts it there); {NO_HUB_HINT}")
            where = shown(str(entry.yaml_path)) if entry.yaml_path else "lm-eval"
            exits.fail(f"cannot load task {name} ({where}): {reason}")
    return tasks


def column(task):
    """A task's column in the table: the paper's name for its 8 tasks, else the task's own."""
    return TASKS[task][0] if task in TASKS else task


def headline_row(results):
    """{column: headline metric in percent} for the tasks in lm-eval's results that report one (a perplexity-only
    task has none), plus "avg" when the paper's 8 are all there (the paper's avg is the plain mean of its 8
    columns)."""
    row = {}
    for task in [t for t in TASKS if t in results] + [t for t in results if t not in TASKS]:  # the paper's first
        metrics = results[task]
        metric = headline_metric(task, {name.split(",")[0] for name in metrics})
        if metric is not None and f"{metric},none" in metrics:
            row[column(task)] = 100 * metrics[f"{metric},none"]
    paper = [row[c] for c, _ in TASKS.values() if c in row]
    if len(paper) == len(TASKS):
        row["avg"] = sum(paper) / len(paper)
    return row


def table_columns(names, paper=False):
    """The table's columns for the tasks asked for (names): the paper's among them in its order (all 8 with
    paper, the paper's rows beside ours), then the others in the order asked, then avg (the paper's 8)."""
    columns = [c for task, (c, _) in TASKS.items() if paper or task in names]
    columns += [column(task) for task in dict.fromkeys(names) if task not in TASKS]
    return columns + (["avg"] if paper or all(task in names for task in TASKS) else [])


def format_table(rows, columns):
    """rows: {label: {column: percent}} -> a markdown table with these columns (table_columns)."""
    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, row in rows.items():
        cells = [f"{row[c]:+.2f}" if label.startswith("delta") and c in row else
                 f"{row[c]:.2f}" if c in row else "-" for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = common.make_parser(__doc__, checkpoints="*", out="downstream.json and downstream.md", progress=True)
    parser.add_argument("--sa", help="SA checkpoint; with --xsa, the table adds the row XSA - SA")
    parser.add_argument("--xsa", help="XSA checkpoint")
    parser.add_argument("--tasks", default=None,
                        help="lm-eval task names, space or comma separated; default: the paper's 8 (with "
                             "--no_default_tasks: those of them that --include_path defines)")
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task (a fraction if < 1); for quick looks only")
    parser.add_argument("--batch_size", type=common.positive_int, default=16, help="sequences per forward pass")
    parser.add_argument("--include_path", default=None,
                        help="an extra directory of lm-eval task YAMLs; their relative data_files are read "
                             "from each YAML's folder")
    parser.add_argument("--no_default_tasks", action="store_true",
                        help="index only --include_path, not lm-eval's built-in tasks (faster; local task copies)")
    parser.add_argument("--bootstrap_iters", type=int, default=1000,
                        help="bootstrap samples for the standard errors of non-mean metrics (LAMBADA perplexity)")
    parser.add_argument("--paper", action="store_true", help="also show the paper's Table 2 rows")
    args = parser.parse_args()

    if args.sa or args.xsa:
        if not (args.sa and args.xsa) or args.checkpoints:
            parser.error("give both --sa and --xsa, and no positional checkpoints")
        models = common.label_checkpoints(parser, [args.sa, args.xsa], ["SA", "XSA"])
    else:
        if not args.checkpoints:
            parser.error("give at least one checkpoint, or --sa and --xsa")
        models = common.label_checkpoints(parser, args.checkpoints, args.labels)
    if args.no_default_tasks and not args.include_path:
        parser.error("--no_default_tasks needs --include_path")
    if args.include_path and not os.path.isdir(args.include_path):
        parser.error(f"--include_path {args.include_path}: no such directory")
    device, dtype = common.device_and_dtype(parser, args)
    out = common.output_dir(args.out)
    common.gpt2_encoding_or_exit()  # the adapter's tokenizer, before the tasks and models load

    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        exits.fail('eval/downstream.py needs lm-evaluation-harness: pip install "lm-eval>=0.4.13"')
    # absolute, so that the task files are found while a task's data loads from its YAML's folder
    include_path = os.path.abspath(args.include_path) if args.include_path else None
    task_manager = task_manager_for(asked_tasks(args), include_path, include_defaults=not args.no_default_tasks)
    names = task_names(parser, args, task_manager)
    if not common.bars_shown(args.quiet):
        import datasets
        datasets.disable_progress_bars()  # its bars for preparing the tasks' data
    tasks = load_tasks(task_manager, names)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit

    report, rows = {}, {}
    for label, path in models.items():
        print(f"evaluating {label}: {path}", flush=True)
        model, _ = checkpointer.load_model_or_exit(path, device)
        results = evaluate_model(model, tasks, device, dtype, args.batch_size, limit, task_manager,
                                 args.bootstrap_iters, args.quiet)
        model.to("cpu")  # free the accelerator for the next checkpoint
        rows[label] = headline_row(results["results"])
        report[label] = {"checkpoint": path, "headline": rows[label], "results": results["results"],
                         "n_samples": results.get("n-samples"), "versions": results.get("versions")}
    if len(rows) == 2:
        (a, row_a), (b, row_b) = rows.items()
        rows[f"delta {b} - {a}"] = {c: row_b[c] - row_a[c] for c in row_b if c in row_a}
    shown = dict(rows)
    if args.paper:
        columns = [c for c, _ in TASKS.values()] + ["avg"]
        shown.update({label: dict(zip(columns, values)) for label, values in PAPER_TABLE2.items()})
    table = format_table(shown, table_columns(names, args.paper))
    print(table)

    path = common.write_text(out, "downstream.json", json.dumps(
        {"tasks": names, "limit": limit, "models": report, "table": rows}, indent=2, default=str))
    limited = f"; limit {limit} examples per task" if limit else ""
    common.write_text(out, "downstream.md", f"Zero-shot, lm-evaluation-harness; headline metric per task as in the "
                                            f"paper, in percent{limited}.\n\n{table}\n")
    print(f"wrote {path} and downstream.md")


if __name__ == "__main__":
    main()
