"""Cutting a worker's batch into frames (client routing)."""

from __future__ import annotations

import numpy as np

from kvstore_client.routing import FRAME_BYTES, frames, runs


def test_runs_stay_under_the_limit_with_at_least_one_item() -> None:
    assert runs([], 10) == []
    assert runs([4, 4, 4], 10) == [(0, 2), (2, 3)]
    assert runs([20, 1, 1], 10) == [(0, 1), (1, 3)], "an item over the limit goes alone"
    assert runs([5, 5, 5, 5], 10) == [(0, 2), (2, 4)]


def test_frames_cover_every_position_once_in_order() -> None:
    idx = np.arange(100) * 3
    sizes = [FRAME_BYTES // 7] * 100
    got = frames(idx, sizes)
    assert np.array_equal(np.concatenate(got), idx)
    assert all(len(f) <= 7 for f in got)
