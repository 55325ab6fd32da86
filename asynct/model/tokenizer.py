"""A byte-level tokenizer (256 byte tokens + 3 specials) for tiny checkpoints, built with `tokenizers`."""
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<|bos|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte, so byte i is token i."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({EOS: 256, PAD: 257, BOS: 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=BOS,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def save_byte_tokenizer(out_dir) -> Path:
    tok = byte_tokenizer()
    tok.save_pretrained(out_dir)
    return Path(out_dir)
