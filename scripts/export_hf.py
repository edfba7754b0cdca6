"""
Export a trained model as a Hugging Face transformers model folder, loadable offline with

    AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)
    AutoTokenizer.from_pretrained(HF_DIR)

    python -m scripts.export_hf out/xsa_0p7b hf/xsa_0p7b                      # the run's newest checkpoint
    python -m scripts.export_hf out/xsa_0p7b hf/xsa_0p7b --checkpoint best    # its best validation loss's
    python -m scripts.export_hf out/xsa_0p7b/ckpt_0200000.pt hf/xsa_0p7b --dtype bfloat16
    python -m scripts.export_hf out/xsa_2p7b hf/xsa_2p7b --push_to_hub me/xsa-2.7b

The folder holds config.json (every model key, max_position_embeddings = block_size, auto_map),
the weights as safetensors (sharded, with an index, above 5 GB), generation_config.json, GPT-2's
tokenizer with end-of-text as bos/eos (built from tiktoken's own files, no download; it encodes text
exactly as tiktoken's encode_ordinary does), and the code: model.py as it is, and modeling_xsa.py, a
thin transformers wrapper that imports it. Checkpoints of either format (a file, or an FSDP directory)
load in this one process. docs/export.md walks through loading it, lm-eval's hf backend and the Hub.
"""

import sys

if not __package__:  # run as a file, where the repo's imports fail: say how to run it
    print("run it from the repo root as a module: python -m scripts.export_hf", file=sys.stderr)
    sys.exit(2)

import argparse
import importlib.util
import os
import shutil
import uuid

import torch

from pretrain import checkpointer, exits
from pretrain.runtime import REPO
from pretrain.train_config import MODEL_KEYS, TRAIN_KEYS

CODE = {"model.py": os.path.join(REPO, "model.py"),  # the export ships both as they are
        "modeling_xsa.py": os.path.join(REPO, "pretrain", "modeling_xsa.py")}
AUTO_MAP = {"AutoConfig": "modeling_xsa.XSAConfig", "AutoModelForCausalLM": "modeling_xsa.XSAForCausalLM"}
MAX_SHARD_SIZE = "5GB"  # the default: a 2.7B model in float32 is 11 GB, three files and an index
GPT2_FILES = {  # tiktoken's own GPT-2 files (tiktoken_ext.openai_public.gpt2), read from its cache
    "vocab.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "merges.txt": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}
EOT = "<|endoftext|>"


def checkpoint_to_export(path, which):
    """The checkpoint path: path itself, or a run directory's newest readable checkpoint, or (which="best")
    the checkpoint its newest one names as the best validation loss's."""
    checkpointer.check_checkpoint_path(path)
    if which == "latest" or not os.path.isdir(path) or os.path.exists(os.path.join(path, ".metadata")):
        return path
    newest, state = checkpointer.load_latest_checkpoint(path)
    best = (state or {}).get("best_checkpoint")
    if not best or not os.path.exists(os.path.join(path, best["path"])):
        exits.fail(f"cannot export the best checkpoint of {path}: its checkpoints name none (no evaluation was "
                   f"checkpointed yet, or it was pruned); export the newest with --checkpoint latest")
    return os.path.join(path, best["path"])


def check_model_keys(config, path):
    """Refuse a checkpoint whose config has keys this code does not know (a newer model.py): its model
    could hold what this export would silently leave out."""
    unknown = sorted(set(config) - set(TRAIN_KEYS))
    if unknown:
        exits.fail(f"cannot export {path}: its config has keys this exporter does not know ({', '.join(unknown)}); "
                   f"export it with the train.py version that trained it (config.json's git_commit)")


def load_package(folder):
    """The folder's model.py and modeling_xsa.py as a package, as transformers will import them."""
    name = f"xsa_export_{uuid.uuid4().hex}"  # a fresh package per export, never an earlier one's modules
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.modeling_xsa")


def gpt2_tokenizer(folder, block_size):
    """GPT-2's tokenizer from tiktoken's cached files: end-of-text as bos, eos and unk, and its literal text
    split like any other text (tiktoken's encode_ordinary), as training tokenized documents."""
    from tiktoken.load import read_file_cached
    from transformers import GPT2TokenizerFast
    source = os.path.join(folder, "gpt2_source")
    os.makedirs(source)
    for name, url in GPT2_FILES.items():
        with open(os.path.join(source, name), "wb") as f:
            f.write(read_file_cached(url))
    tokenizer = GPT2TokenizerFast.from_pretrained(source, bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                                  split_special_tokens=True, model_max_length=block_size)
    shutil.rmtree(source)
    return tokenizer


def write_export(model, config, folder, dtype, max_shard_size=MAX_SHARD_SIZE):
    """Write the whole export into folder (a new directory)."""
    for name, source in CODE.items():
        shutil.copy(source, os.path.join(folder, name))
    open(os.path.join(folder, "__init__.py"), "w").close()  # a package while exporting; transformers needs none
    package = load_package(folder)
    hf_config = package.XSAConfig(**{k: config[k] for k in MODEL_KEYS if k in config},
                                  max_position_embeddings=config["block_size"], architectures=["XSAForCausalLM"])
    hf_config.auto_map = AUTO_MAP
    with torch.device("meta"):
        hf_model = package.XSAForCausalLM(hf_config)
    hf_model.gpt.load_state_dict(model.state_dict(), assign=True)
    hf_model.gpt.set_rope_tables()
    hf_model.tie_weights()
    hf_model.to(getattr(torch, dtype))
    hf_model.generation_config.update(bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
                                      pad_token_id=hf_config.eos_token_id, max_length=config["block_size"])
    hf_model.save_pretrained(folder, max_shard_size=max_shard_size)
    gpt2_tokenizer(folder, config["block_size"]).save_pretrained(folder)
    os.remove(os.path.join(folder, "__init__.py"))
    shutil.rmtree(os.path.join(folder, "__pycache__"), ignore_errors=True)


def prepare_out(hf_dir, overwrite):
    """A temporary directory beside hf_dir to write into, after the checks on hf_dir."""
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        exits.fail(f"cannot export to {hf_dir}: it is a file")
    if os.path.isdir(hf_dir) and os.listdir(hf_dir) and not overwrite:
        exits.fail(f"cannot export to {hf_dir}: it is not empty; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(hf_dir))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(hf_dir))}.tmp{os.getpid()}")
    try:
        os.makedirs(tmp)
    except OSError as e:
        exits.fail(f"cannot write {hf_dir} ({exits.one_line(e)}); give a writable directory")
    return tmp


def push_to_hub(folder, repo_id):
    """Upload the folder to the Hub as model repo repo_id; without a login, one line and exit 2, as
    train.py does for wandb."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import LocalTokenNotFoundError
    api = HfApi()
    try:
        user = api.whoami()["name"]
    except LocalTokenNotFoundError:
        exits.fail("error: --push_to_hub needs a Hugging Face login: run `hf auth login` (or set HF_TOKEN); "
                   f"the export in {folder} is complete", exits.CONFIG_ERROR)
    except Exception as e:
        exits.fail(f"cannot reach the Hugging Face Hub ({exits.one_line(e)}); the export in {folder} is complete")
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                                 commit_message="Export of an SA/XSA GPT (scripts/export_hf.py)")
    except Exception as e:
        exits.fail(f"cannot upload {folder} to {repo_id} ({exits.one_line(e)}); the export there is complete")
    print(f"pushed to {repo_id} as {user}: {getattr(info, 'commit_url', info)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run directory (its newest readable checkpoint), or one checkpoint")
    parser.add_argument("hf_dir", help="the folder to write; made if missing, refused if not empty")
    parser.add_argument("--checkpoint", dest="which", choices=("latest", "best"), default="latest",
                        help="of a run directory: its newest checkpoint, or its best validation loss's")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the saved weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty hf_dir")
    parser.add_argument("--max_shard_size", default=MAX_SHARD_SIZE,
                        help="largest safetensors file; a model above it is sharded, with an index")
    parser.add_argument("--push_to_hub", metavar="REPO_ID", help="then upload the folder to this Hub model repo")
    args = parser.parse_args()

    path = checkpoint_to_export(args.checkpoint, args.which)
    model, config = checkpointer.load_model_or_exit(path, "cpu")
    check_model_keys(config, path)
    tmp = prepare_out(args.hf_dir, args.overwrite)
    try:
        write_export(model, config, tmp, args.dtype, args.max_shard_size)
        if os.path.isdir(args.hf_dir):  # --overwrite (or empty): the old folder goes only once the new is whole
            aside = f"{tmp}.old"
            os.replace(args.hf_dir, aside)
            os.replace(tmp, args.hf_dir)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, args.hf_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        exits.fail(f"cannot write {args.hf_dir} ({exits.one_line(e)})")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(os.path.getsize(os.path.join(args.hf_dir, f)) for f in os.listdir(args.hf_dir))
    print(f"exported {path} ({config['attn_type']}, {model.num_params() / 1e6:.2f}M non-embedding parameters, "
          f"{args.dtype}) to {args.hf_dir}: {len(os.listdir(args.hf_dir))} files, {size / 1e6:.1f} MB")
    if args.push_to_hub:
        push_to_hub(args.hf_dir, args.push_to_hub)


if __name__ == "__main__":
    main()
