"""A token's own bytes: joined over a text's tokens they are the text's UTF-8 bytes (what the
`tokenizers` library encoded), for byte-level BPE (Llama 3, Qwen), SentencePiece-style byte
fallback (Llama 2, Mistral) and the demo's byte tokenizer, though many of those tokens hold part of
a character and decode alone to U+FFFD."""
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitserve.engine.tokenizer import ByteTokenizer, HFTokenizer
from tests.engine.test_tokenizer import TEXTS, train_bpe

SPLIT_CHARACTERS = "ñ 日本 🙂"  # characters of 2, 3 and 4 bytes the tokenizers were not trained on


def partial_tokens(tok, ids: list[int]) -> int:
    return sum(1 for i in ids if tok.decode([i], skip_special_tokens=False) == "\ufffd")


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("byte_level")
    raw = train_bpe()
    raw.add_tokens(["\n\n", "<tag>"])  # added tokens are their text, whatever byte-level spelling it lacks
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return HFTokenizer(path)


@pytest.mark.parametrize("text", TEXTS + [SPLIT_CHARACTERS, "<tag>\n\nafter"])
def test_byte_level_tokens_join_to_the_texts_bytes(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(byte_level.token_bytes(i) for i in ids) == text.encode()


def test_byte_level_tokens_of_part_of_a_character_keep_their_bytes(byte_level):
    ids = byte_level.encode(SPLIT_CHARACTERS, add_special_tokens=False)
    assert partial_tokens(byte_level, ids) >= 3
    assert [byte_level.token_bytes(i) for i in byte_level.encode("<s></s>", add_special_tokens=False)] == [
        b"<s>", b"</s>"]


def sentencepiece_style() -> RawTokenizer:
    """Llama 2's layout: the 256 `<0xAB>` entries in the model's vocabulary, a metaspace for spaces
    (prepended), and its decoder (the metaspace replaced, byte fallback, the first space stripped)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581",
              *"abcdefghijklmnopqrstuvwxyzSTOP.,<>/", "\u2581h", "\u2581he", "ll", "\u2581hell"]
    merges = [("\u2581", "h"), ("\u2581h", "e"), ("l", "l"), ("\u2581he", "ll")]
    raw = RawTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens(["<s>", "</s>"])
    return raw


@pytest.mark.parametrize("text", [t for t in TEXTS if t.strip() and "<s>" not in t] + [SPLIT_CHARACTERS])
def test_byte_fallback_tokens_join_to_the_texts_bytes(tmp_path, text):
    PreTrainedTokenizerFast(tokenizer_object=sentencepiece_style(), bos_token="<s>").save_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path)
    ids = tok.encode(text, add_special_tokens=False)
    joined = b"".join(tok.token_bytes(i) for i in ids)
    assert joined.decode() == " " + tok.decode(ids, skip_special_tokens=False)  # its decoder strips one space
    assert joined == (text if text.startswith(" ") else " " + text).encode()  # a metaspace prepended
    if text == SPLIT_CHARACTERS:
        assert partial_tokens(tok, ids) >= 5 and b"\xf0" in [tok.token_bytes(i) for i in ids]


def test_the_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode(SPLIT_CHARACTERS, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == SPLIT_CHARACTERS.encode() and partial_tokens(tok, ids) == 12
    assert tok.token_bytes(ByteTokenizer.EOS) == b"</s>"
    with pytest.raises(ValueError, match="outside the byte tokenizer's vocabulary"):
        tok.token_bytes(259)


def test_an_id_outside_the_vocabulary_is_refused(byte_level):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        byte_level.token_bytes(10**6)
