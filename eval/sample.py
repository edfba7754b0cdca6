"""
Sample text from a checkpoint (a file, or a run directory: its newest checkpoint).

    python -m eval.sample out/xsa_0p7b --start "The meaning of life is" --num_samples 3
    python -m eval.sample out/xsa_0p7b --start FILE:prompt.txt --temperature 0   # greedy

Decoding keeps the keys and values of the tokens so far (model.KVCache): a new token costs one
position's forward, not one over the whole sequence. Each sample's line reports its tokens per second.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m eval.sample", file=sys.stderr)
    sys.exit(2)

import time

import torch

from eval import common
from pretrain import checkpointer, exits
from pretrain.runtime import autocast


def main():
    parser = common.make_parser(__doc__, checkpoints=None)
    parser.add_argument("checkpoint", help="checkpoint file or run directory (a run directory: its newest checkpoint)")
    parser.add_argument("--start", default="<|endoftext|>",
                        help="prompt text, or FILE:path; the default starts a new document, as in training")
    parser.add_argument("--num_samples", type=int, default=3, help="samples to draw")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens generated per sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="< 1 sharpens, > 1 flattens; 0 is greedy")
    parser.add_argument("--top_k", type=int, default=200,
                        help="sample only among the k likeliest tokens; 0 disables")
    parser.add_argument("--seed", type=int, default=1337, help="sampling seed")
    args = parser.parse_args()

    device, dtype = common.device_and_dtype(parser, args)
    torch.manual_seed(args.seed)
    model, config = checkpointer.load_model_or_exit(args.checkpoint, device)
    enc = common.gpt2_encoding_or_exit()  # offline with nothing in tiktoken's cache: one line, exit 3
    start = args.start
    if start.startswith("FILE:"):
        try:
            with open(start[len("FILE:"):], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            exits.fail(f"cannot read the prompt file {start[len('FILE:'):]} ({exits.one_line(e)})")
    # the end-of-text token is allowed in the prompt: every training document starts with it
    prompt = enc.encode(start, allowed_special={"<|endoftext|>"})
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    print(f"{args.checkpoint}: attn_type={config['attn_type']}, "
          f"{model.num_params() / 1e6:.2f}M non-embedding parameters")
    for _ in range(args.num_samples):
        started = time.perf_counter()
        with autocast(device.split(":")[0], dtype):
            out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        # ids of the vocabulary padding (50257..50303) are no text; a trained model all but never samples them
        tokens = [t for t in out[0, len(prompt):].tolist() if t < enc.n_vocab]
        print(start + enc.decode(tokens))
        print(f"-- {args.max_new_tokens} tokens in {seconds:.2f} s: {args.max_new_tokens / seconds:,.1f} tokens/s "
              f"(prompt {len(prompt)} tokens, KV cache) " + "-" * 20)


if __name__ == "__main__":
    main()
