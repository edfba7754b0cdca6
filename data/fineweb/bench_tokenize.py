"""
Tokenization throughput: prepare.py's parallel path (a pool of --num_proc workers running its
tokenize_batch over batches of documents) against a plain single-process encode_ordinary loop,
on the same documents.

    python -m data.fineweb.bench_tokenize                                  # the test corpus (six plays)
    python -m data.fineweb.bench_tokenize --input 'sample/100BT/000_00000.parquet' --repeat 1

Texts are split at paragraph breaks into documents of about --doc_chars characters, so a
play resembles a run of FineWeb documents (a few KB each).
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m data.fineweb.bench_tokenize", file=sys.stderr)
    sys.exit(2)

import argparse
import os
import resource
import time
from multiprocessing import Pool

import tiktoken

from data.fineweb.paragraphs import split_into_documents
from data.fineweb.prepare import (DOCS_PER_BATCH, TOKENIZER, batched, expand_inputs, imap_ordered, iter_local_documents,
                                  tokenize_batch)
from pretrain.runtime import REPO

TEST_CORPUS = os.path.join(REPO, "tests", "fixtures", "corpus", "*.txt")


def load_documents(patterns, doc_chars, repeat):
    texts = iter_local_documents(expand_inputs(patterns), 0)
    docs = [doc for text in texts for doc in split_into_documents(text, doc_chars)]
    return docs * repeat


def plain_tokens(docs):
    enc = tiktoken.get_encoding(TOKENIZER)
    return sum(len(enc.encode_ordinary(doc)) for doc in docs)


def parallel_tokens(docs, num_proc):
    """prepare.py's pipeline minus the shard writing; EOTs are not counted, as in plain_tokens."""
    pool = Pool(num_proc)
    results = imap_ordered(pool, tokenize_batch, batched(docs, DOCS_PER_BATCH), max_in_flight=4 * num_proc)
    n = sum(len(tokens) - len(doc_lengths) for tokens, doc_lengths in results)
    pool.close()
    pool.join()  # reaped workers' CPU time shows in RUSAGE_CHILDREN
    return n


def cpu_seconds():
    """CPU time of this process and its reaped children: unlike wall time, not inflated by other jobs."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def timed(fn, *args):
    """fn's result, wall seconds and CPU seconds."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    result = fn(*args)
    return result, time.perf_counter() - t0, cpu_seconds() - c0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[TEST_CORPUS], help="files or globs, as for prepare.py")
    parser.add_argument("--doc_chars", type=int, default=3000, help="split texts into documents of about this size")
    parser.add_argument("--repeat", type=int, default=2, help="repeat the documents this many times, for a longer run")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count(), help="worker processes of the parallel path")
    parser.add_argument("--trials", type=int, default=5, help="report the fastest of this many runs of each")
    args = parser.parse_args()

    docs = load_documents(args.input, args.doc_chars, args.repeat)
    tiktoken.get_encoding(TOKENIZER)  # load the BPE outside the timings (the forked workers inherit it)
    # interleaved trials, keeping the fastest of each: other jobs on a shared machine only slow a run down
    plain_runs, parallel_runs = [], []
    for _ in range(args.trials):
        plain_runs.append(timed(plain_tokens, docs))
        parallel_runs.append(timed(parallel_tokens, docs, args.num_proc))
    n_plain, t_plain, cpu_plain = min(plain_runs, key=lambda run: run[1])
    n_parallel, t_parallel, cpu_parallel = min(parallel_runs, key=lambda run: run[1])
    assert n_parallel == n_plain, f"the two paths disagree: {n_parallel} vs {n_plain} tokens"

    print(f"{len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f}M characters, {n_plain:,} tokens; "
          f"{os.cpu_count()} CPUs; best of {args.trials}")
    plain, parallel = n_plain / t_plain, n_plain / t_parallel
    print(f"plain encode_ordinary loop, 1 process: {plain:12,.0f} tokens/s  ({plain:,.0f} per core; "
          f"{n_plain / cpu_plain:,.0f} per CPU-second)")
    print(f"prepare.py pipeline, {args.num_proc} workers:      {parallel:12,.0f} tokens/s  "
          f"({parallel / args.num_proc:,.0f} per core; {n_plain / cpu_parallel:,.0f} per CPU-second, main process included)")
    print(f"ratio parallel / plain: {parallel / plain:.2f}x")


if __name__ == "__main__":
    main()
