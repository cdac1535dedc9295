"""Hugging Face families, built offline from tiny configs: decoders, encoders, encoder-decoders
and mixtures of experts. ``transformers`` is imported inside each builder (it is optional).

Dropout is 0 unless it is the point (GPT-2 keeps its 0.1: random draws in the forward, seeded per
step by ``run_steps``); the special token ids are set inside the tiny vocabularies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.testing.zoo.base import (
    VOCAB,
    LossOf,
    ZooModel,
    lm_batch,
    masked_lm_batch,
    seq2seq_batch,
    tokens,
)

__all__ = ["HF_FAMILIES"]

WIDTH = 32
HF = ("transformers",)
# The sizes every decoder shares; grouped-query attention where the family has it.
_DECODER: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 2 * WIDTH, "max_position_embeddings": 64, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip
_NO_DROPOUT: dict[str, Any] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# [Note: config keyword arguments]
# transformers 5 declares each config's own fields in its signature, but the class still takes
# the shared PretrainedConfig settings (num_labels, decoder_start_token_id) and renamed ones
# (rotary_pct, activation_dropout) through keywords its signature leaves out. The type checker
# trusts the signature, so the calls that pass such a keyword carry an ignore citing this note.


def _seeded(seed: int, make: Any, *args: Any) -> nn.Module:
    torch.manual_seed(seed)
    return make(*args)


# -- decoders ----------------------------------------------------------------------------------


def _gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return LossOf(_seeded(seed, GPT2LMHeadModel, config))


def _llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_DECODER, num_key_value_heads=2)
    return LossOf(_seeded(seed, LlamaForCausalLM, config))


def _qwen2(seed: int) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_DECODER, num_key_value_heads=2)
    return LossOf(_seeded(seed, Qwen2ForCausalLM, config))


def _mistral(seed: int) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_DECODER, num_key_value_heads=2, sliding_window=8)
    return LossOf(_seeded(seed, MistralForCausalLM, config))


def _opt_layerdrop(seed: int) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(  # type: ignore[call-arg]  # [Note: config keyword arguments]
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=WIDTH,
        layerdrop=0.5, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return LossOf(_seeded(seed, OPTForCausalLM, config))


def _gpt_neox(seed: int) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(  # type: ignore[call-arg]  # [Note: config keyword arguments]
        **_DECODER, rotary_pct=0.5, use_parallel_residual=True
    )
    return LossOf(_seeded(seed, GPTNeoXForCausalLM, config))


def _phi(seed: int) -> nn.Module:
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(  # type: ignore[call-arg]  # [Note: config keyword arguments]
        **_DECODER, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0
    )
    return LossOf(_seeded(seed, PhiForCausalLM, config))


def _gemma(seed: int) -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(**_DECODER, num_key_value_heads=1, head_dim=8)
    return LossOf(_seeded(seed, GemmaForCausalLM, config))


# -- encoders ----------------------------------------------------------------------------------


class PooledHead(nn.Module):
    """``AutoModel`` (BERT, with its pooler) and a head on the token states: the pooler runs
    but no loss reads it, so its parameters never get a gradient."""

    def __init__(self, encoder: nn.Module, width: int, vocab: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        states = self.encoder(input_ids=input_ids).last_hidden_state
        logits = self.head(states)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _bert_pooler(seed: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, **_NO_DROPOUT,
    )  # fmt: skip
    torch.manual_seed(seed)
    return PooledHead(BertModel(config, add_pooling_layer=True), WIDTH, VOCAB)


def _roberta_mlm(seed: int) -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, **_NO_DROPOUT,
    )  # fmt: skip
    return LossOf(_seeded(seed, RobertaForMaskedLM, config))


def _albert_shared(seed: int) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=WIDTH, num_hidden_layers=4,
        num_hidden_groups=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )  # fmt: skip
    return LossOf(_seeded(seed, AlbertForMaskedLM, config))


# -- encoder-decoders --------------------------------------------------------------------------


def _t5(seed: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(  # type: ignore[call-arg]  # [Note: config keyword arguments]
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )  # fmt: skip
    return LossOf(_seeded(seed, T5ForConditionalGeneration, config))


def _bart(seed: int) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return LossOf(_seeded(seed, BartForConditionalGeneration, config))


# -- mixtures of experts -----------------------------------------------------------------------


def _mixtral(seed: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_DECODER, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )  # fmt: skip
    return LossOf(_seeded(seed, MixtralForCausalLM, config))


NUM_EXPERTS = 8


def _switch(seed: int) -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(  # type: ignore[call-arg]  # [Note: config keyword arguments]
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4,
        num_experts=NUM_EXPERTS, expert_capacity=8, router_jitter_noise=0.0, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return LossOf(_seeded(seed, SwitchTransformersForConditionalGeneration, config))


def _switch_batch(step: int) -> dict[str, torch.Tensor]:
    """Fewer tokens than experts can take: some experts get none in a step."""
    source = tokens(step, vocab=VOCAB - 3, seq_len=4) + 3
    return {"input_ids": source, "labels": tokens(step + 500, vocab=VOCAB - 3, seq_len=4) + 3}


HF_FAMILIES = (
    ZooModel(name="gpt2", kind="decoder", build=_gpt2, batch=lm_batch, needs=HF,
             notes="tied input and output embeddings; dropout 0.1 (draws in the forward)"),
    ZooModel(name="llama", kind="decoder", build=_llama, batch=lm_batch, needs=HF,
             notes="rotary positions, RMSNorm, grouped-query attention, untied head"),
    ZooModel(name="qwen2", kind="decoder", build=_qwen2, batch=lm_batch, needs=HF,
             notes="biases on the query, key and value projections"),
    ZooModel(name="mistral", kind="decoder", build=_mistral, batch=lm_batch, needs=HF,
             notes="sliding-window attention (8 of 16 tokens)"),
    ZooModel(name="opt-layerdrop", kind="decoder", build=_opt_layerdrop, batch=lm_batch,
             needs=HF, notes="OPT, layerdrop 0.5: random layers sit out each step"),
    ZooModel(name="gpt-neox", kind="decoder", build=_gpt_neox, batch=lm_batch, needs=HF,
             notes="parallel attention and MLP residual, rotary on half the head"),
    ZooModel(name="phi", kind="decoder", build=_phi, batch=lm_batch, needs=HF,
             notes="one LayerNorm feeding parallel attention and MLP, partial rotary"),
    ZooModel(name="gemma", kind="decoder", build=_gemma, batch=lm_batch, needs=HF,
             notes="embeddings scaled by sqrt(width) in the hidden dtype, tied head, one KV head"),
    ZooModel(name="bert-unused-pooler", kind="encoder", build=_bert_pooler, batch=lm_batch,
             needs=HF, sits_out=("encoder.pooler.dense.weight", "encoder.pooler.dense.bias"),
             never_trained=("encoder.pooler.dense.weight", "encoder.pooler.dense.bias"),
             notes="AutoModel (BERT) with its pooler, a custom head on the token states"),
    ZooModel(name="roberta-mlm", kind="encoder", build=_roberta_mlm, batch=masked_lm_batch,
             needs=HF, notes="masked LM, decoder tied to the embeddings, padding-offset positions"),
    ZooModel(name="albert-shared", kind="encoder", build=_albert_shared, batch=masked_lm_batch,
             needs=HF, notes="one layer's parameters shared by all 4 layers, factorised embedding"),
    ZooModel(name="t5", kind="encoder-decoder", build=_t5, batch=seq2seq_batch, needs=HF,
             notes="reads weight.dtype in the forward, embeddings shared by encoder, decoder "
             "and head, relative position bias in the first layer only"),
    ZooModel(name="bart", kind="encoder-decoder", build=_bart, batch=seq2seq_batch, needs=HF,
             notes="shared embeddings, learned positions, final_logits_bias buffer"),
    ZooModel(name="mixtral", kind="mixture-of-experts", build=_mixtral, batch=lm_batch, needs=HF,
             notes="8 experts, top 2, experts as 3-D parameters indexed per expert"),
    ZooModel(name="switch-transformers", kind="mixture-of-experts", build=_switch,
             batch=_switch_batch, needs=HF,
             notes="8 expert modules, top 1, capacity 8; experts that get no tokens sit out"),
)  # fmt: skip
