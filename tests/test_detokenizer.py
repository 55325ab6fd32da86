"""Output text as vLLM's detokenizer gives it, for tokenizers other than the shipped byte one."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint

PROMPT = {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def word_llm(tmp_path_factory):
    """The tiny checkpoint with a SentencePiece-style tokenizer: each token is a word with its
    leading space written "▁", which the decoder drops at the start of a text (Llama's does)."""
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("words"), seed=1)
    vocab = {f"▁w{i}": i for i in range(256)} | {"<eos>": 256, "<pad>": 257, "<bos>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                            clean_up_tokenization_spaces=False).save_pretrained(path)
    return LLM(path)


@pytest.mark.parametrize("stop", [None, ["never"]])
def test_the_first_output_word_keeps_its_leading_space(word_llm, stop):
    """As vLLM: output text is decoded after the prompt, so prompt text + output text reads as
    the whole sequence decoded. Decoded alone, the first word lost its space ("w5 w9", not " w5 w9"),
    whether the text was decoded at the finish or token by token (a stop string)."""
    out = word_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=stop),
                            use_tqdm=False)[0].outputs[0]
    assert out.text == "".join(f" w{t}" for t in out.token_ids)
