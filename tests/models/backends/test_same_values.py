"""flow_cache.same_values: equal values known without reading them, only for views of one read-only
array (a voice's conv history, read_only at FlowPrefix's build); anything else needs a look."""

from __future__ import annotations

import numpy as np
from cosyedge_models.backends.flow_cache import read_only, same_values


def _lane(conv: np.ndarray) -> np.ndarray:
    return np.asarray(conv, np.float32).transpose(1, 0, 2, 3)  # as lanes.lane_history


def test_views_of_one_read_only_array_alike_are_the_same_values() -> None:
    conv = read_only(np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(3, 2, 4, 2))
    assert not conv.flags.writeable and conv.base is None
    assert same_values(_lane(conv), _lane(conv))  # two views made apart, as two streams' seeds
    assert same_values(conv, conv)
    assert not same_values(_lane(conv), conv)  # the same bytes, read another way
    assert not same_values(_lane(conv), _lane(conv)[:, :1])


def test_a_writable_or_another_array_is_not_trusted_without_a_look() -> None:
    values = np.arange(48, dtype=np.float32).reshape(3, 2, 4, 2)
    assert not same_values(_lane(values), _lane(values))  # writable: it may have changed since
    frozen_view = values[:]
    frozen_view.flags.writeable = False  # a read-only view of memory that another view may still write
    assert not same_values(frozen_view, frozen_view)
    a, b = read_only(values), read_only(values)
    assert np.array_equal(a, b) and not same_values(_lane(a), _lane(b))  # equal values, other arrays
    owned = read_only(frozen_view)  # a view: copied into an array of its own
    assert owned.base is None and not owned.flags.writeable and same_values(owned, owned)
    values[0, 0, 0, 0] = -1.0
    assert owned[0, 0, 0, 0] == 0.0
