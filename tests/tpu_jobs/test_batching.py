import numpy as np
import pytest

from tpu_jobs.model.batching import pack_rows, pad_values, round_up


def test_pack_rows_layout():
    tokens, mask, comp = pack_rows([[1, 5, 6], [1, 7]], [[9, 2], [8, 8, 2]], 4, 3)
    np.testing.assert_array_equal(tokens, [[0, 1, 5, 6, 9, 2, 0], [0, 0, 1, 7, 8, 8, 2]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(comp, [[1, 1, 0], [1, 1, 1]])


def test_pack_rows_too_long_names_sizes():
    with pytest.raises(ValueError, match="exceed"):
        pack_rows([[1, 2, 3]], [[4]], 2, 3)


def test_pad_values_and_round_up():
    np.testing.assert_array_equal(pad_values([[1.0], [2.0, 3.0]], 3), [[1, 0, 0], [2, 3, 0]])
    assert round_up(1, 8) == 8 and round_up(8, 8) == 8 and round_up(9, 8) == 16
