"""Tokenizer glue: encoding, incremental detokenization and stop strings."""
import json
from pathlib import Path

from asynct.engine.outputs import Logprob
from asynct.engine.sequence import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:     # tokenizers before 0.21: the window decode below
    DecodeStream = None

# prompt tokens decoded before the output, as vLLM's detokenizer: a decoder that drops the
# leading space of a text's first word (SentencePiece's) must not drop the first output word's
CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # the Rust tokenizer itself where transformers' decode would add nothing (no space
        # clean-up): its wrapper costs twice the decoding, twice per generated token
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._decode = backend.decode if fast else self._slow_decode
        self._stream_backend = backend if fast and _streams() else None

    @classmethod
    def from_path(cls, path) -> "Detokenizer | None":
        """None where the checkpoint has no tokenizer files: token-id prompts still work."""
        p = Path(path)
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        try:
            return cls(_load_tokenizer(p))
        except Exception as e:  # noqa: BLE001  (a broken file raised KeyError, JSONDecodeError naming
            # no file, or tokenizers' own Exception: a traceback, or a line the user could not place)
            raise ValueError(f"the tokenizer files in {p} cannot be loaded ({type(e).__name__}: {e}); "
                             "fix or remove them (without them only token-id prompts work)") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text prompts get the tokenizer's special tokens (a Llama-style BOS), as vLLM and HF
        tokenize them: the model was trained on them. False for text that already has them
        written, a rendered chat template."""
        if not text and not add_special_tokens:
            return []
        check_unicode(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)    # "": [BOS], as vLLM

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def _slow_decode(self, ids, skip_special_tokens=True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _context(self, seq: Sequence) -> tuple[int, str]:
        """Where decoding starts and the text before the output there: a few prompt tokens
        before the output; at the output where those end in an unfinished character (output
        bytes finishing it would be lost in it)."""
        n = seq.num_prompt_tokens
        start = max(0, n - CONTEXT_TOKENS)
        tail = self.decode(seq.token_ids[start:n], seq.params.skip_special_tokens)
        return (n, "") if tail.endswith("\ufffd") else (start, tail)

    def decode_output(self, seq: Sequence, end: int) -> str:
        """The text of seq's tokens up to `end`, past its prompt, decoded after the prompt's context."""
        start, context = self._context(seq)
        return self.decode(seq.token_ids[start:end], seq.params.skip_special_tokens)[len(context):]

    def annotate(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        for tid, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self._decode([tid], skip_special_tokens=False)
        return entry

    def step(self, seq: Sequence) -> bool:
        """Extends seq.text by the newest token (holding back incomplete UTF-8); True when a
        stop string appeared, after cutting the text there. Called once for each token appended
        (StepFinishMixin). As vLLM, the text of the first min_tokens tokens is not searched:
        generation goes on after it, so a cut there would lose text from the middle of the output."""
        if self._stream_backend is not None and seq.detok_stream is not False:
            new = self._stream_text(seq)
        else:
            new = self._window_text(seq)
        if not new:
            return False
        start = len(seq.text)
        seq.text += new
        if len(seq.token_ids) - seq.num_prompt_tokens <= seq.params.min_tokens:
            return False
        return self._cut_at_stop(seq, start, new)

    def _stream_text(self, seq: Sequence) -> str | None:
        """The newest token's text by the Rust tokenizer's own incremental decoder: one call a
        token, where the window decode makes two decodes and their slicing in Python (1.4x the
        host time a token on a CI core; an evaluation with stop strings decodes every token of
        every sequence, ~220 a step on gsm8k). It keeps the window's offsets as it goes, so that
        a sequence whose stream fails goes on by the window decode, as if it always had: a
        byte-fallback decoder (Llama's) turns bytes it showed as text into U+FFFD once they
        prove invalid UTF-8, and the stream, whose text only grows, raises there."""
        ids, stream = seq.token_ids, seq.detok_stream
        if stream is None:    # started on the prompt's tail, as the window decode
            seq.detok_prefix_offset = start = self._context(seq)[0]
            seq.detok_stream = stream = DecodeStream(ids=ids[start:seq.num_prompt_tokens],
                                                     skip_special_tokens=seq.params.skip_special_tokens)
        try:
            new = stream.step(self._stream_backend, ids[-1])
        except Exception:   # noqa: BLE001  (tokenizers' "invalid prefix")
            seq.detok_stream = False
            return self._window_text(seq)
        if new:
            seq.detok_prefix_offset, seq.detok_read_offset = seq.detok_read_offset, len(ids)
        return new

    def _window_text(self, seq: Sequence) -> str | None:
        """The text the newest tokens add, as the difference of two decodes: of the tokens since
        the last complete text, with and without the newest. For tokenizers without a Rust
        incremental decoder (transformers' space clean-up, tokenizers before 0.21)."""
        ids, skip = seq.token_ids, seq.params.skip_special_tokens
        if seq.detok_read_offset == seq.num_prompt_tokens and seq.detok_stream is None:
            seq.detok_prefix_offset = self._context(seq)[0]     # no text yet: start in the prompt
        prefix = self.decode(ids[seq.detok_prefix_offset:seq.detok_read_offset], skip)
        full = self.decode(ids[seq.detok_prefix_offset:], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        seq.detok_prefix_offset, seq.detok_read_offset = seq.detok_read_offset, len(ids)
        return full[len(prefix):]

    @staticmethod
    def _cut_at_stop(seq: Sequence, new_from: int, new: str) -> bool:
        """`new`: the text from new_from, which any stop found now ends in: a stop whose last
        character it lacks is not searched for (most tokens, most stops)."""
        text = seq.text
        for stop in seq.params.stop_list:
            if stop[-1] not in new:
                continue
            idx = text.find(stop, max(0, new_from - len(stop) + 1))
            if idx >= 0:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.text, seq.stop_reason = text[:end], stop
                return True
        return False


def _streams() -> bool:
    """Whether the installed tokenizers has a DecodeStream that starts on given token ids."""
    if DecodeStream is None:
        return False
    try:
        DecodeStream(ids=[], skip_special_tokens=True)
    except TypeError:
        return False
    return True


def check_unicode(text: str, what: str = "the text"):
    """ValueError where `text` holds a lone surrogate ("\ud800", which Python strings may hold):
    the Rust tokenizer raised a TypeError about its input types for it, which failed a whole
    LLM.generate call rather than the one prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} {text!r:.40} is not valid Unicode (a lone surrogate at character {e.start}), "
                         "so it cannot be tokenised") from None


GENERIC_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}   # no model-specific code


def _load_tokenizer(p: Path):
    if (p / "tokenizer.json").exists() and _tokenizer_class(p) in GENERIC_CLASSES:
        # a plain tokenizer.json: AutoTokenizer would load the same class, after importing
        # every model family's config (3 s of a 3.1 s engine start on a CPU)
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(p)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(p)


def _tokenizer_class(path: Path):
    config = path / "tokenizer_config.json"
    return json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
