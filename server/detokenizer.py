"""Incremental detokenization and stop-string matching.

`IncrementalDetokenizer` turns a growing list of token ids into text pieces whose concatenation
is exactly `tokenizer.decode(all_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
(clean-up rewrites text across token boundaries, so it can never be streamed exactly; the server
never applies it). It decodes a small window of ids — the previously emitted piece as context
plus the unread ids — and emits the new part of that window's text only once it no longer ends
in U+FFFD, i.e. once the byte stream of a byte-level BPE ends on a UTF-8 character boundary.
A character split over several tokens is therefore never emitted as replacement characters.
Only at the end (`flush`) is an incomplete trailing sequence emitted as the tokenizer decodes it.

The hold is bounded. U+FFFD is also what invalid bytes decode to for good: a model that emits a
run of stray byte tokens (a random or broken model, or a sampled one at high temperature) would
keep the window ending in U+FFFD for ever, so the client would get no text until the end and each
step would decode a window as long as the output so far. A character's bytes number at most four,
so once the held ids hold more than an incomplete character can, the text up to the last
INCOMPLETE_MAX_BYTES ordinary ids is final (those ids hold every byte that could still change it)
and is emitted, replacement characters and all, as decoding everything at once gives them.

`StopStringMatcher` finds stop strings across piece boundaries. It holds back the longest suffix
of the unemitted text that is a prefix of some stop string, so no part of a stop string is ever
emitted: if a stop string started inside already-emitted text, that text would have been a
prefix of it and would have been held back.
"""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"
# The most bytes of an incomplete UTF-8 character (a four-byte character less its last byte).
INCOMPLETE_MAX_BYTES = 3


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (start of the last emitted piece)
        self._read_offset = 0    # ids[:read_offset] are fully reflected in the emitted text
        self.text = ""           # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text that became final (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """No more ids will come: return whatever is still held back (may end in U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.tokenizer is None or self._read_offset == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if not final and window.endswith(REPLACEMENT_CHAR):
            return self._release_settled(context, window)  # wait for the bytes that finish it
        if len(window) <= len(context):
            # Nothing new yet (e.g. only skipped special tokens); keep the window as it is.
            if final:
                self._read_offset = len(self.token_ids)
            return ""
        return self._emit(window[len(context):], len(self.token_ids))

    def _emit(self, delta: str, read_to: int) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = read_to
        self.text += delta
        return delta

    def _release_settled(self, context: str, window: str) -> str:
        """The window ends in U+FFFD: emit the text before the last INCOMPLETE_MAX_BYTES ordinary ids
        where no later byte can change it any more (none while the held ids are that few)."""
        ids, last_cut, ordinary = self.token_ids, len(self.token_ids), 0
        special = _special_ids(self.tokenizer)
        while last_cut > self._read_offset and ordinary < INCOMPLETE_MAX_BYTES:
            last_cut -= 1
            ordinary += ids[last_cut] not in special
        # A cut inside a character that the ids after it complete would decode that character as
        # U+FFFD on its left: the text left of a good cut is where the whole window has it.
        for cut in range(last_cut, self._read_offset, -1):
            settled = self._decode(ids[self._prefix_offset : cut])
            if len(settled) > len(context) and window.startswith(settled):
                return self._emit(settled[len(context):], cut)
        return ""


@lru_cache(maxsize=8)
def _special_ids(tokenizer) -> frozenset[int]:
    """Ids that decode to no bytes of the stream (special tokens): they cannot finish a character.
    Once per tokenizer, not per request: a transformers tokenizer builds the list on each access."""
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ())


class StopStringMatcher:
    """Feed text pieces, get back the part that is safe to emit and the stop string that matched."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must not be empty")
        self.stop = list(dict.fromkeys(stop))  # de-duplicated, order kept
        self.include = include_stop_str_in_output
        self._pending = ""  # text received but not emitted (never contains a whole stop string)
        self.matched: str | None = None

    def push(self, text: str, check: bool = True) -> str:
        """Add text; return what can be emitted now. After a match, `matched` is set and every
        later call returns "". With `check=False` (min_tokens not reached yet) matches are not
        acted upon, but text that could start a stop string is still held back."""
        if self.matched is not None or not text:
            return ""
        if not self.stop:
            return text
        buf = self._pending + text
        if check:
            # The match that *ends* first wins (ties: the one starting first). The held-back text
            # never holds a whole stop string, so this is the same however the text was split.
            best: tuple[int, int, str] | None = None
            for s in self.stop:
                idx = buf.find(s)
                if idx >= 0 and (best is None or (idx + len(s), idx) < best[:2]):
                    best = (idx + len(s), idx, s)
            if best is not None:
                _, idx, s = best
                self.matched = s
                self._pending = ""
                return buf[: idx + len(s)] if self.include else buf[:idx]
        hold = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The generation ended without a match: the held-back text is plain text after all."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a prefix of some stop string."""
        best = 0
        n = len(buf)
        for s in self.stop:
            # Candidate suffixes start where s[0] occurs, no earlier than n - len(s) + 1 (a
            # suffix as long as s would be a whole match, already handled) and before n - best.
            start = max(0, n - len(s) + 1)
            i = buf.find(s[0], start)
            while 0 <= i < n - best:
                if s.startswith(buf[i:]):
                    best = n - i
                    break
                i = buf.find(s[0], i + 1)
        return best


# -- per-token text and bytes (logprobs) ------------------------------------------------------

@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The printable-character alphabet byte-level BPE uses for raw bytes (char -> byte)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTexts:
    """Display text and raw bytes of single tokens, cached (for logprobs)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        try:
            self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        except Exception:  # a tokenizer without that table: treat nothing as added
            self._added = set()

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            if self.tokenizer is None:
                t = f"token_id:{token_id}"
            else:
                t = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._text[token_id] = t
        return t

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = None
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                table = _byte_level_alphabet()
                if isinstance(piece, str) and all(c in table for c in piece):
                    b = [table[c] for c in piece]
            if b is None:
                b = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = b
        return b
