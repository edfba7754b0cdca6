"""
FineWeb (or any local text) -> GPT-2 token shards in the llm.c format (see pretrain/shards.py).

The documents are tokenized by a pool of worker processes, each document as
[50256] + encode_ordinary(text), and concatenated into one token stream that is cut into
shards: the first --val_tokens tokens go to fineweb_val_000000.bin, the rest to
fineweb_train_000001.bin, fineweb_train_000002.bin, ... of --shard_size tokens each (the last
one shorter). A document may straddle two shards, as in llm.c.

    python -m data.fineweb.prepare                                       # FineWeb sample-100BT from the Hub
    python -m data.fineweb.prepare --max_tokens 1_000_000_000             # the first 1B tokens only
    python -m data.fineweb.prepare --input 'sample/100BT/*.parquet'       # local parquet/jsonl/txt files
    python -m data.fineweb.prepare --verify --out_dir data/fineweb/fineweb100B

Resumable: out_dir/manifest.json records, for every shard written, where in the document
stream it starts and ends. Kill it at any moment and rerun it with the same arguments: it keeps
the shards it has, skips the documents they hold without tokenizing them again, and ends with
shards byte-identical to an uninterrupted run.

At the end it writes out_dir/doc_lengths.json, the document-length statistics of all the shards (count,
mean, median, p90, p99, and the share of the tokens in documents longer than 512 ... 16384 tokens; see
doc_stats.py), and prints them as a table.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m data.fineweb.prepare", file=sys.stderr)
    sys.exit(2)

import argparse
import collections
import errno
import glob
import json
import os
import signal
import time
from multiprocessing import Pool

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tiktoken
from tqdm import tqdm

from data.fineweb import doc_stats
from pretrain import exits, shards
from pretrain.files import DirectoryLock, DirectoryLocked, remove_temp_files, write_atomically

TOKENIZER = "gpt2"
EOT = 50256  # <|endoftext|>, the delimiter that starts every document
EOT_ARRAY = np.array([EOT], dtype=np.uint32)
DOCS_PER_BATCH = 256  # documents per worker task: ~200k tokens of FineWeb, enough to amortise the IPC
MANIFEST = "manifest.json"
LOCAL_FILES_INSTEAD = "tokenize local files instead: --input 'fineweb_parquet/*.parquet' (or .jsonl, .txt files)"

# -----------------------------------------------------------------------------
# documents in: a stream of texts, numbered from 0, that can start at any document index


def expand_inputs(patterns):
    """Input files in the order given (each glob sorted), so the document order is reproducible."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.isfile(m) for m in matches):
            exits.fail(f"--input {pattern!r}: no such file")
        files += [os.path.abspath(m) for m in matches]
    for path in files:
        if not path.endswith((".parquet", ".jsonl", ".txt")):
            exits.fail(f"--input {path}: unsupported file type (expected .parquet, .jsonl or .txt)",
                       exits.CONFIG_ERROR)
        if path.endswith(".parquet"):
            open_parquet(path)  # a file without `text` fails now, not after hours on the files before it
    return files


def open_parquet(path):
    """The parquet file, after checking that it has a string `text` column."""
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        exits.fail(f"{path}: not a readable parquet file ({e})")
    schema = pf.schema_arrow
    if "text" not in schema.names:
        exits.fail(f"{path}: no `text` column (its columns: {', '.join(schema.names)})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        exits.fail(f"{path}: the `text` column holds {kind}, not strings")
    return pf


def iter_parquet_texts(path, skip):
    """The `text` column, skipping whole row groups through the footer metadata when resuming."""
    pf = open_parquet(path)
    row = 0  # row number, in the file, of the next batch's first row
    for group in range(pf.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        if skip >= rows:
            skip -= rows
            row += rows
            continue
        for batch in pf.iter_batches(batch_size=1024, row_groups=[group], columns=["text"]):
            column = batch.column(0)
            if column.null_count:  # None would only fail later, in a worker, without the file's name
                first = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
                exits.fail(f"{path}: row {row + first} (counting from 0) has no text (null)")
            texts = column.to_pylist()
            yield from texts[skip:]
            skip = max(0, skip - len(texts))
            row += len(texts)


def open_text(path):
    """Text files are read with errors="surrogateescape", which keeps each byte that is not UTF-8 as
    a lone surrogate: reading never fails mid-stream, and check_utf8 can say where the byte was."""
    return open(path, encoding="utf-8", errors="surrogateescape")


def check_utf8(path, text, line=1):
    """Exit naming the file and line of the first byte of `text` that was not UTF-8."""
    if text.isascii():  # O(1) in CPython: pure ASCII text costs nothing
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        line += text.count("\n", 0, e.start)
        exits.fail(f"{path}, line {line}: not UTF-8 text (byte 0x{ord(text[e.start]) - 0xDC00:02x})")


def iter_jsonl_texts(path, skip):
    """The `text` field of each non-blank line; skipped lines are counted, not parsed."""
    with open_text(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if skip:
                skip -= 1
                continue
            check_utf8(path, line, line_number)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                exits.fail(f"{path}, line {line_number}: not valid JSON ({e.msg}, column {e.colno})")
            if not isinstance(row, dict) or "text" not in row:
                exits.fail(f"{path}, line {line_number}: no `text` field")
            if not isinstance(row["text"], str):
                exits.fail(f"{path}, line {line_number}: `text` is {type(row['text']).__name__}, not a string")
            yield row["text"]


def read_txt(path):
    with open_text(path) as f:
        text = f.read()
    check_utf8(path, text)
    return text


def count_documents(path):
    """Number of documents in a local file, cheaply (no text is decoded for parquet)."""
    if path.endswith(".parquet"):
        return open_parquet(path).metadata.num_rows
    if path.endswith(".jsonl"):
        with open_text(path) as f:
            return sum(1 for line in f if line.strip())
    return 1


def iter_local_documents(files, start):
    """Texts of local files from document index `start` on: parquet/jsonl rows, or a whole .txt file."""
    for path in files:
        if start and start >= (n := count_documents(path)):
            start -= n
            continue
        if path.endswith(".parquet"):
            yield from iter_parquet_texts(path, start)
        elif path.endswith(".jsonl"):
            yield from iter_jsonl_texts(path, start)
        else:
            yield read_txt(path)
        start = 0


def iter_hub_documents(dataset, name, start):
    """Texts streamed from the Hugging Face Hub from document index `start` on. The stream is opened
    now, not at the first document, so that a failure to open it is reported before the progress bar."""
    from datasets import load_dataset  # slow to import, and not needed for local files
    try:
        ds = load_dataset(dataset, name=name, split="train", streaming=True)
    except Exception as e:
        exits.exit_unreachable(dataset, exits.one_line(e), LOCAL_FILES_INSTEAD)
    if start:
        ds = ds.skip(start)
    return (example["text"] for example in ds)


def batched(texts, size):
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

# -----------------------------------------------------------------------------
# tokenization, in the worker processes


def tokenize_batch(texts):
    """GPT-2 tokens of a batch of documents, each preceded by EOT, as one uint16 array (sent back
    to the main process as a memcpy, where a list of Python ints would be pickled one by one), and
    each document's length in tokens."""
    enc = tiktoken.get_encoding(TOKENIZER)
    parts = []
    for text in texts:
        # = encode_ordinary(text) (special-token text is plain text), as numpy: no list of Python ints.
        # One document at a time: tiktoken holds the GIL, so encode_ordinary_batch's threads only add
        # overhead; the parallelism comes from the worker processes.
        parts += [EOT_ARRAY, enc.encode_to_numpy(text, disallowed_special=())]
    tokens = np.concatenate(parts)
    if tokens.max() >= 2 ** 16:
        raise ValueError(f"token id {tokens.max()} does not fit in uint16, the shards' token type")
    lengths = np.array([len(ids) for ids in parts[1::2]], dtype=np.int64) + 1
    return tokens.astype(np.uint16), lengths


def die_with(parent_pid):
    """Pool initializer: the worker gets SIGKILL when the main process dies (Linux). Else a worker of
    a run killed with kill -9 can live on for ever, e.g. blocked on a queue lock the dead one held."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def imap_ordered(pool, fn, items, max_in_flight):
    """pool.imap, but reading at most max_in_flight items ahead: Pool.imap's feeder thread would
    pull the whole (100B-token) input stream into memory as fast as it can read it."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()

# -----------------------------------------------------------------------------
# the manifest: what determines the output, and where each shard lies in the document stream


def output_settings(args, files):
    """Everything that determines the shards' bytes (not --num_proc, not --out_dir)."""
    source = {"files": files} if files else {"dataset": args.dataset, "name": args.name}
    return {"source": source, "shard_size": args.shard_size, "val_tokens": args.val_tokens,
            "max_tokens": args.max_tokens, "tokenizer": TOKENIZER, "eot": EOT}


def save_manifest(out_dir, manifest):
    """Atomic (temp file, fsync, rename): a kill leaves the old manifest or the new one."""
    text = json.dumps(manifest, indent=1)
    write_atomically(os.path.join(out_dir, MANIFEST), lambda f: f.write(text.encode()))


def differences(old, new):
    return [f"{key}: {old.get(key)!r} before, {new.get(key)!r} now" for key in new if old.get(key) != new[key]]


def load_manifest(out_dir, settings):
    """The manifest to continue from: a fresh one for a new out_dir, the existing one if it was made
    with the same settings, else an error (never mix two streams in one directory)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        if glob.glob(os.path.join(glob.escape(out_dir), "*.bin")):  # not ours: the manifest is written before the first shard
            exits.fail(f"{out_dir} holds shards but no {MANIFEST}; use an empty --out_dir",
                       exits.CONFIG_ERROR)
        return {"settings": settings, "shards": [], "complete": False}
    with open(path) as f:
        manifest = json.load(f)
    changed = differences(manifest["settings"], settings)
    if changed:
        exits.fail(f"{out_dir} was prepared with other settings ({'; '.join(changed)}); "
                   f"rerun with the same arguments to resume, or use another --out_dir", exits.CONFIG_ERROR)
    for shard in manifest["shards"]:  # a shard damaged since it was written is not silently kept
        try:
            ntok = shards.read_header(os.path.join(out_dir, shard["file"]))
        except shards.ShardError as e:
            exits.fail(f"cannot resume: {e}")
        if ntok != shard["tokens"]:
            exits.fail(f"cannot resume: {shard['file']} holds {ntok} tokens but {MANIFEST} says {shard['tokens']}")
    return manifest


# -----------------------------------------------------------------------------
# shards out


def shard_name(index):
    return f"fineweb_val_{index:06d}.bin" if index == 0 else f"fineweb_train_{index:06d}.bin"


def holds_shard(path, tokens):
    """Whether path is already the shard of these tokens, byte for byte. A run killed between a
    shard's rename and the manifest update leaves such a shard, unlisted: the rerun tokenizes its
    documents again but keeps the file, so that no kill, however timed, makes a shard be written twice."""
    try:
        if shards.read_header(path) != len(tokens):
            return False
    except shards.ShardError:  # not there (the usual case), or not a whole shard
        return False
    header = np.fromfile(path, dtype="<i4", count=shards.HEADER_INTS)
    return not header[3:].any() and np.array_equal(shards.read_shard(path), tokens)


class ShardWriter:
    """Cuts the token stream into shards and records, for each, its document range in the manifest.
    The stream position is (doc, offset): the next token is token `offset` of document `doc`."""

    def __init__(self, out_dir, manifest):
        self.out_dir, self.manifest = out_dir, manifest
        self.settings = manifest["settings"]
        written = manifest["shards"]
        self.tokens_written = sum(s["tokens"] for s in written)
        self.doc, self.offset = (written[-1]["next_doc"], written[-1]["next_offset"]) if written else (0, 0)
        self.start_shard()

    def start_shard(self):
        index = len(self.manifest["shards"])
        size = self.settings["val_tokens"] if index == 0 else self.settings["shard_size"]
        if self.settings["max_tokens"] is not None:
            size = min(size, self.settings["max_tokens"] - self.tokens_written)
        self.buf = np.empty(size, dtype=np.uint16)
        self.filled = 0
        self.first_doc, self.first_offset = self.doc, self.offset

    @property
    def tokens_so_far(self):
        return self.tokens_written + self.filled

    @property
    def done(self):
        return len(self.buf) == 0  # max_tokens reached

    def add(self, tokens, doc_lengths):
        """Append a batch of tokenized documents that starts at document self.doc; the first
        self.offset tokens of that document are already in earlier shards (after a resume).
        Stops at max_tokens."""
        doc_ends = np.cumsum(doc_lengths)
        batch_first_doc, i = self.doc, self.offset
        while i < len(tokens) and not self.done:
            take = min(len(self.buf) - self.filled, len(tokens) - i)
            self.buf[self.filled:self.filled + take] = tokens[i:i + take]
            self.filled += take
            i += take
            d = int(np.searchsorted(doc_ends, i, side="right"))  # the document holding token i
            self.doc, self.offset = batch_first_doc + d, i - (int(doc_ends[d - 1]) if d else 0)
            if self.filled == len(self.buf):
                self.write_shard()

    def write_shard(self):
        if not self.manifest["shards"]:
            # the manifest goes first: a kill right after the first shard must leave a directory that
            # a rerun knows as its own, not one that "holds shards but no manifest"
            save_manifest(self.out_dir, self.manifest)
        name = shard_name(len(self.manifest["shards"]))
        path, tokens = os.path.join(self.out_dir, name), self.buf[:self.filled]
        if not holds_shard(path, tokens):
            shards.write_shard(path, tokens)
        last_doc = self.doc if self.offset else self.doc - 1
        self.manifest["shards"].append({
            "file": name, "tokens": self.filled,
            "first_doc": self.first_doc, "first_offset": self.first_offset, "last_doc": last_doc,
            "next_doc": self.doc, "next_offset": self.offset})
        save_manifest(self.out_dir, self.manifest)
        self.tokens_written += self.filled
        self.start_shard()

    def finish(self):
        """Write the last, shorter shard and mark the manifest complete."""
        if self.filled:
            self.write_shard()
        if not self.manifest["shards"]:
            exits.fail("no documents in the input")
        last = self.manifest["shards"][-1]
        self.manifest.update(complete=True, documents=last["last_doc"] + 1, tokens=self.tokens_written)
        save_manifest(self.out_dir, self.manifest)


def record_doc_lengths(out_dir, manifest):
    """Write the statistics of every document in the shards and print them. From the shards themselves,
    read again: they hold the documents of every run that wrote to out_dir, not only this one's."""
    paths = [os.path.join(out_dir, shard["file"]) for shard in manifest["shards"]]  # in stream order
    statistics = doc_stats.document_statistics(paths, EOT)
    doc_stats.save(os.path.join(out_dir, doc_stats.STATS_FILE), statistics)
    print(doc_stats.table(statistics))
    print(f"written to {os.path.join(out_dir, doc_stats.STATS_FILE)}")

# -----------------------------------------------------------------------------
# --verify


def verify(out_dir):
    """Check every shard's header and size (and the manifest's token counts, if there is one)."""
    paths = sorted(glob.glob(os.path.join(glob.escape(out_dir), "*_val_*.bin"))) + sorted(glob.glob(os.path.join(glob.escape(out_dir), "*_train_*.bin")))
    if not paths:
        exits.fail(f"verify failed: no *_val_*.bin or *_train_*.bin shards in {out_dir}")
    counts = {}
    for path in paths:
        try:
            counts[os.path.basename(path)] = shards.read_header(path)
        except shards.ShardError as e:
            exits.fail(f"verify failed: {e}")
    status = f"no {MANIFEST}"
    if os.path.exists(os.path.join(out_dir, MANIFEST)):
        with open(os.path.join(out_dir, MANIFEST)) as f:
            manifest = json.load(f)
        for shard in manifest["shards"]:
            if counts.get(shard["file"]) != shard["tokens"]:
                exits.fail(f"verify failed: {os.path.join(out_dir, shard['file'])}: {MANIFEST} says "
                           f"{shard['tokens']} tokens, the shard has {counts.get(shard['file'], 'none (missing)')}")
        status = "complete" if manifest["complete"] else "incomplete: rerun prepare.py with the same arguments to finish"
    val = sum(n for name, n in counts.items() if "_val_" in name)
    train = sum(counts.values()) - val
    print(f"ok: {len(paths)} shards in {out_dir}: {val:,} val + {train:,} train = {val + train:,} tokens ({status})")

# -----------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", help="local .parquet/.jsonl files (their `text` field) or .txt files "
                        "(one document each), or globs; default: stream --dataset from the Hub")
    parser.add_argument("--out_dir", default="data/fineweb/fineweb100B")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per train shard")
    parser.add_argument("--val_tokens", type=int, default=50_000_000, help="the first this many tokens form the val shard")
    parser.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens in all")
    parser.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 1) - 1), help="tokenizer processes")
    parser.add_argument("--dataset", default="HuggingFaceFW/fineweb")
    parser.add_argument("--name", default="sample-100BT")
    parser.add_argument("--verify", action="store_true", help="check the shards in --out_dir and exit")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (there is none either when stderr is not a terminal)")
    args = parser.parse_args()
    for flag in ("shard_size", "val_tokens", "max_tokens", "num_proc"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be positive, got {value}")
    return args


def progress_bar(args, files, writer):
    """A bar with an ETA: in tokens up to --max_tokens, else in documents, whose total is known at no
    cost for parquet (the footers) and .txt files; for jsonl or the Hub stream, a count and a rate."""
    disable = args.quiet or not sys.stderr.isatty()  # a log would fill with carriage returns
    if args.max_tokens:
        return tqdm(total=args.max_tokens, initial=writer.tokens_so_far, unit="tok", unit_scale=True,
                    dynamic_ncols=True, disable=disable)
    total = None
    if files and not any(path.endswith(".jsonl") for path in files):  # counting jsonl lines means reading it all
        total = sum(count_documents(path) for path in files)
    return tqdm(total=total, initial=writer.doc, unit="docs", unit_scale=True, dynamic_ncols=True, disable=disable)


def write_shards(args, files):
    """Tokenize the documents not yet in out_dir's shards and write the rest of the shards."""
    # a killed run's; never a shard
    remove_temp_files(args.out_dir, ("*.bin.tmp*", f"{MANIFEST}.tmp*", f"{doc_stats.STATS_FILE}.tmp*"))
    manifest = load_manifest(args.out_dir, output_settings(args, files))
    if manifest["complete"]:
        print(f"nothing to do: {args.out_dir} is complete ({len(manifest['shards'])} shards, "
              f"{manifest['tokens']:,} tokens from {manifest['documents']:,} documents)")
        if not os.path.exists(os.path.join(args.out_dir, doc_stats.STATS_FILE)):  # killed just before, or older
            record_doc_lengths(args.out_dir, manifest)
        return
    if not files:
        exits.check_hub(args.dataset, LOCAL_FILES_INSTEAD)

    writer = ShardWriter(args.out_dir, manifest)
    start_doc, start_tokens, start_shards = writer.doc, writer.tokens_written, len(manifest["shards"])
    if start_shards:
        print(f"resuming {args.out_dir}: keeping {start_shards} shards, skipping {start_doc:,} documents")
    try:
        tiktoken.get_encoding(TOKENIZER)  # load the BPE once, here: the forked workers inherit it
    except Exception as e:  # tiktoken downloads the BPE files on first use
        exits.fail(f"cannot load tiktoken's {TOKENIZER} BPE files ({type(e).__name__}); offline, point "
                   f"TIKTOKEN_CACHE_DIR at a directory holding tiktoken's cached {TOKENIZER} files")
    # the pool is forked before the Hub stream opens its connections and threads
    with Pool(args.num_proc, initializer=die_with, initargs=(os.getpid(),)) as pool:
        texts = iter_local_documents(files, start_doc) if files else iter_hub_documents(args.dataset, args.name, start_doc)
        batches = imap_ordered(pool, tokenize_batch, batched(texts, DOCS_PER_BATCH), max_in_flight=4 * args.num_proc)
        t0 = time.time()
        # closed on an input error too, so that the error starts a line of its own
        with progress_bar(args, files, writer) as bar:
            for tokens, doc_lengths in batches:
                writer.add(tokens, doc_lengths)
                bar.update((writer.tokens_so_far if args.max_tokens else writer.doc) - bar.n)
                postfix = {"shards": len(manifest["shards"])}
                if not args.max_tokens:  # a bar in tokens shows this rate itself
                    postfix["tok_per_s"] = f"{(writer.tokens_so_far - start_tokens) / (time.time() - t0):,.0f}"
                bar.set_postfix(postfix, refresh=False)
                if writer.done:
                    break
            writer.finish()
    dt = time.time() - t0
    n_val = min(1, len(manifest["shards"]))
    print(f"done: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, {len(manifest['shards'])} shards "
          f"({n_val} val + {len(manifest['shards']) - n_val} train) in {args.out_dir}; "
          f"{(manifest['tokens'] - start_tokens) / dt:,.0f} tokens/s")
    record_doc_lengths(args.out_dir, manifest)


def main():
    args = parse_args()
    if args.verify:
        return verify(args.out_dir)
    files = expand_inputs(args.input) if args.input else None
    try:  # one writer per out_dir: a second run would delete the first one's temp files
        os.makedirs(args.out_dir, exist_ok=True)
        lock = DirectoryLock(args.out_dir, ".prepare.lock").acquire()
    except DirectoryLocked as e:
        exits.fail(f"another prepare.py is writing to {args.out_dir}: {e}")
    except OSError as e:  # read-only, or under a file: the first write in out_dir is the lock's
        exits.fail(f"cannot write to {args.out_dir} ({e}); choose an --out_dir you can write to")
    try:
        write_shards(args, files)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # a full or read-only disk, never a read error
            raise
        exits.fail(f"cannot write to {args.out_dir} ({e}); make room on its disk, then rerun the same command "
                   f"to resume")
    finally:  # on errors too: a lock file left behind would look like a run in progress
        lock.release()


if __name__ == "__main__":
    main()
