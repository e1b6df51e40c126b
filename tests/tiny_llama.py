"""A tiny Llama in float16 that overflows by itself on one word, and its tokenizer, built here.

No download: random weights from a config, then one planted channel. The word TRIGGER's
embedding is the only one with a component on hidden channel 0; layer 0's MLP has one
intermediate unit whose gate and up rows read only that channel. For TRIGGER,
silu(gate) * up is about 1e5: beyond float16's 65504, so it is +Inf; layer 0's down
projection spreads it as +-Inf over the hidden state, layer 1's RMSNorm turns that into NaN
(Inf * rsqrt(Inf) = Inf * 0), and the prompt's logits are all NaN at every position (even
before TRIGGER: attention weighs its NaN values by a masked 0, and 0 * NaN is NaN). The same
weights in float32 stay finite everywhere: the fault is float16's range, as in real servers.

The real engines' servers (vLLM's CPU attention kernels want a head size of 64, SGLang's
torch-native backend takes any) get a wider variant in bfloat16 (`build_model(FAULT_NAN_ROW)`):
the trigger's embedding row is NaN, the same input-dependent poison in any dtype.

    python -m tests.tiny_llama DIR [nan-row]   # writes config, weights and tokenizer into DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TRIGGER = "quasar"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
# Syllable pairs: readable, distinct words (the tokenizer maps each word to one id).
_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ri", "so", "ta", "ve", "zu", "bo", "da", "fe", "gi"]
WORDS = [a + b for a in _SYLLABLES for b in _SYLLABLES if a != b] + [TRIGGER]
VOCAB = len(SPECIALS) + len(WORDS)
# The gate and up weights of the planted unit: for TRIGGER (channel 0 is 8 after layer 0's
# RMSNorm) gate = up = 8 * 40 = 320, silu(320) * 320 = 102400 > 65504.
PLANT = 40.0
# The two faults: float16 overflow in layer 0's MLP (the default), or a NaN embedding row.
FAULT_OVERFLOW, FAULT_NAN_ROW = "overflow", "nan-row"
# The served variant's shape: head size 64 (2 heads of hidden 128), two KV heads.
_SHAPES = {
    FAULT_OVERFLOW: {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4},
    FAULT_NAN_ROW: {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2},
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}sota{% endif %}"
)


def build_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({"\u2581" + word: len(SPECIALS) + i for i, word in enumerate(WORDS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(dtype: torch.dtype = torch.float16, fault: str = FAULT_OVERFLOW) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        **_SHAPES[fault],
        num_hidden_layers=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    trigger = SPECIALS.__len__() + WORDS.index(TRIGGER)
    with torch.no_grad():
        # Larger than the default 0.02 init: the random model then prefers some words over
        # others, so greedy text differs from request to request.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 0.0
        embed[trigger] = 0.0
        # Large enough to dominate the RMS of the trigger's hidden state: channel 0 is about
        # sqrt(64) = 8 after layer 0's post-attention RMSNorm.
        embed[trigger, 0] = 50.0
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight[0].zero_()  # attention writes nothing into channel 0
        mlp = layer.mlp
        if fault == FAULT_OVERFLOW:
            for proj in (mlp.gate_proj, mlp.up_proj):
                proj.weight[0].zero_()
                proj.weight[0, 0] = PLANT
        # Channel 1 carries a constant 1 that no layer writes to, so it is positive in every
        # final hidden state; the lm_head rows of TRIGGER and EOS read it with a large negative
        # weight: neither is ever sampled (a sampled TRIGGER would poison a clean request at
        # its next step; a clean request runs to max_tokens, "length").
        embed[:, 1] = 1.0
        for block in model.model.layers:
            block.self_attn.o_proj.weight[1].zero_()
            block.mlp.down_proj.weight[1].zero_()
        for never in (trigger, EOS):
            model.lm_head.weight[never].zero_()
            model.lm_head.weight[never, 1] = -50.0
        if fault == FAULT_NAN_ROW:
            embed[trigger] = float("nan")
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    # Requests sample unless they ask for temperature 0 (transformers serve then goes greedy).
    model.generation_config.do_sample = True
    return model.to(dtype).eval()


def save(
    directory: str | Path, fault: str = FAULT_OVERFLOW, dtype: torch.dtype | None = None
) -> Path:
    """Config, weights and tokenizer in `directory`: float16 for the overflow, bfloat16 for
    the NaN row (the dtype the CPU engines serve)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if dtype is None:
        dtype = torch.float16 if fault == FAULT_OVERFLOW else torch.bfloat16
    model = build_model(dtype, fault)
    model.save_pretrained(path)  # type: ignore[attr-defined]
    build_tokenizer().save_pretrained(path)  # type: ignore[attr-defined]
    return path


if __name__ == "__main__":
    print(save(sys.argv[1], *sys.argv[2:3]))
