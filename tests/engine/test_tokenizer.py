"""Tokenizers against transformers' AutoTokenizer, and incremental detokenization with stop strings."""
import json
import threading
import time

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from splitserve.engine.loader import CheckpointError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, load_tokenizer

CORPUS = ["hello world, héllo wörld", "你好世界 the quick brown fox 🦊", "stop here. STOP there."] * 20
TEXTS = ["hello world", "héllo 你好 🦊 fox", "  spaced  out ", "<s> literal special </s>", ""]


def train_bpe() -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no_bos"])
def hf_dir(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=train_bpe(), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            add_bos_token=request.param, chat_template="{{ messages }}").save_pretrained(path)
    return path


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode([256, 104, 105, 257, 258], skip_special_tokens=False) == "<s>hi</s><pad>"
    assert tok.decode([0xE4, 0xBD]) == "\ufffd"
    with pytest.raises(ValueError, match="token id 300"):
        tok.decode([300])


def test_hf_tokenizer_matches_transformers(hf_dir):
    ours, ref = load_tokenizer(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id and ours.eos_token_ids == (ref.eos_token_id,)
    assert ours.chat_template == "{{ messages }}"


def test_long_inputs_take_the_batch_calls_with_the_same_result(hf_dir):
    ours, ref = load_tokenizer(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    text = " ".join(TEXTS) * (ours.RELEASE_GIL_CHARS // 10)
    ids = ref.encode(text)
    assert len(text) > ours.RELEASE_GIL_CHARS and len(ids) > ours.RELEASE_GIL_IDS
    assert ours.encode(text) == ids
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def ticks_while(work) -> int:
    """How often this thread wakes from 1 ms sleeps while `work` runs in another thread."""
    worker, ticks = threading.Thread(target=work), 0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        ticks += 1
    return ticks


@pytest.mark.quiet
def test_long_encode_and_decode_let_other_threads_run(tmp_path):
    """A server encodes prompts in a thread so that its event loop goes on: the call must release
    the GIL (the single calls hold it, and the loop woke 1-2 times in 1.7 s of encoding)."""
    train_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = CORPUS[0] * 40_000  # 1M characters, about 1 s to encode here
    ids = []
    assert ticks_while(lambda: ids.extend(tok.encode(text))) >= 20
    assert ticks_while(lambda: tok.decode(ids * 4)) >= 5


@pytest.mark.parametrize("add_bos", [True, False])
def test_config_add_bos_token_is_ignored_like_transformers_5(tmp_path, add_bos):
    train_bpe().save(str(tmp_path / "tokenizer.json"))  # no post-processor
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "add_bos_token": add_bos,
              "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
              "chat_template": [{"name": "default", "template": "T"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = HFTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.encode("hi")[0] != ours.bos_token_id == 0
    assert ours.chat_template == "T"


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: file not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizers file"):
        load_tokenizer(tmp_path)
    train_bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: malformed JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json: eos_token '<nope>' is not in"):
        load_tokenizer(tmp_path)


def run_detok(tok, ids, prompt=(), **params):
    detok = Detokenizer(tok, SamplingParams(**params), list(prompt))
    seen = []
    for i in ids:
        stopped = detok.append(i)
        seen.append(detok.text)
        if stopped:
            break
    return detok, seen


def test_multibyte_char_split_across_tokens_never_shows_replacement():
    tok = ByteTokenizer()
    text = "a你🦊b"
    detok, seen = run_detok(tok, tok.encode(text, add_special_tokens=False), prompt=tok.encode("x"))
    assert detok.text == text
    assert not any("\ufffd" in s for s in seen)
    assert seen[:4] == ["a", "a", "a", "a你"]  # the 3 bytes of 你 appear at once


def test_detokenizer_skips_special_tokens_by_default():
    tok = ByteTokenizer()
    assert run_detok(tok, [104, 257, 105])[0].text == "hi"
    assert run_detok(tok, [104, 257, 105], skip_special_tokens=False)[0].text == "h</s>i"


@pytest.mark.parametrize("include, expected", [(False, "say hi "), (True, "say hi STOP")])
def test_stop_string_truncates(include, expected):
    tok = ByteTokenizer()
    ids = tok.encode("say hi STOP and more", add_special_tokens=False)
    detok, seen = run_detok(tok, ids, stop=["STOP", "never"], include_stop_str_in_output=include)
    assert detok.text == expected and detok.stopped
    assert len(seen) == len("say hi STOP")  # stopped at the token that completed the stop string
    assert detok.append(ord("x")) and detok.text == expected


def test_stop_string_spanning_hf_tokens(hf_dir):
    tok = load_tokenizer(hf_dir)
    ids = tok.encode("hello world, héllo wörld", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any(len(p) > 1 for p in pieces)  # multi-character tokens, so the stop may span them
    detok, seen = run_detok(tok, ids, prompt=tok.encode("stop here."), stop=["o wo", "éll"])
    assert detok.text == "hell" and detok.stopped
    full, _ = run_detok(tok, ids, prompt=tok.encode("stop here."))
    assert full.text == "hello world, héllo wörld" and not full.stopped


def test_earliest_stop_string_wins_within_one_token():
    tok = ByteTokenizer()
    tok_ids = tok.encode("ab", add_special_tokens=False)
    detok, _ = run_detok(tok, tok_ids, stop=["b", "ab"])
    assert detok.text == ""


def test_prompt_context_keeps_sentencepiece_leading_space(tmp_path):
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # strips the space of the first token of a decode
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=40))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path)
    prompt, output = hf.encode("hello"), hf.encode(" world")
    assert hf.decode(output) == "world"
    assert run_detok(hf, output, prompt=prompt)[0].text == " world"
