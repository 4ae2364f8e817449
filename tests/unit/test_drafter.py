"""workers.cupy.drafter: prompt lookup and Predicted Outputs drafts on small token lists."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from numpy.lib.stride_tricks import sliding_window_view

from workers.cupy.drafter import Drafter, longest_matches

import numpy as np


def find_matches(haystack: np.ndarray, suffix: np.ndarray) -> np.ndarray:
    """Start indices i where haystack[i : i + len(suffix)] == suffix and at least one token follows: the drafter's
    search per suffix length before longest_matches, kept as its oracle."""
    n = suffix.size
    if haystack.size <= n:
        return np.empty(0, np.int64)
    windows = sliding_window_view(haystack[:-1], n)  # windows that have a following token
    return np.flatnonzero((windows == suffix).all(axis=1))


def test_find_matches_needs_a_following_token():
    hay = np.array([1, 2, 3, 1, 2])
    assert find_matches(hay, np.array([1, 2])).tolist() == [0]  # the match at 3 ends the array
    assert find_matches(np.array([5]), np.array([5])).tolist() == []


def search_each_length(haystack, tail, max_n, min_n):
    """The search longest_matches replaces: find_matches for each suffix length, longest first."""
    for n in range(min(max_n, tail.size, haystack.size - 1), min_n - 1, -1):
        starts = find_matches(haystack, tail[-n:]) + n
        if starts.size:
            return n, starts.tolist()
    return 0, []


tokens = st.lists(st.integers(0, 3), max_size=60)  # a small alphabet: many partial and overlapping matches


@settings(max_examples=400, deadline=None)
@given(hay=tokens, tail=tokens, max_n=st.integers(1, 10), min_n=st.integers(1, 3), own=st.booleans())
def test_longest_matches_finds_what_searching_each_length_finds(hay, tail, max_n, min_n, own):
    haystack = np.asarray(hay, np.int64)
    tail = haystack if own else np.asarray(tail, np.int64)  # own: the sequence searched for its own suffix
    n, starts = longest_matches(haystack, tail, max_n, min_n)
    assert (n, starts.tolist()) == search_each_length(haystack, tail, max_n, min_n)


def test_longest_matches_on_a_run_of_one_token_overlaps_the_suffix():
    ctx = np.array([4, 4, 4, 4, 4])
    # "4 4 4" ends at 2 and at 3 (3 is the last with a following token), never at the last position
    assert longest_matches(ctx, ctx, 3, 2)[0] == 3 and longest_matches(ctx, ctx, 3, 2)[1].tolist() == [3, 4]
    assert longest_matches(ctx, ctx, 8, 2)[0] == 4  # at most the context less its last token
    assert longest_matches(np.array([1, 2]), np.array([9, 2]), 8, 2)[0] == 0


def test_context_lookup_continues_the_most_recent_earlier_occurrence():
    d = Drafter()
    assert d.propose([7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2], 3) == [3, 5, 6]


def test_longest_suffix_wins_over_a_more_recent_short_match():
    # "1 2" last occurs before 8, but "9 1 2" only before 3
    d = Drafter()
    assert d.propose([9, 1, 2, 3, 4, 1, 2, 8, 9, 1, 2], 2) == [3, 4]


def test_a_copy_is_walked_past_a_later_copy_of_the_same_run():
    # a 10-token run appears twice, each followed by its own tail; the output copies the first one
    run = list(range(100, 110))
    prompt = [1, *run, 7, 8, 9, 2, *run, 3, 4, 5, 0]
    d = Drafter(num_prompt_tokens=len(prompt))
    seq = [*prompt, 1, 100, 101]
    assert d.propose(seq, 8) == run[2:]  # found after "1 100 101": the first copy only
    # the sequence took those 8 tokens: the walk goes on in the first copy, though the last 8 tokens also end the
    # second copy (the most recent occurrence, which a fresh search drafts from)
    assert d.propose([*seq, *run[2:]], 3) == [7, 8, 9]
    assert Drafter().propose([*seq, *run[2:]], 3) == [3, 4, 5]


def test_a_walk_left_by_the_sequence_falls_back_to_the_search():
    run = list(range(100, 110))
    prompt = [1, *run, 7, 8, 9, 2, *run, 3, 4, 5, 0]
    d = Drafter(num_prompt_tokens=len(prompt))
    seq = [*prompt, 1, 100, 101]
    assert d.propose(seq, 8) == run[2:]
    # the model took the second copy's tail instead of the walk's 7: the draft comes from the search again
    assert d.propose([*seq, *run[2:], 3], 2) == [4, 5]
    # a sequence that took tokens other than the walk's mid-way: searched again too (no match: no draft)
    assert d.propose([*seq, *run[2:], 3, 4, 5, 0, 42, 43], 2) == []


def test_no_match_no_draft_and_k_zero_is_empty():
    assert Drafter().propose([1, 2, 3, 4], 4) == []
    assert Drafter().propose([1, 2, 1, 2], 0) == []


def test_draft_is_cut_at_the_end_of_the_context():
    assert Drafter().propose([4, 5, 6, 4, 5], 8) == [6, 4, 5]


def test_prediction_starts_at_its_beginning_then_follows_the_output():
    pred = [10, 11, 12, 13, 14, 15]
    d = Drafter(prediction=pred, num_prompt_tokens=3)
    assert d.propose([1, 2, 3], 3) == [10, 11, 12]
    assert d.propose([1, 2, 3, 10, 11], 3) == [12, 13, 14]
    # an edit (99) then back on the prediction
    assert d.propose([1, 2, 3, 10, 11, 12, 99, 13, 14], 2) == [15]


def test_prediction_prefers_the_copy_ahead_of_the_previous_draft():
    pred = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9]
    d = Drafter(prediction=pred, num_prompt_tokens=1)
    assert d.propose([0, 1, 2, 3, 7, 1, 2, 3], 1) == [8]  # longest suffix "7 1 2 3" is unique
    assert d.propose([0, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 1) == [9]
    d2 = Drafter(prediction=pred, num_prompt_tokens=1)
    d2._pred_pos = 8
    assert d2.propose([0, 5, 2, 3], 1) == [9]  # "2 3" occurs three times: the one ahead of position 8


def test_prediction_falls_back_to_context_lookup():
    d = Drafter(prediction=[50, 51, 52], num_prompt_tokens=4)
    assert d.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]


def test_the_buffer_grows_with_the_sequence():
    d = Drafter()
    seq = list(range(300)) + list(range(10))
    assert d.propose(seq[:200], 2) == []
    assert d.propose(seq, 3) == [10, 11, 12]


def test_prediction_usage_counts_the_given_predictions_tokens_found_in_the_completion():
    from workers.cupy.drafter import prediction_usage

    pred = list(range(100, 164))
    assert prediction_usage(pred, pred) == (64, 0)  # a perfect 64-token prediction: all 64 accepted
    assert prediction_usage(pred, pred[:10] + [1, 2, 3] + pred[20:]) == (54, 10)  # 10 replaced
    assert prediction_usage(pred, [1, 2, 3]) == (0, 64)
    assert prediction_usage([], [1, 2, 3]) == (0, 0)  # no prediction: nothing to report
