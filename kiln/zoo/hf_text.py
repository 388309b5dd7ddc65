"""Zoo entries from transformers: decoder LMs, encoders, encoder-decoders.

Every model is built from a small config (hidden 32-64, 2 layers, 2-4 heads, vocab 128,
16 tokens) with random weights; nothing is downloaded.  Inputs are right-padded where the
model takes an attention mask, so the mask reaches the attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .registry import Built, KeywordAdapter, padding_mask, register, token_ids

VOCAB = 128
SEQ = 16


def no_dropout(config: Any) -> Any:
    """Zero every dropout probability of a transformers config, layer drop and drop path
    included (train mode is then deterministic, so kiln and eager can be compared)."""
    for key, value in list(vars(config).items()):
        low = key.lower()
        if isinstance(value, float) and "drop" in low:  # dropout, attn_pdrop, layerdrop, drop_path_rate
            setattr(config, key, 0.0)
    return config


_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")


def token_ids_in_vocab(config: Any) -> Any:
    """Special token ids of the default (large-vocabulary) configs moved into a small vocab."""
    for sub in [config] + [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "vocab_size")]:
        vocab = getattr(sub, "vocab_size", None)
        if not isinstance(vocab, int):
            continue
        for i, key in enumerate(_SPECIAL_TOKENS):
            value = getattr(sub, key, None)
            if isinstance(value, int) and value >= vocab:
                setattr(sub, key, min(i, vocab - 1))
    return config


def hf_model(cls: type, config: Any) -> nn.Module:
    """``cls(config)`` with dropout off, seeded, no KV cache."""
    no_dropout(config)
    token_ids_in_vocab(config)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    torch.manual_seed(0)
    return cls(config)


def lm(cls: type, config: Any, mask: bool = True) -> Built:
    """A causal LM on 16 token ids (and a right-padded attention mask)."""
    model = hf_model(cls, config)
    if mask:
        return KeywordAdapter(model, ("input_ids", "attention_mask")), (token_ids(VOCAB), padding_mask(padded=3))
    return KeywordAdapter(model, ("input_ids",)), (token_ids(VOCAB),)


# ------------------------------------------------------------------ decoder LMs


@register("gpt2", "gpt2", "decoder", ("mha", "learned-positions", "conv1d"))
def gpt2() -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    return lm(GPT2LMHeadModel, GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                          attn_implementation="sdpa"))


@register("opt", "opt", "decoder", ("mha", "learned-positions"))
def opt() -> Built:
    from transformers import OPTConfig, OPTForCausalLM

    return lm(OPTForCausalLM, OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                        word_embed_proj_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
                                        attn_implementation="sdpa"))


@register("gpt_neo", "gpt_neo", "decoder", ("mha", "local-attention"))
def gpt_neo() -> Built:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]], window_size=4, intermediate_size=64,
                          attn_implementation="eager")
    return lm(GPTNeoForCausalLM, config)


@register("llama", "llama", "decoder", ("gqa", "rotary", "rms-norm", "swiglu"))
def llama() -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return lm(LlamaForCausalLM, config)


@register("qwen2", "qwen2", "decoder", ("gqa", "rotary", "qkv-bias"))
def qwen2() -> Built:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return lm(Qwen2ForCausalLM, config)


@register("mistral", "mistral", "decoder", ("gqa", "rotary", "sliding-window"))
def mistral() -> Built:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4,
                           attn_implementation="sdpa")
    return lm(MistralForCausalLM, config)


@register("gemma2", "gemma2", "decoder", ("gqa", "rotary", "logit-softcapping", "sliding-window"))
def gemma2() -> Built:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                          sliding_window=4, attn_implementation="eager")
    return lm(Gemma2ForCausalLM, config)


@register("gpt_neox", "gpt_neox", "decoder", ("mha", "partial-rotary", "parallel-residual"))
def gpt_neox() -> Built:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=64, rotary_pct=0.5,
                           attn_implementation="sdpa")
    return lm(GPTNeoXForCausalLM, config)


@register("gptj", "gptj", "decoder", ("mha", "interleaved-rotary", "parallel-residual"))
def gptj() -> Built:
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=64,
                        attn_implementation="eager")
    return lm(GPTJForCausalLM, config)


@register("phi", "phi", "decoder", ("mha", "partial-rotary", "parallel-residual"))
def phi() -> Built:
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                       vocab_size=VOCAB, max_position_embeddings=64, partial_rotary_factor=0.5,
                       attn_implementation="sdpa")
    return lm(PhiForCausalLM, config)


@register("bloom", "bloom", "decoder", ("alibi",))
def bloom() -> Built:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB, attn_implementation="eager")
    return lm(BloomForCausalLM, config)


@register("mpt", "mpt", "decoder", ("alibi", "no-bias"))
def mpt() -> Built:
    from transformers import MptConfig, MptForCausalLM

    config = MptConfig(n_layers=2, d_model=32, n_heads=4, expansion_ratio=2, vocab_size=VOCAB, max_seq_len=64,
                       attn_implementation="eager")
    return lm(MptForCausalLM, config)


@register("falcon", "falcon", "decoder", ("alibi", "multi-query", "parallel-residual"))
def falcon() -> Built:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, alibi=True,
                          multi_query=True, vocab_size=VOCAB, attn_implementation="eager")
    return lm(FalconForCausalLM, config)


# ------------------------------------------------------------------ encoders


def encoder(cls: type, config: Any, token_types: bool = False) -> Built:
    model = hf_model(cls, config)
    names = ["input_ids", "attention_mask"]
    inputs = [token_ids(VOCAB), padding_mask()]
    if token_types:
        names.append("token_type_ids")
        types = torch.zeros(1, SEQ, dtype=torch.int64)
        types[:, SEQ // 2:] = 1
        inputs.append(types)
    return KeywordAdapter(model, names), tuple(inputs)


@register("bert", "bert", "encoder", ("padding-mask", "token-types", "pooler"))
def bert() -> Built:
    from transformers import BertConfig, BertModel

    return encoder(BertModel, BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                         attn_implementation="sdpa"), token_types=True)


@register("roberta", "roberta", "encoder", ("padding-mask", "padded-position-ids"))
def roberta() -> Built:
    from transformers import RobertaConfig, RobertaModel

    return encoder(RobertaModel, RobertaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                               attn_implementation="sdpa"))


@register("distilbert", "distilbert", "encoder", ("padding-mask",))
def distilbert() -> Built:
    from transformers import DistilBertConfig, DistilBertModel

    return encoder(DistilBertModel, DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=64, vocab_size=VOCAB,
                                                     max_position_embeddings=64, attn_implementation="sdpa"))


@register("albert", "albert", "encoder", ("shared-layers", "factorized-embedding"))
def albert() -> Built:
    from transformers import AlbertConfig, AlbertModel

    return encoder(AlbertModel, AlbertConfig(num_hidden_layers=2, embedding_size=16, hidden_size=32,
                                             num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                                             max_position_embeddings=64, attn_implementation="eager"))


@register("electra", "electra", "encoder", ("padding-mask", "embedding-projection"))
def electra() -> Built:
    from transformers import ElectraConfig, ElectraModel

    return encoder(ElectraModel, ElectraConfig(num_hidden_layers=2, embedding_size=16, hidden_size=32,
                                               num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                                               max_position_embeddings=64, attn_implementation="sdpa"))


@register("deberta_v2", "deberta_v2", "encoder", ("relative-attention", "disentangled-attention"))
def deberta_v2() -> Built:
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                             vocab_size=VOCAB, max_position_embeddings=64, relative_attention=True,
                             position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"])
    return encoder(DebertaV2Model, config)


# ------------------------------------------------------------------ encoder-decoders


def seq2seq(cls: type, config: Any) -> Built:
    model = hf_model(cls, config)
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    return KeywordAdapter(model, names), (token_ids(VOCAB), padding_mask(), token_ids(VOCAB, 8, seed=2))


@register("t5", "t5", "encoder-decoder", ("relative-position-buckets", "rms-norm", "cross-attention"))
def t5() -> Built:
    from transformers import T5Config, T5Model

    return seq2seq(T5Model, T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4,
                                     d_ff=64, vocab_size=VOCAB, relative_attention_num_buckets=8,
                                     relative_attention_max_distance=16, decoder_start_token_id=0))


@register("bart", "bart", "encoder-decoder", ("learned-positions", "cross-attention"))
def bart() -> Built:
    from transformers import BartConfig, BartModel

    return seq2seq(BartModel, BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                         vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa"))


@register("marian", "marian", "encoder-decoder", ("sinusoidal-positions", "tied-lm-head", "cross-attention"))
def marian() -> Built:
    from transformers import MarianConfig, MarianMTModel

    return seq2seq(MarianMTModel, MarianConfig(encoder_layers=2, decoder_layers=2, d_model=32,
                                               encoder_attention_heads=4, decoder_attention_heads=4,
                                               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                               max_position_embeddings=64, pad_token_id=VOCAB - 1,
                                               decoder_start_token_id=VOCAB - 1, attn_implementation="sdpa"))
