from veloxquant_mlx.engine.request.stops import StopMatcher


def feed_all(matcher, pieces):
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            break
    return "".join(out), stopped


def test_stop_split_across_pieces_is_caught_and_dropped():
    assert feed_all(StopMatcher(("END",)), ["abc E", "N", "D tail"]) == ("abc ", True)


def test_text_that_only_looked_like_a_stop_is_released():
    m = StopMatcher(("END",))
    assert feed_all(m, ["a E", "NX", "b"]) == ("a ENXb", False)
    assert m.flush() == ""


def test_held_prefix_is_flushed_at_the_end():
    m = StopMatcher(("STOP",))
    assert m.feed("go ST") == ("go ", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stops_wins():
    assert feed_all(StopMatcher(("b", "zz")), ["azzb"]) == ("a", True)


def test_no_stops_passes_everything():
    assert StopMatcher(()).feed("anything") == ("anything", False)
