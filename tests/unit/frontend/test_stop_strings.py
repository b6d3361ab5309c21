from __future__ import annotations

from frontend_svc.engine.stop_strings import find_stop_string


def test_match_in_new_text_excluded_and_included() -> None:
    assert find_stop_string("hello STOP there", 11, ("STOP",), False) == ("STOP", 6)
    assert find_stop_string("hello STOP there", 11, ("STOP",), True) == ("STOP", 10)


def test_match_spanning_old_and_new_text() -> None:
    # "ST" arrived earlier, "OP" is new: the search reaches back len(stop) - 1 characters.
    assert find_stop_string("xxST" + "OP", 2, ("STOP",), False) == ("STOP", 2)


def test_old_text_is_not_searched_again() -> None:
    assert find_stop_string("STOP then more", 4, ("STOP",), False) is None


def test_earliest_stop_wins() -> None:
    assert find_stop_string("abcXYdef", 8, ("def", "XY"), False) == ("XY", 3)


def test_no_match() -> None:
    assert find_stop_string("nothing here", 5, ("STOP", "\n\n"), False) is None
