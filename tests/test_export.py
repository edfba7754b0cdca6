"""scripts/export_hf.py: an exported folder loads in transformers offline and computes what the checkpoint
computes (logits, cached and padded greedy decoding, every variant), its tokenizer is tiktoken's, and
what cannot be exported is refused in one line without writing anything."""

import json
import os

import pytest
import torch

from helpers import MODEL_VARIANTS, with_documents
from micro import CORPUS
from model import GPT, GPTConfig
from pretrain.checkpoint_format import save_checkpoint
from pretrain.train_config import make_config
from running import REPO, run_in_process, run_python

pytestmark = pytest.mark.slow  # each export builds a tokenizer and writes a model: seconds, not milliseconds

EXPORT = ["-m", "scripts.export_hf"]  # run from the repo root
SMALL = dict(n_layer=2, n_head=4, n_embd=32, head_dim=8, block_size=32)  # GPT-2's vocabulary: real text


def checkpoint_of(variant, folder):
    """A checkpoint file of a model of `variant` whose logits are far from ties, as train.py writes one."""
    keys = {**SMALL, **MODEL_VARIANTS[variant]}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**keys))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    config = make_config(**keys, out_dir=str(folder), data_dir=str(folder)).to_dict()
    return save_checkpoint({"model": model.state_dict(), "config": config, "step": 1}, str(folder), 1), model.eval()


def load_export(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{variant: (export folder, the checkpoint's GPT)} for every variant the repo trains."""
    root = tmp_path_factory.mktemp("exports")
    made = {}
    for variant in MODEL_VARIANTS:
        path, model = checkpoint_of(variant, root / f"run_{variant}")
        folder = root / f"hf_{variant}"
        result = run_in_process([*EXPORT, path, folder])
        assert result.status == 0, result.stderr[-3000:]
        made[variant] = (str(folder), model)
    return made


def real_text_tokens(n):
    import tiktoken
    with open(CORPUS[0], encoding="utf-8") as f:
        return torch.tensor([tiktoken.get_encoding("gpt2").encode_ordinary(f.read(20_000))[:n]])


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_exported_logits_equal_the_checkpoints(exports, variant):
    folder, model = exports[variant]
    exported = load_export(folder)
    torch.manual_seed(1)
    # with EOTs (several documents in a window: packed, for the document masks), and plain text
    for idx in (with_documents(torch.randint(0, 50257, (3, SMALL["block_size"]))), real_text_tokens(SMALL["block_size"])):
        with torch.no_grad():
            ours, theirs = model(idx)[0], exported(idx).logits
        assert torch.allclose(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_transformers_greedy_generate_with_the_cache_equals_without_and_the_full_forward(exports, variant):
    """transformers' own generate: use_cache passes its DynamicCache to model.py's attention; a batch of 3
    prompts of different lengths is left-padded, with an attention mask, and each row continues as alone."""
    folder, model = exports[variant]
    exported = load_export(folder)
    torch.manual_seed(2)
    prompts = [with_documents(torch.randint(0, 50257, (n,))) for n in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), 50256)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    for batch in (slice(0, 1), slice(0, 3)):
        kwargs = dict(attention_mask=mask[batch], max_new_tokens=10, do_sample=False, pad_token_id=50256)
        with torch.no_grad():
            cached = exported.generate(ids[batch], use_cache=True, **kwargs)
            uncached = exported.generate(ids[batch], use_cache=False, **kwargs)
        for row, prompt in enumerate(prompts[batch]):
            reference = prompt[None]
            for _ in range(10):  # the full forward over the sequence so far, argmax, again
                with torch.no_grad():
                    reference = torch.cat((reference, model(reference)[0][:, -1:].argmax(-1)), dim=1)
            assert cached[row, width:].tolist() == uncached[row, width:].tolist() == reference[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", ["document", "document_xsa_sinks_gqa"])
def test_beam_search_and_prompt_lookup_keep_the_document_masks_token_history_with_the_cache(exports, variant):
    """transformers reorders the cache's rows after each beam step and crops it in assisted decoding; the token
    ids a document mask splits (cache.tokens) must follow, or the cached search decodes other text."""
    folder, _ = exports[variant]
    exported = load_export(folder)
    torch.manual_seed(3)
    ids = with_documents(torch.randint(0, 50257, (2, 9)))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=50256)
    with torch.no_grad():
        cached = exported.generate(ids, use_cache=True, num_beams=3, **kwargs)
        uncached = exported.generate(ids, use_cache=False, num_beams=3, **kwargs)
        assert cached.tolist() == uncached.tolist()
        # prompt lookup (one sequence, cache only) guesses tokens and crops the cache where a guess was wrong:
        # what it decodes is greedy decoding's, which the uncached greedy search gives
        greedy = exported.generate(ids[:1], use_cache=False, **kwargs)
        looked_up = exported.generate(ids[:1], use_cache=True, prompt_lookup_num_tokens=2, **kwargs)
        assert looked_up.tolist() == greedy.tolist()


def test_the_folder_holds_what_transformers_and_a_hub_page_expect(exports):
    folder, model = exports["sinks"]
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "xsa_gpt" and config["auto_map"]["AutoModelForCausalLM"] == "modeling_xsa.XSAForCausalLM"
    assert {k: config[k] for k in ("attn_type", "n_sinks", "block_size")} == {"attn_type": "xsa", "n_sinks": 2,
                                                                             "block_size": SMALL["block_size"]}
    assert config["max_position_embeddings"] == SMALL["block_size"] and config["eos_token_id"] == 50256
    assert open(os.path.join(folder, "model.py")).read() == open(os.path.join(REPO, "model.py")).read()  # not restated
    assert {"generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "modeling_xsa.py"} <= set(os.listdir(folder))
    exported = load_export(folder)
    assert exported.config.num_hidden_layers == SMALL["n_layer"] and exported.config.hidden_size == SMALL["n_embd"]


def test_the_tokenizer_encodes_as_tiktoken(exports):
    import tiktoken
    from transformers import AutoTokenizer
    folder, _ = exports["sa"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tiktoken.get_encoding("gpt2")
    with open(CORPUS[1], encoding="utf-8") as f:
        plays = f.read(30_000)
    for text in (plays, "naïve café — 日本語 ⁂ 😀\n\n\n\t  spaces   and\ttabs  \r\n", "a<|endoftext|>b <|endoftext|>",
                 " leading space", "trailing   "):
        assert tokenizer.encode(text) == enc.encode_ordinary(text), text[:40]
        assert tokenizer.decode(enc.encode_ordinary(text)) == text
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.eos_token_id == 50256


def test_bfloat16_weights_in_shards_with_an_index(tmp_path):
    path, model = checkpoint_of("xsa", tmp_path / "run")
    folder = tmp_path / "hf"
    result = run_in_process([*EXPORT, path, folder, "--dtype", "bfloat16", "--max_shard_size", "2MB"])
    assert result.status == 0, result.stderr[-3000:]
    index = json.load(open(folder / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / name).exists() for name in shards)
    exported = load_export(str(folder))
    assert exported.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.gpt.state_dict()[name], tensor.to(torch.bfloat16)), name


def run_export(*args):
    """The exporter in a process of its own (what it prints, how it exits)."""
    return run_python([*EXPORT, *map(str, args)])


def test_what_cannot_be_exported_is_one_line_and_writes_nothing(tmp_path):
    path, _ = checkpoint_of("sa", tmp_path / "run")
    out = tmp_path / "hf"

    def refused(*args, says):
        result = run_in_process([*EXPORT, *args])
        assert result.status == 3, result.stderr[-3000:]
        assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr, result.stderr
        return result

    refused(tmp_path / "missing.pt", out, says=f"cannot load checkpoint {tmp_path / 'missing.pt'}")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(path, "rb").read()[:5000])
    refused(truncated, out, says=f"cannot load checkpoint {truncated}")
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".hf")]
    (tmp_path / "a_file").write_text("x")
    refused(path, tmp_path / "a_file" / "hf", says="cannot write")
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused(path, out, says="not empty; pass --overwrite")
    assert os.listdir(out) == ["notes.txt"]
    # a config key this exporter does not know: a model.py newer than this one may use it
    state = torch.load(path, weights_only=True)
    state["config"]["attn_window"] = 128
    newer = save_checkpoint({k: state[k] for k in ("model", "config", "step")}, str(tmp_path / "newer"), 1)
    refused(newer, tmp_path / "hf_newer", says="keys this exporter does not know (attn_window)")
    assert not (tmp_path / "hf_newer").exists()
    # --overwrite replaces the folder whole
    assert run_in_process([*EXPORT, path, out, "--overwrite"]).status == 0
    assert "notes.txt" not in os.listdir(out) and "config.json" in os.listdir(out)


def test_push_to_hub_without_a_login_is_one_line(tmp_path):
    path, _ = checkpoint_of("sa", tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_TOKEN")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="0")
    result = run_python([*EXPORT, path, tmp_path / "hf", "--push_to_hub", "me/xsa-test"], env=env)
    assert result.status == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: --push_to_hub needs a Hugging Face login")
    assert (tmp_path / "hf" / "config.json").exists()  # the export itself is done


def test_push_to_hub_uploads_the_whole_folder(tmp_path):
    from fakes.hub import accepting_hub, no_hub_env
    path, _ = checkpoint_of("xsa", tmp_path / "run")
    folder = tmp_path / "hf"
    with accepting_hub() as (endpoint, hub):
        env = no_hub_env(endpoint, tmp_path, HF_TOKEN="hf_fake", HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")
        result = run_python([*EXPORT, path, folder, "--push_to_hub", "tester/xsa-tiny"], env=env)
    assert result.status == 0, result.stderr[-3000:] + str(hub.requests)
    assert "pushed to tester/xsa-tiny" in result.stdout
    sent = hub.files["tester/xsa-tiny"]
    assert sent == {name: (folder / name).read_bytes() for name in os.listdir(folder)}
