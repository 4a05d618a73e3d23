"""The tokenizer gate: a verifier's tokenizer must give the prompt text back, and its decoded text must be text.

A tokenizer saved with the wrong class or pre-tokenizer (a GPT-2-style byte-level BPE vocabulary read as a
SentencePiece ``LlamaTokenizer``) encodes and decodes without an error, but every space is lost on the way in and
the byte-level pieces (``Ġ`` for a space, ``Ċ`` for a newline) come back undecoded: the verifier sees and writes
garbage and every later stage trains on it. This module checks, before any completion is generated:

- round trip: ``decode(encode(text))`` equals ``text`` for every text of the prompts, modulo what tokenizers
  document as lossless for text: Unicode normalisation (NFC, or NFKC where the tokenizer's normalizer applies it)
  and surrounding whitespace (a SentencePiece tokenizer's prefix space);
- no byte-level markers: decoded text holds none of the characters that GPT-2's ``bytes_to_unicode`` maps the
  space, newline and tab bytes to (``Ġ``, ``Ċ``, ``ĉ``), which a working byte-level decoder never leaves.

Both raise :class:`TokenizerGateError` naming the verifier and the first text that fails.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any

__all__ = [
    "BYTE_LEVEL_MARKERS",
    "TokenizerGateError",
    "check_decoded",
    "check_round_trip",
    "round_trip",
]

#: GPT-2's ``bytes_to_unicode`` images of the bytes 0x20 (space), 0x0A (newline) and 0x09 (tab): what byte-level
#: BPE pieces hold before the ByteLevel decoder turns them back into bytes.
BYTE_LEVEL_MARKERS = ("\u0120", "\u010a", "\u0109")  # Ġ Ċ ĉ


class TokenizerGateError(ValueError):
    """The verifier's tokenizer does not give text back; the message names the verifier and the text."""


def _normalizer_forms(tokenizer: Any) -> tuple[str, ...]:
    """The Unicode normal forms the tokenizer's own normalizer applies (``tokenizers`` NFC/NFD/NFKC/NFKD)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    norm = getattr(backend, "normalizer", None)
    text = repr(norm) if norm is not None else ""
    return tuple(form for form in ("NFKC", "NFKD", "NFC", "NFD") if form in text)


def round_trip(tokenizer: Any, text: str) -> str:
    """``decode(encode(text))`` without special tokens and without clean-up of spaces (what vLLM decodes).

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: any string.

    Returns:
        The decoded string.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _same_text(a: str, b: str, forms: tuple[str, ...]) -> bool:
    if a == b:
        return True
    for form in ("NFC", *forms):
        na, nb = unicodedata.normalize(form, a), unicodedata.normalize(form, b)
        if na == nb or na.strip() == nb.strip():
            return True
    return False


def _show(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_round_trip(tokenizer: Any, texts: Iterable[tuple[str, str]], verifier: str) -> int:
    """Refuse a tokenizer that does not give a prompt's text back.

    Args:
        tokenizer: the verifier's Hugging Face tokenizer (as the stage renders with it).
        texts: ``(where, text)`` pairs, ``where`` naming the text for the message (a prompt id, file and line).
        verifier: the verifier's path or id, for the message.

    Returns:
        How many texts were checked.

    Raises:
        TokenizerGateError: at the first text whose round trip differs (beyond Unicode normalisation and
            surrounding whitespace), or whose decoding holds byte-level BPE markers it did not have; the message
            names ``verifier``, ``where``, the text and what came back.
    """
    forms = _normalizer_forms(tokenizer)
    n = 0
    for where, text in texts:
        if not isinstance(text, str) or not text:
            continue
        n += 1
        back = round_trip(tokenizer, text)
        markers = [m for m in BYTE_LEVEL_MARKERS if m in back and m not in text]
        if markers or not _same_text(text, back, forms):
            why = f"byte-level BPE pieces ({', '.join(markers)}) left undecoded" if markers else "the text differs"
            raise TokenizerGateError(
                f"tokenizer gate: the tokenizer of the verifier {verifier} does not give {where} back "
                f"({why}): {_show(text)} came back as {_show(back)}. Its tokenizer files do not match its "
                "vocabulary (for a GGUF, the conversion lost the tokenizer); no completion was generated"
            )
    return n


def check_decoded(texts: Iterable[tuple[str, str]], verifier: str) -> int:
    """Refuse decoded verifier output that holds byte-level BPE markers (``Ġ``, ``Ċ``, ``ĉ``).

    Args:
        texts: ``(where, decoded text)`` pairs, e.g. a completion's row id and its ``completion_text``.
        verifier: the verifier's path or id, for the message.

    Returns:
        How many texts were checked.

    Raises:
        TokenizerGateError: at the first text with two or more marker characters (one alone may be a real
            character the model wrote), naming ``verifier`` and ``where``.
    """
    n = 0
    for where, text in texts:
        n += 1
        count = sum(text.count(m) for m in BYTE_LEVEL_MARKERS) if isinstance(text, str) else 0
        if count >= 2:
            raise TokenizerGateError(
                f"tokenizer gate: the verifier {verifier}'s decoded output {where} holds {count} byte-level BPE "
                f"markers (Ġ, Ċ, ĉ: spaces and newlines never decoded): {_show(text)}. Its tokenizer's decoder "
                "does not match its vocabulary"
            )
    return n
