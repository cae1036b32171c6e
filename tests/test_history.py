"""A row's token history grows into a doubling buffer: the same arrays np.append would give, earlier views intact."""

import numpy as np

from mla_deploy.runtime.history import SMALLEST, appended


def test_appending_gives_what_np_append_gives_and_leaves_earlier_views_as_they_were():
    prompt = np.arange(3, 3 + 100, dtype=np.int64)
    history, buffer, expected, views = prompt, None, prompt, []
    for token in range(500):
        history, buffer = appended(history, buffer, token)
        expected = np.append(expected, token)
        assert history.dtype == np.int64 and np.array_equal(history, expected)
        assert np.shares_memory(history, buffer) and len(buffer) >= len(history)
        views.append((history, expected))
    for view, then in views:  # each step's history still reads as it did then (a draft may hold one)
        assert np.array_equal(view, then)
    assert np.array_equal(prompt, np.arange(3, 103))  # the prompt itself is never written
    assert len(buffer) == 200 * 2**2  # doubled from 2 x 100 as it filled: 200, 400, 800
    short, first = appended(np.array([7], np.int64), None, 8)
    assert len(first) == SMALLEST and short.tolist() == [7, 8]
