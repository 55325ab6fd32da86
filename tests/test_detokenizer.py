"""Output text as vLLM's detokenizer gives it, for tokenizers other than the shipped byte one,
and the incremental decode against its reference."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asynct import LLM, SamplingParams
from asynct.engine.detokenizer import Detokenizer
from asynct.engine.sequence import Sequence
from asynct.model.checkpoint import make_checkpoint
from asynct.model.tokenizer import byte_tokenizer

PROMPT = {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def word_llm(tmp_path_factory):
    """The tiny checkpoint with a SentencePiece-style tokenizer: each token is a word with its
    leading space written "▁", which the decoder drops at the start of a text (Llama's does)."""
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("words"), seed=1)
    _word_tokenizer().save_pretrained(path)
    return LLM(path)


@pytest.mark.parametrize("stop", [None, ["never"]])
def test_the_first_output_word_keeps_its_leading_space(word_llm, stop):
    """As vLLM: output text is decoded after the prompt, so prompt text + output text reads as
    the whole sequence decoded. Decoded alone, the first word lost its space ("w5 w9", not " w5 w9"),
    whether the text was decoded at the finish or token by token (a stop string)."""
    out = word_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=stop),
                            use_tqdm=False)[0].outputs[0]
    assert out.text == "".join(f" w{t}" for t in out.token_ids)


def _word_tokenizer():
    """Words "▁w0".."▁w255" (SentencePiece-style spaces) and three specials."""
    vocab = {f"▁w{i}": i for i in range(256)} | {"<eos>": 256, "<pad>": 257, "<bos>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                                   clean_up_tokenization_spaces=False)


def _texts(detok, prompt, outputs, params):
    """seq.text after each output token, and whether a stop string ended it there."""
    seq = Sequence(0, "r", 0, prompt, params, 16)
    texts = []
    for t in outputs:
        seq.append_token(t)
        texts.append((detok.step(seq), seq.text))
        if texts[-1][0]:
            break
    return texts


def _byte_fallback_tokenizer():
    """Llama-2's kind: words with "▁" for their space, bytes as <0xNN> tokens, whose decoder turns
    bytes shown as text into U+FFFD once they prove invalid UTF-8 (the stream then fails)."""
    vocab = [(f"<0x{b:02X}>", 0.0) for b in range(256)] + [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(w, -1.0) for w in ("▁the", "▁a", "▁cat", "▁sat", "▁on", "the", "cat", "▁", ".")]
    tok = Tokenizer(models.Unigram(vocab, unk_id=256, byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("make,vocab", [(byte_tokenizer, 259), (_word_tokenizer, 259), (_byte_fallback_tokenizer, 268)])
@pytest.mark.parametrize("skip", [True, False])
def test_the_streamed_text_is_the_window_decodes_token_by_token(make, vocab, skip):
    """The Rust incremental decoder (one call a token) against the two-decode window it replaced,
    over random outputs that split multi-byte characters, hold special tokens (skipped or not),
    make invalid UTF-8 (a byte-fallback decoder's stream fails: the window decode goes on) and
    end at a stop string: the same text after every token."""
    stream = Detokenizer(make())
    window = Detokenizer(make())
    window._stream_backend = None
    assert stream._stream_backend is not None     # this venv's tokenizers has DecodeStream
    rng = random.Random(0)
    for case in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))] or [vocab - 1]
        outputs = [rng.choice([rng.randrange(256), rng.randrange(128, 256), rng.randrange(256, vocab)])
                   for _ in range(rng.randint(1, 40))]
        stop = [stream.decode(outputs[5:7], skip)] if case % 3 == 0 and len(outputs) > 7 else []
        params = SamplingParams(max_tokens=64, skip_special_tokens=skip, stop=[s for s in stop if s])
        assert _texts(stream, prompt, outputs, params) == _texts(window, prompt, outputs, params), case


def test_a_sequence_whose_stream_fails_goes_on_by_the_window_decode():
    """A decoder whose longer text does not extend its shorter one breaks the stream's state
    (tokenizers raises "invalid prefix"): the window decode takes over from the stream's offsets,
    the failing token's text included, rather than the request failing."""
    detok = Detokenizer(byte_tokenizer())
    seq = Sequence(0, "r", 0, [65], SamplingParams(max_tokens=8), 16)
    for t in b"ab":
        seq.append_token(t)
        detok.step(seq)

    class Broken:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")
    seq.detok_stream = Broken()
    for t in b"cd":
        seq.append_token(t)
        detok.step(seq)
    assert seq.text == "abcd" and seq.detok_stream is False


def test_a_stop_is_searched_only_where_the_new_text_can_end_it():
    """_cut_at_stop skips a stop whose last character the new text lacks: over random texts, stops
    and splits it cuts where a plain search of every stop from the new text's reach does."""
    rng = random.Random(0)

    def plain(text, new_from, stops, include):
        for stop in stops:
            idx = text.find(stop, max(0, new_from - len(stop) + 1))
            if idx >= 0:
                return text[:idx + len(stop) if include else idx], stop
        return text, None
    for case in range(2000):
        text = "".join(rng.choice("ab:Q\n ") for _ in range(rng.randint(1, 30)))
        new_from = rng.randrange(len(text))
        stops = ["".join(rng.choice("ab:Q\n ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        seq = Sequence(0, "r", 0, [1], SamplingParams(max_tokens=8, stop=stops, include_stop_str_in_output=include), 16)
        seq.text = text
        found = Detokenizer._cut_at_stop(seq, new_from, text[new_from:])
        assert (seq.text, seq.stop_reason) == plain(text, new_from, stops, include), case
        assert found == (seq.stop_reason is not None)


@pytest.mark.parametrize("name,text", [("tokenizer.json", '{"model": {"type": "BPE"}}'), ("tokenizer.json", ""),
                                       ("tokenizer_config.json", "{")])
def test_a_broken_tokenizer_file_is_one_error_naming_the_folder(tmp_path, name, text):
    """A tokenizer.json without added_tokens raised a bare KeyError ('added_tokens'); unreadable
    JSON, json's "Expecting value: line 1 column 1" naming no file."""
    path = make_checkpoint("tiny", tmp_path / "ck", seed=1)
    (path / name).write_text(text)
    with pytest.raises(ValueError, match=f"^the tokenizer files in {path} cannot be loaded"):
        Detokenizer.from_path(path)
