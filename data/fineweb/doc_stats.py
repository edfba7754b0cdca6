"""
Document-length statistics of a directory of token shards: how long the documents are, and what share
of the tokens sits in documents longer than a window, i.e. how much of a long training window a single
document fills (how far a document mask differs from the causal one).

A document is an EOT token (50256, which starts every document) and the tokens after it, up to the next
EOT or the end of the data, across shard boundaries. Its length counts that leading EOT: a document is
len(encode_ordinary(text)) + 1 tokens, its share of the token stream. It belongs to the split (val or
train) of the shard its EOT is in, with all of its tokens, those that run on into the next split too.

The shards are read again, in stream order and a chunk at a time, and only a count of documents per
length is kept: memory stays flat however many tokens there are, and the statistics hold every document
in the directory, whichever runs wrote it (prepare.py resumes interrupted runs).
"""

import collections
import json
import os

import numpy as np

from pretrain import shards
from pretrain.files import write_atomically

EOT = 50256
STATS_FILE = "doc_lengths.json"
LONGER_THAN = (512, 1024, 2048, 4096, 8192, 16384)
CHUNK_TOKENS = 1 << 24  # 32 MB of tokens per read: a 100M-token shard is never in memory whole
CONVENTION = ("a document is an EOT token and the tokens up to the next EOT or the end of the data; its length "
              "counts that EOT; it belongs to the split of the shard its EOT is in; pXX is the smallest length "
              "that at least XX% of the documents do not exceed, the median p50 (nearest rank, numpy's "
              "'inverted_cdf'); token_share_longer_than[L] is the share of the split's tokens that are in "
              "documents of more than L tokens")


def split_of(path):
    return "val" if "_val_" in os.path.basename(path) else "train"


def count_lengths(paths, eot=EOT):
    """{split: Counter(document length -> number of documents)} over the shards at `paths`, in the
    order given (the token stream's). The document in progress at the end of a chunk is carried over
    to the next chunk, and the next shard."""
    counts = {split_of(path): collections.Counter() for path in paths}
    open_split, open_length = None, 0  # the document whose end is not yet seen, and its tokens so far
    for path in paths:
        split, tokens = split_of(path), shards.read_shard(path)
        for start in range(0, len(tokens), CHUNK_TOKENS):
            chunk = tokens[start:start + CHUNK_TOKENS]
            starts = np.flatnonzero(chunk == eot)
            open_split = open_split or split  # data that does not start with an EOT starts with a document
            if not len(starts):
                open_length += len(chunk)
                continue
            if open_length + starts[0]:  # zero only at an EOT that starts the data
                counts[open_split][int(open_length + starts[0])] += 1
            lengths, n = np.unique(np.diff(starts), return_counts=True)
            counts[split].update(dict(zip(lengths.tolist(), n.tolist())))
            open_split, open_length = split, len(chunk) - int(starts[-1])
    if open_length:
        counts[open_split][open_length] += 1
    return counts


def nearest_rank(lengths, ranks, percent):
    """The smallest length that at least `percent`% of the documents do not exceed; ranks[i] is the
    number of documents of length <= lengths[i]. In integers: in floats, 0.07 * 100 is 7.000000000000001."""
    rank = max(1, -(-percent * int(ranks[-1]) // 100))  # ceil(percent% of the documents)
    return int(lengths[np.searchsorted(ranks, rank)])


def summarize(counts):
    """Count, mean, median, p90, p99, max and the token shares longer than each of LONGER_THAN, of a
    Counter(document length -> number of documents); None for what an empty split does not have."""
    lengths = np.array(sorted(counts), dtype=np.int64)
    n = np.array([counts[length] for length in lengths], dtype=np.int64)
    documents, tokens = int(n.sum()), int((lengths * n).sum())
    if not documents:
        return {"documents": 0, "tokens": 0, "mean": None, "median": None, "p90": None, "p99": None,
                "max": None, "token_share_longer_than": {str(limit): None for limit in LONGER_THAN}}
    ranks = np.cumsum(n)
    in_longer = {str(limit): int((lengths * n)[lengths > limit].sum()) / tokens for limit in LONGER_THAN}
    return {"documents": documents, "tokens": tokens, "mean": tokens / documents,
            "median": nearest_rank(lengths, ranks, 50), "p90": nearest_rank(lengths, ranks, 90),
            "p99": nearest_rank(lengths, ranks, 99), "max": int(lengths[-1]), "token_share_longer_than": in_longer}


def document_statistics(paths, eot=EOT):
    """The statistics file's content for the shards at `paths` (in stream order): per split, and of
    all the documents together."""
    counts = count_lengths(paths, eot)
    counts["all"] = sum(counts.values(), collections.Counter())
    return {"convention": CONVENTION, "eot": eot, "shards": len(paths),
            "splits": {split: summarize(c) for split, c in counts.items()}}


def save(path, statistics):
    text = json.dumps(statistics, indent=1)
    write_atomically(path, lambda f: f.write(text.encode()))


def table(statistics):
    """A few lines for a terminal: one row per split."""
    limits = " ".join(f"{'>' + str(limit):>7}" for limit in LONGER_THAN)
    lines = ["document lengths, in tokens (each document counts its leading EOT), and the share of the tokens "
             "in documents longer than 512 ... 16384 tokens:",
             f"{'split':<6} {'documents':>12} {'mean':>9} {'median':>7} {'p90':>7} {'p99':>7} {'max':>9} {limits}"]
    for split, s in statistics["splits"].items():
        if not s["documents"]:
            lines.append(f"{split:<6} {0:>12}")
            continue
        shares = " ".join(f"{s['token_share_longer_than'][str(limit)]:>7.1%}" for limit in LONGER_THAN)
        lines.append(f"{split:<6} {s['documents']:>12,} {s['mean']:>9,.1f} {s['median']:>7,} {s['p90']:>7,} "
                     f"{s['p99']:>7,} {s['max']:>9,} {shares}")
    return "\n".join(lines)
