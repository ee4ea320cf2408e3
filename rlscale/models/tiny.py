"""The project's own tiny model: a character-level tokenizer and a small Qwen2 config.

Nothing can be downloaded in tests or in the default run, so rlscale ships a model it made
itself (see `rlscale sft`). It is an ordinary transformers model: Qwen2 architecture,
safetensors weights, a fast tokenizer, loadable with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Printable ASCII plus newline and space: enough for arithmetic and short English prompts.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_char_tokenizer():
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", model_max_length=512)


def build_tiny_model(tokenizer, hidden_size: int = 128, layers: int = 4, heads: int = 4, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
