"""Incremental detokenization: UTF-8 safe deltas and stop strings (held back, then cut)."""

from __future__ import annotations

from collections.abc import Sequence

from inferflow.stages.detokenizer import TextDetokenizer, partial_stop_len


class ByteTokenizer:
    """Each token is one byte of UTF-8 (the hardest case for incremental decoding)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(detok: TextDetokenizer, text: str) -> list[str]:
    data = list(text.encode())
    deltas = [detok.add([b]) for b in data]
    deltas.append(detok.add([], final=True))
    return deltas


def test_multibyte_characters_are_never_split() -> None:
    detok = TextDetokenizer(ByteTokenizer())
    deltas = feed(detok, "a→東京🙂b")
    assert "".join(deltas) == "a→東京🙂b"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_streamed() -> None:
    detok = TextDetokenizer(ByteTokenizer(), stop=["STOP"])
    deltas = feed(detok, "hello STOP world")
    assert "".join(deltas) == "hello "
    assert detok.stop_reason == "STOP"
    assert not any("S" in d for d in deltas)


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    detok = TextDetokenizer(ByteTokenizer(), stop=["<end>"])
    deltas = feed(detok, "a <en b")
    assert "".join(deltas) == "a <en b" and detok.stop_reason is None
    assert partial_stop_len("xx<en", ["<end>"]) == 3
    assert partial_stop_len("xx", ["<end>"]) == 0


def test_earliest_of_several_stop_strings_wins() -> None:
    detok = TextDetokenizer(ByteTokenizer(), stop=["world", "lo w"])
    assert "".join(feed(detok, "hello world")) == "hel"
    assert detok.stop_reason == "lo w"


def _partial_stop_len_by_definition(text: str, stops: list[str]) -> int:
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def test_partial_stop_match_equals_its_definition() -> None:
    import random

    from inferflow.stages.detokenizer import partial_stop_len

    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice("ab c") for _ in range(rng.randint(1, 8)))
            for _ in range(rng.randint(1, 3))
        ]
        assert partial_stop_len(text, stops) == _partial_stop_len_by_definition(text, stops)
    assert partial_stop_len("x" * 10_000, ["y" * 256] * 4) == 0  # no candidate: nothing scanned
