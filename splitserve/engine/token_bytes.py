"""A token's own bytes, as OpenAI's logprobs report them (`bytes`): a byte-level token may hold part
of a UTF-8 character (Llama 3 and Qwen spell most CJK characters and emoji over two or three
tokens), which its decoded text can only show as U+FFFD; a client joins the bytes of consecutive
tokens to rebuild the text.

How a vocabulary's entries spell bytes is its decoder's (tokenizer.json's `decoder`):
- ByteLevel (GPT-2, Llama 3, Qwen): each byte is one printable character (`_BYTE_OF`);
- ByteFallback (Llama 2, Mistral, Gemma): a byte no entry covers is the entry `<0xAB>`, and the
  metaspace `▁` stands for a space.
Added tokens (special or not) are their text.
"""
from __future__ import annotations

import json
import re

import tokenizers

METASPACE = "\u2581"
_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """ByteLevel's alphabet: printable Latin-1 bytes spell themselves; the other 68 (controls, space,
    DEL, NBSP, soft hyphen ...) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_chars()


class TokenBytes:
    """`of(token_id)`: the bytes of one entry of a `tokenizers.Tokenizer`'s vocabulary."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self._tok = tok
        self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        decoder = "{}" if tok.decoder is None else tok.decoder.__getstate__().decode()
        kinds = _decoder_types(json.loads(decoder))
        self._byte_level = "ByteLevel" in kinds
        self._fallback = "ByteFallback" in kinds
        self._metaspace = METASPACE in decoder  # a Metaspace decoder, or a Replace of it by a space

    def of(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self._tok.get_vocab_size()}")
        if self._byte_level and all(c in _BYTE_OF for c in token):
            return bytes(_BYTE_OF[c] for c in token)
        if self._fallback and (byte := _FALLBACK.fullmatch(token)):
            return bytes([int(byte.group(1), 16)])
        return (token.replace(METASPACE, " ") if self._metaspace else token).encode()


def _decoder_types(decoder: dict) -> set[str]:
    """The decoder's type and, for a Sequence, its parts' types."""
    return {decoder.get("type", ""), *(t for part in decoder.get("decoders") or [] for t in _decoder_types(part))}
