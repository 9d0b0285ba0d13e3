"""Incremental detokenizer and stop-string matcher, unit-wise and property-based.

The tokenizer is a small byte-level BPE trained here with `tokenizers` (never the bundled
model), with ChatML special tokens; `make_tokenizer` is also used by test_server_api.py.
"""
from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.detokenizer import INCOMPLETE_MAX_BYTES, IncrementalDetokenizer, StopStringMatcher, TokenTexts

SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # ids 0, 1 (eos, as in make_checkpoint), 2
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MULTIBYTE = "héllo wörld naïve café déjà — “quotes” … 你好世界，我们的东西。日本語のテキスト 😀🎉🚀 👍🏽 Ωμέγα"


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["the", "qu", "ick", "br", "own", "fox", "ju", "mps", "ov", "er", "la", "zy", "do", "g", "st",
                 "op", "end", "ing", "ion", "al", "re", "in", "an", "on", "at", "ed", "es", "ly", "to", "ro"]
    lines = []
    for _ in range(400):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", "\n", ":", ";"]))
    return lines + ["café déjà vu", "你好"] + ["def foo(x):\n    return x + 1\n", "STOP here. Stop! stop."] * 10


def make_tokenizer(path: Path, vocab_size: int = 1024):
    """Train a byte-level BPE + ChatML template, save it as a transformers tokenizer at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 extra_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    hf.chat_template = CHATML
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def decode(tok, ids, skip=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, ids, sizes=None, skip=True) -> list[str]:
    """Feed ids in chunks of the given sizes (default 1); return every emitted piece (flush last)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i, k = [], 0, 0
    sizes = sizes or [1]
    while i < len(ids):
        n = max(1, sizes[k % len(sizes)])
        pieces.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


# -- detokenizer ---------------------------------------------------------------------------

def test_tokenizer_splits_multibyte_characters(tokenizer):
    # The premise of the tests below: some characters really are split across tokens.
    ids = tokenizer.encode("😀🎉🚀", add_special_tokens=False)
    assert any("\ufffd" in decode(tokenizer, [i]) for i in ids)


def test_multibyte_stream_is_exact_and_never_shows_replacement_chars(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > 20
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == decode(tokenizer, ids) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)  # held back until each character is complete
    emitted = ""
    for p in pieces:  # every intermediate text is a prefix of the final one
        emitted += p
        assert MULTIBYTE.startswith(emitted)


def test_held_back_until_the_character_completes(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == "a😀"
    assert pieces[-1].endswith("😀") and all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 1  # at least one token contributed an incomplete sequence


def test_flush_emits_an_incomplete_tail_like_decode(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    partial = ids[:-1]
    assert decode(tokenizer, partial).endswith("\ufffd")
    pieces = stream(tokenizer, partial)
    assert "".join(pieces) == decode(tokenizer, partial)
    assert "\ufffd" not in "".join(pieces[:-1])


def test_a_run_of_stray_bytes_streams_as_it_comes(tokenizer):
    # A lone continuation byte decodes to U+FFFD whatever follows it. A model emitting a run of them
    # must not hold the whole output back to the end (nor decode an ever longer window each step):
    # all but the last few are final and stream, as decoding all the ids at once renders them.
    stray = tokenizer.convert_tokens_to_ids("¤")  # byte 0xA4: a continuation byte
    assert decode(tokenizer, [stray]) == "\ufffd"
    head, tail = tokenizer.encode("ok", add_special_tokens=False), tokenizer.encode(" end 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    detok.push(head)
    for k in range(1, 41):
        detok.push([stray])
        assert detok.text == "ok" + "\ufffd" * max(0, k - INCOMPLETE_MAX_BYTES)
    rest = [detok.push([t]) for t in tail] + [detok.flush()]
    assert detok.text == decode(tokenizer, head + [stray] * 40 + tail) == "ok" + "\ufffd" * 40 + " end 😀"
    assert "😀" in "".join(rest)


def test_a_character_after_stray_bytes_is_still_whole(tokenizer):
    # The cut never falls inside a character: its bytes, arriving one token at a time after the
    # stray run, still come out as the character.
    stray = tokenizer.convert_tokens_to_ids("¤")
    emoji = [tokenizer.convert_tokens_to_ids(c) for c in ("ð", "Ł", "ĺ", "Ģ")]  # bytes F0 9F 98 80: 😀
    assert decode(tokenizer, emoji) == "😀"
    ids = [stray] * 6 + emoji + [stray] * 2 + emoji
    for sizes in ([1], [2], [3], [5], [1, 4]):
        pieces = stream(tokenizer, ids, sizes)
        assert "".join(pieces) == decode(tokenizer, ids) == "\ufffd" * 6 + "😀" + "\ufffd" * 2 + "😀"
        assert sum(p.count("😀") for p in pieces) == 2


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = (tokenizer.encode("hello", add_special_tokens=False) + [1]
           + tokenizer.encode(" wörld", add_special_tokens=False) + [2, 0])
    assert "".join(stream(tokenizer, ids)) == decode(tokenizer, ids) == "hello wörld"
    assert "".join(stream(tokenizer, ids, skip=False)) == decode(tokenizer, ids, skip=False)


def test_no_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.push([1, 2, 3]) == "" and detok.flush() == ""


@settings(max_examples=60, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_any_chunking_equal_full_decode(tokenizer, data):
    """Arbitrary id sequences (so also invalid UTF-8), arbitrary chunking: exact."""
    vocab = len(tokenizer)
    byte_ids = [tokenizer.convert_tokens_to_ids(c) for c in ("Ã", "Â", "ð", "Ł", "¤", "¢", "ł", "Ģ")]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from([t for t in byte_ids if t is not None]))
    ids = data.draw(st.lists(token, min_size=0, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    skip = data.draw(st.booleans())
    assert "".join(stream(tokenizer, ids, sizes, skip)) == decode(tokenizer, ids, skip)


@settings(max_examples=60, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab é€你😀 \n.")) | st.characters(codec="utf-8"), max_size=30),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_text_round_trip_streams_exactly(tokenizer, text, sizes):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, sizes)
    assert "".join(pieces) == decode(tokenizer, ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_token_bytes_are_raw_bytes(tokenizer):
    tt = TokenTexts(tokenizer)
    ids = tokenizer.encode("é😀 hi", add_special_tokens=False)
    assert b"".join(bytes(tt.bytes(t)) for t in ids) == "é😀 hi".encode()
    assert bytes(tt.bytes(1)) == b"<|im_end|>"


# -- stop strings --------------------------------------------------------------------------

def run_matcher(stops, pieces, include=False):
    m = StopStringMatcher(stops, include)
    out = []
    for p in pieces:
        out.append(m.push(p))
        if m.matched is not None:
            break
    else:
        out.append(m.flush())
    return "".join(out), m.matched, out


def test_stop_across_pieces_never_leaks():
    text, matched, out = run_matcher(["STOP"], ["abc S", "T", "O", "P tail"])
    assert (text, matched) == ("abc ", "STOP")
    assert all("S" not in p for p in out)  # not even the first letter went out early


def test_partial_prefix_is_released_when_it_does_not_match():
    m = StopStringMatcher(["STOP"])
    assert m.push("ab ST") == "ab "
    assert m.push("ART") == "START"
    assert m.push("S") == ""
    assert m.flush() == "S"


def test_earliest_ending_match_wins_and_include_option():
    assert run_matcher(["abcd", "bc"], ["abcd"])[:2] == ("a", "bc")
    assert run_matcher(["abcd", "bc"], ["a", "b", "c", "d"])[:2] == ("a", "bc")
    assert run_matcher(["bc", "abc"], ["xabc"])[:2] == ("x", "abc")  # same end: the longer one
    assert run_matcher(["€€"], ["1€", "€2"], include=True)[:2] == ("1€€", "€€")


def test_multibyte_stop_string():
    assert run_matcher(["你好"], ["x你", "好y"])[:2] == ("x", "你好")


def test_empty_stop_string_refused():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher([""])


def test_min_tokens_check_off_lets_text_through():
    m = StopStringMatcher(["ab"])
    assert m.push("xab", check=False) == "xab"  # before min_tokens a stop string is plain text
    assert m.push("a", check=False) == ""  # but a possible start is still held back
    assert m.push("b") == "" and m.matched == "ab"


@settings(max_examples=200, deadline=timedelta(seconds=5))
@given(text=st.text(alphabet="ab€c", max_size=24),
       stops=st.lists(st.text(alphabet="ab€c", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 24), max_size=8))
def test_stop_matcher_property(text, stops, cuts):
    """Whatever the split: output == text cut before the earliest-ending match, and no emitted
    prefix ever contains the beginning of that match."""
    bounds = sorted(set(c for c in cuts if c <= len(text)) | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    expected = text[: min(found)[1]] if found else text
    m = StopStringMatcher(stops)
    emitted = ""
    for p in pieces:
        emitted += m.push(p)
        assert expected.startswith(emitted)
        if m.matched is not None:
            break
    emitted += m.flush()
    assert emitted == expected
    assert (m.matched is not None) == bool(found)
