"""Stop-string matching over streamed text (worker/stops.py): no model."""

from __future__ import annotations

from kvmux.worker.stops import StopMatcher


def stream(matcher: StopMatcher, segments: list[str]) -> tuple[str, bool]:
    sent = []
    for segment in segments:
        text, hit = matcher.push(segment)
        sent.append(text)
        if hit:
            return "".join(sent), True
    return "".join(sent) + matcher.flush(), False


def test_no_stops_passes_everything_at_once():
    matcher = StopMatcher([])
    assert matcher.push("Hello, ") == ("Hello, ", False)
    assert matcher.push("world") == ("world", False)
    assert matcher.flush() == ""


def test_stop_split_over_many_segments_is_found_and_never_sent():
    assert stream(StopMatcher(["STOP"]), ["The end S", "T", "O", "P and more"]) == ("The end ", True)


def test_held_tail_is_released_when_it_cannot_become_a_stop():
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("line\n") == ("line", False)  # "\n" may start the stop
    assert matcher.push("next") == ("\nnext", False)  # it did not


def test_earliest_of_several_stops_wins():
    assert stream(StopMatcher(["world", "lo"]), ["Hello world"]) == ("Hel", True)


def test_flush_returns_the_held_back_tail():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("done </") == ("done ", False)
    assert matcher.flush() == "</"
    assert matcher.flush() == ""


def test_unicode_stops():
    assert stream(StopMatcher(["🦙"]), ["llamas: ", "🦙", " more"]) == ("llamas: ", True)
    assert stream(StopMatcher(["ü"]), ["Grüße"]) == ("Gr", True)
