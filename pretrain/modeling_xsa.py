"""
A Hugging Face transformers model around this repository's GPT, written into every export
(scripts/export_hf.py) beside a copy of model.py: the architecture is model.py's own, imported, never
restated, so SA, XSA, gated XSA, sinks, GQA/MQA, xsa_layers, biases and any rope_theta behave exactly as
in training. Load an export with

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

The config's fields are GPTConfig's, read from model.py. transformers' KV cache (a DynamicCache,
`model.generate(..., use_cache=True)`) goes straight to GPT.forward, which takes any cache with
update(k, v, layer_idx) and get_seq_length(); the sinks enter it once. An attention mask (left padding)
keeps padding out of attention and out of the positions.
"""

from dataclasses import MISSING, fields

import torch
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .model import GPT, GPTConfig

EOT = 50256  # GPT-2's end-of-text token: the start of every document in training


def _model_fields():
    """(annotations, defaults) of the config: GPTConfig's fields, then what transformers reads."""
    annotations = {f.name: f.type for f in fields(GPTConfig)}
    defaults = {f.name: f.default for f in fields(GPTConfig) if f.default is not MISSING}
    annotations.update(max_position_embeddings=int, use_cache=bool, tie_word_embeddings=bool,
                       bos_token_id=int, eos_token_id=int)
    defaults.update(max_position_embeddings=defaults["block_size"], use_cache=True, tie_word_embeddings=True,
                    bos_token_id=EOT, eos_token_id=EOT)
    return annotations, defaults


_annotations, _defaults = _model_fields()
# GPTConfig's keys, so that a key model.py gains is a key of the export too; the names lm-eval and
# generate look for (hidden_size, num_hidden_layers, ...) map onto them
XSAConfig = type("XSAConfig", (PreTrainedConfig,), {
    "__module__": __name__,
    "__doc__": "model.GPTConfig's keys as a transformers config; max_position_embeddings is block_size.",
    "__annotations__": _annotations,
    "model_type": "xsa_gpt",
    "attribute_map": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                      "num_key_value_heads": "n_kv_head"},
    **_defaults,
})


class XSAForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = XSAConfig
    base_model_prefix = "gpt"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"gpt.transformer.wte.weight": "gpt.lm_head.weight"}  # tied in model.py

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(GPTConfig(**{f.name: getattr(config, f.name) for f in fields(GPTConfig)}))
        self.post_init()

    def _init_weights(self, module):
        # the weights come from the export; the RoPE tables are derived, not saved (non-persistent buffers
        # that from_pretrained leaves uninitialised): computed again here
        if isinstance(module, GPT):
            module.set_rope_tables()

    def _reorder_cache(self, cache, beam_idx):
        """Beam search: the cache's rows follow the beams, and so do the token ids a document mask reads
        (cache.tokens, which transformers' reorder_cache does not know)."""
        cache.reorder_cache(beam_idx)
        if getattr(cache, "tokens", None) is not None:
            cache.tokens = cache.tokens.index_select(0, beam_idx.to(cache.tokens.device))
        return cache

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def forward(self, input_ids, attention_mask=None, cache=None, labels=None, use_cache=None, **kwargs):
        """input_ids (B, T); attention_mask (B, cached tokens + T), 0 on left padding; cache: transformers'
        Cache of the earlier positions. labels: the input ids (shifted here, as transformers does), -100
        ignored. position_ids and the rest of what generate passes are not needed: positions follow from
        the cache and the mask."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            from transformers import DynamicCache
            cache = DynamicCache()
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the plain causal path
        logits, _ = self.gpt(input_ids, cache=cache if use_cache else None, attention_mask=attention_mask)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
