"""Tokenizers (a byte-level one for the demo model, Hugging Face `tokenizer.json` for checkpoints)
and the per-request incremental detokenizer that also finds stop strings."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from splitserve.engine.loader import CheckpointError, read_json
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.token_bytes import TokenBytes

# Prompt tokens decoded in front of the output, so that tokenizers whose decoding depends on the
# left context (SentencePiece's leading space) render the first output token as they would mid-text.
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(ABC):
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (part of a UTF-8 character, for some), as logprobs report them."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def chat_template(self) -> str | None: ...


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; 256 = `<s>`, 257 = `</s>`, 258 = `<pad>`. Text is never parsed for
    special tokens: "<s>" in a prompt is three bytes."""

    BOS, EOS, PAD = 256, 257, 258
    SPECIALS = {BOS: "<s>", EOS: "</s>", PAD: "<pad>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
            elif i in self.SPECIALS:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                parts.append("" if skip_special_tokens else self.SPECIALS[i])
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary of {self.vocab_size}")
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def chat_template(self) -> str | None:
        return None


class HFTokenizer(Tokenizer):
    """`<path>/tokenizer.json` plus the optional `tokenizer_config.json` and `chat_template.jinja`.

    Encoding follows tokenizer.json as written (transformers 5's AutoTokenizer may rebuild parts of
    it for some model types; real checkpoints' tokenizer.json already agrees). Special tokens
    around the text come from tokenizer.json's post-processor alone: `add_bos_token` and
    `add_eos_token` in tokenizer_config.json are ignored, as transformers 5 ignores them whenever
    a tokenizer.json exists (it bakes them into the post-processor on save instead).
    """

    def __init__(self, path: str | Path):
        root = Path(path)
        self._tok = _read_tokenizer_json(root / "tokenizer.json")
        cfg_file = root / "tokenizer_config.json"
        cfg = read_json(cfg_file) if cfg_file.is_file() else {}
        self._bos = self._token_id(cfg, "bos_token", cfg_file)
        eos = self._token_id(cfg, "eos_token", cfg_file)
        self._eos = () if eos is None else (eos,)
        self._chat_template = _read_chat_template(root, cfg)
        self._token_bytes = TokenBytes(self._tok)

    # Inputs past these sizes (about 1 ms of work) go through the batch calls, which release the
    # GIL while they run: the single calls hold it, so a 1M-character prompt encoded in a server's
    # thread stalled its event loop for the whole 1.7 s. Below them the single calls' lower
    # overhead wins (the detokenizer decodes a few ids per token).
    RELEASE_GIL_CHARS = 1024
    RELEASE_GIL_IDS = 2048

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.RELEASE_GIL_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > self.RELEASE_GIL_IDS:
            return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes.of(token_id)

    def to_json(self) -> str:
        """The tokenizer.json text (for libraries that build their own view of the vocabulary)."""
        return self._tok.to_str()

    @property
    def added_tokens(self) -> frozenset[str]:
        """The texts of tokenizer.json's added tokens (special or not: Qwen3's `<think>` is one),
        each always encoded as its own token."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def _token_id(self, cfg: dict, field: str, cfg_file: Path) -> int | None:
        token = cfg.get(field)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{cfg_file}: {field} {token!r} is not in the tokenizer's vocabulary")
        return token_id


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the checkpoint directory `path` (its `tokenizer.json`)."""
    return HFTokenizer(path)


class Detokenizer:
    """Incremental detokenization and stop-string detection for one request.

    Decodes a sliding window of tokens (vLLM's prefix/read offsets), so each step costs a few
    tokens, not the whole output. Text ending in U+FFFD (an incomplete UTF-8 character) is held back
    until a later token completes it. As in vLLM, the stop token that ends a sequence (EOS or one of
    `stop_token_ids`) adds no text unless `include_stop_str_in_output`, special or not.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._params = params
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.text = ""
        self.stopped = False

    def append(self, token_id: int, ends_stop: bool = False) -> bool:
        """Add one output token; True when a stop string was hit (then `.text` is final).
        `ends_stop`: the sequence ended with this token for "stop": either a stop string ends in it
        (found here) or it is a stop token, whose text is dropped."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        old_len = len(self.text)
        self.text += self._next_delta()
        if self._max_stop_len and len(self.text) > old_len:
            self.stopped = self._truncate_at_stop(old_len)
        if ends_stop and not self.stopped and not self._params.include_stop_str_in_output:
            self.text = self.text[:old_len]
        return self.stopped

    def _next_delta(self) -> str:
        decode = self._tokenizer.decode
        skip = self._params.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _truncate_at_stop(self, old_len: int) -> bool:
        """Find the earliest stop string that ends in the new text; cut `.text` at it."""
        start = max(0, old_len - self._max_stop_len + 1)
        hits = [(i, s) for s in self._params.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[:index + len(stop)] if self._params.include_stop_str_in_output else self.text[:index]
        return True


def _read_tokenizer_json(file: Path) -> tokenizers.Tokenizer:
    if not file.is_file():
        raise CheckpointError(f"{file}: file not found")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for unparsable files
        raise CheckpointError(f"{file}: not a valid tokenizers file ({exc})") from exc


def _read_chat_template(root: Path, cfg: dict) -> str | None:
    """`chat_template.jinja` (what transformers 5 writes) wins over tokenizer_config's field,
    which may also be a list of named templates; the one named "default" is used."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template
