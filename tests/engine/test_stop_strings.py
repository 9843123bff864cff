"""Stop-string matching over streamed text pieces: no stop string or part of one ever leaks."""

from __future__ import annotations

from cbd.engine.detokenizer import StopStringMatcher


def feed_all(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool, int]:
    m = StopStringMatcher(stops)
    out = ""
    for i, piece in enumerate(pieces):
        text, hit = m.feed(piece)
        out += text
        if hit:
            return out, True, i
    return out + m.flush(), False, len(pieces)


def test_stop_string_spanning_pieces_is_cut_with_everything_after() -> None:
    out, hit, at = feed_all(("STOP",), ["Hello S", "T", "OP and more", " never"])
    assert (out, hit, at) == ("Hello ", True, 2)


def test_held_back_tail_is_released_when_it_turns_out_harmless() -> None:
    m = StopStringMatcher(("abc",))
    assert m.feed("xxab") == ("xx", False)  # "ab" might start "abc"
    assert m.feed("d") == ("abd", False)  # "abd" starts no stop string: released at once
    out, hit, _ = feed_all(("abc",), ["xxab", "d", "e"])
    assert (out, hit) == ("xxabde", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    out, hit, _ = feed_all(("world", "lo w"), ["hel", "lo world"])
    assert (out, hit) == ("hel", True)


def test_stop_at_the_very_start_yields_empty_text() -> None:
    assert feed_all(("\n",), ["\nrest"])[:2] == ("", True)


def test_no_stop_strings_streams_everything_at_once() -> None:
    m = StopStringMatcher(())
    assert m.feed("abc") == ("abc", False)
    assert m.feed("d") == ("d", False)


def test_released_text_is_all_that_cannot_begin_a_stop_string() -> None:
    """Against a brute-force oracle: after each piece, everything before the earliest stop string (or, with
    none, before the earliest tail that begins one) has been released, and nothing more."""
    import random

    rng = random.Random(7)
    for _ in range(400):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        m, text, out = StopStringMatcher(stops), "", ""
        for _ in range(6):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            released, hit = m.feed(piece)
            out, text = out + released, text + piece
            hits = [p for p in (text.find(stop) for stop in stops) if p >= 0]
            if hits:
                assert hit and out == text[: min(hits)], (stops, text, out)
                break
            held = next((i for i in range(len(text)) if any(s.startswith(text[i:]) for s in stops)), len(text))
            assert not hit and out == text[:held], (stops, text, out)
