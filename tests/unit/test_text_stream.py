"""`server.text.TextStream` decodes only what follows its settled text: the text must be the
whole decode's after every add, whatever the decoder does at a boundary."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from server import text as text_module
from server.text import REPLACEMENT, TextStream


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")


def byte_level() -> tuple[Callable[[list[int]], str], int]:
    """The test checkpoints' byte-level BPE (GPT-2 style), special tokens skipped."""
    from engine.checkpoints.tiny import build_tokenizer

    tok = build_tokenizer(320)
    return (lambda ids: tok.decode(ids, skip_special_tokens=True)), 320


def sentencepiece_like() -> tuple[Callable[[list[int]], str], int]:
    """Gemma/Llama style: "▁" for spaces, the first one stripped, byte-fallback tokens fused
    into UTF-8 (a run of byte tokens that is not valid UTF-8 becomes one "\ufffd" per token,
    so text already decoded can change: this decoder is not prefix-stable)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["▁", "▁the", "the", "▁a", "b", ".", ",", "▁.", "'s", "▁n't", "é", "▁ok", "!", "?"]
    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}}
    vocab |= {w: len(vocab) + i for i, w in enumerate(words)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    return (lambda ids: fast.decode(ids, skip_special_tokens=True)), len(vocab)


DECODERS = {
    "bytes": lambda: (byte_decode, 256),
    "byte-level BPE": byte_level,
    "sentencepiece-like": sentencepiece_like,
}


class WholeDecodes(TextStream):
    """The stream as it was: the whole token list decoded on every add."""

    def _decode_all(self) -> str:
        return self.decode(self.token_ids)


@pytest.mark.parametrize("name", DECODERS)
def test_every_add_gives_the_whole_decode_of_the_tokens_so_far(name):
    decode, vocab = DECODERS[name]()
    calls: list[int] = []

    def counted(ids: list[int]) -> str:
        calls.append(len(ids))
        return decode(ids)

    rng = random.Random(0)
    for trial in range(6):
        # Mostly a few ids (words, multi-byte characters split over tokens), so that boundaries
        # fall everywhere: inside characters, before a clean-up, after a stripped space.
        common = rng.sample(range(vocab), 12)
        ids = [
            rng.choice(common) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(300)
        ]
        stream, old, at = TextStream(counted, []), WholeDecodes(decode, []), 0
        while at < len(ids):
            step = rng.randint(1, 40 if trial % 2 else 3)
            final = at + step >= len(ids)
            sent = stream.add(ids[at : at + step], final=final)
            assert sent == old.add(ids[at : at + step], final=final)  # the same deltas
            at += step
            whole = decode(ids[:at])
            assert stream.text == (whole if final else whole.rstrip(REPLACEMENT)), (trial, at)
    # Decoding is linear in the tokens, not quadratic: each add decodes the unsettled tokens
    # and the context (the context once more when the text settles), except where a boundary
    # decodes differently.
    assert max(calls) <= len(ids)
    assert sum(calls) < 6 * len(ids) * (text_module.SETTLE + 3 * text_module.CONTEXT)


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times():
    decoded = 0

    def counted(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return byte_decode(ids)

    stream = TextStream(counted, ["\x00stop"])
    for i in range(2000):
        stream.add([97 + i % 26])
    assert stream.text == "".join(chr(97 + i % 26) for i in range(2000))
    # Whole decodes would be 2000 * 2001 / 2 = 2.0M tokens; settled ones are about
    # 2000 * (SETTLE / 2 + CONTEXT), plus the context once per settle.
    assert decoded < 2000 * (text_module.SETTLE // 2 + 2 * text_module.CONTEXT)


def test_a_stop_string_cuts_the_same_text_in_one_add_or_in_many():
    rng = random.Random(1)
    ids = [rng.choice(list(b"ab cd\xc3\xa9")) for _ in range(400)] + list(b"STOP") + [97] * 20
    whole = TextStream(byte_decode, ["STOP"])
    once = whole.add(ids, final=True)
    stream, sent, at = TextStream(byte_decode, ["STOP"]), "", 0
    while at < len(ids) and not stream.stopped:
        sent += stream.add(ids[at : at + 7], final=at + 7 >= len(ids))
        at += 7
    assert sent == once == byte_decode(ids[:400]) and stream.stopped and whole.stopped
    assert stream.num_tokens == whole.num_tokens == 400


def test_include_stop_keeps_the_earliest_longest_stop_string_across_adds():
    kept = TextStream(byte_decode, ["cd", "c"], include_stop=True)
    assert kept.add(list(b"abc")) + kept.add(list(b"def")) == "abc"  # "c" ends first
    longest = TextStream(byte_decode, ["c", "cde"], include_stop=True)
    assert longest.add(list(b"ab")) + longest.add(list(b"cdef")) == "abcde"
    assert longest.stopped and longest.num_tokens == 5
    cut = TextStream(byte_decode, ["c", "cde"])
    assert cut.add(list(b"ab")) + cut.add(list(b"cdef")) == "ab" and cut.num_tokens == 2
