"""
Deterministic, resumable reading of llm.c token shards for training and validation.

The training stream is the concatenation of all train shards, in an order shuffled per
epoch by `data_seed`. One optimizer step consumes `tokens_per_step` consecutive tokens of
that stream (plus one for the last target), cut into sequences; rank r of a world of size
W takes the r-th contiguous W-th of those sequences. The global batch is therefore the same
whatever the number of processes, and the loader's whole state is one position in the
stream: (epoch, shard index within the epoch's order, token offset).
Token ids are checked against the model's vocabulary: val tokens when they are read, before
training starts, and each train shard the first time it is opened.
"""

import numpy as np
import torch

from pretrain.shards import ShardError, check_token_ids, list_shards, read_header, read_shard


class TrainLoader:

    def __init__(self, data_dir, block_size, tokens_per_step, rank=0, world_size=1, data_seed=0, vocab_size=None):
        if tokens_per_step % (block_size * world_size):
            raise ValueError(f"tokens_per_step={tokens_per_step} must be a multiple of "
                             f"block_size * world_size = {block_size} * {world_size}")
        self.paths = list_shards(data_dir, "train")
        self.sizes = [read_header(p) for p in self.paths]  # validates every shard up front
        if sum(self.sizes) < tokens_per_step + 1:
            raise ShardError(f"{data_dir}: train shards hold {sum(self.sizes)} tokens, "
                             f"fewer than one step of {tokens_per_step + 1}")
        self.block_size, self.tokens_per_step = block_size, tokens_per_step
        self.rank, self.world_size, self.data_seed = rank, world_size, data_seed
        self.epoch, self.shard_index, self.offset = 0, 0, 0
        self._order, self._order_epoch = None, None
        self.vocab_size = vocab_size
        self._checked = set()  # shards whose token ids have been checked against vocab_size

    def shard_order(self, epoch):
        """The order in which shards are read in an epoch; depends only on data_seed and epoch."""
        if self._order_epoch != (self.data_seed, epoch):  # drawn once per epoch, not on every read
            self._order = np.random.default_rng([self.data_seed, epoch]).permutation(len(self.paths))
            self._order_epoch = (self.data_seed, epoch)
        return self._order

    def read_tokens(self, n):
        """The next n tokens of the stream, without moving the position (crosses shards and epochs)."""
        epoch, shard_index, offset = self.epoch, self.shard_index, self.offset
        pieces = []
        while n > 0:
            path = self.paths[self.shard_order(epoch)[shard_index]]
            tokens = read_shard(path)
            if path not in self._checked:  # a scan of the whole shard, once per process
                check_token_ids(path, tokens, self.vocab_size)
                self._checked.add(path)
            take = tokens[offset:offset + n]
            pieces.append(np.asarray(take))
            n -= len(take)
            epoch, shard_index, offset = self.advance(epoch, shard_index, offset + len(take))
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def advance(self, epoch, shard_index, offset):
        """Normalise a position whose offset may be at or past the end of its shard."""
        while offset >= self.sizes[self.shard_order(epoch)[shard_index]]:
            offset -= self.sizes[self.shard_order(epoch)[shard_index]]
            shard_index += 1
            if shard_index == len(self.paths):
                epoch, shard_index = epoch + 1, 0
        return epoch, shard_index, offset

    def next_batch(self):
        """This rank's share of the next global batch as (x, y) int64 tensors of shape
        (sequences_per_rank, block_size); y is x shifted by one token."""
        span = self.read_tokens(self.tokens_per_step + 1)
        per_rank = self.tokens_per_step // self.world_size
        mine = torch.from_numpy(span[self.rank * per_rank: (self.rank + 1) * per_rank + 1].astype(np.int64))
        x = mine[:-1].view(-1, self.block_size)
        y = mine[1:].view(-1, self.block_size)
        self.epoch, self.shard_index, self.offset = self.advance(self.epoch, self.shard_index,
                                                                 self.offset + self.tokens_per_step)
        return x, y

    def state_dict(self):
        return {"epoch": self.epoch, "shard_index": self.shard_index, "offset": self.offset,
                "data_seed": self.data_seed, "num_shards": len(self.paths)}

    def load_state_dict(self, state):
        if state["num_shards"] != len(self.paths):
            raise ValueError(f"checkpoint was taken with {state['num_shards']} train shards, "
                             f"the data directory now has {len(self.paths)}")
        self.epoch, self.shard_index, self.offset = state["epoch"], state["shard_index"], state["offset"]
        self.data_seed = state["data_seed"]


def val_sequences(data_dir, block_size, val_tokens, vocab_size=None):
    """The fixed validation set: the first val_tokens tokens of the val shards (capped at what
    they hold) as (x, y) int64 tensors of shape (n_sequences, block_size)."""
    pieces, have = [], 0
    for path in list_shards(data_dir, "val"):
        if have > val_tokens:
            break
        piece = np.asarray(read_shard(path)[:val_tokens + 1 - have])  # read only what is scored
        check_token_ids(path, piece, vocab_size)
        pieces.append(piece)
        have += len(piece)
    tokens = np.concatenate(pieces)
    n_seq = (len(tokens) - 1) // block_size
    if n_seq <= 0:
        raise ShardError(f"{data_dir}: val shards hold {len(tokens)} tokens, fewer than one sequence of {block_size + 1}")
    chunk = torch.from_numpy(tokens[:n_seq * block_size + 1].astype(np.int64))
    return chunk[:-1].view(n_seq, block_size), chunk[1:].view(n_seq, block_size)
