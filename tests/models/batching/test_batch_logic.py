"""Pure logic of LLM continuous batching: the slot/padding bookkeeping (and
its host executor on small arrays) and the admission policy, with an
explicit clock."""

from __future__ import annotations

import numpy as np
import pytest
from cosyedge_models.batching.kv import apply_op
from cosyedge_models.batching.policy import BatchSettings, Waiting, admit
from cosyedge_models.batching.slots import AppendRow, DropColumns, DropRow, PadColumns, SlotTable


def test_join_pads_the_shorter_side_on_the_left() -> None:
    t = SlotTable()
    assert t.join(1, 5) == [AppendRow(0)]
    assert t.join(2, 3) == [AppendRow(2)]  # shorter: padded in front
    assert t.join(3, 8) == [PadColumns(3), AppendRow(0)]  # longer: everyone else padded
    assert t.width == 8
    assert t.mask().tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]


def test_steps_grow_every_row_and_leaves_compact_the_shared_padding() -> None:
    t = SlotTable(compact_min_columns=1)
    t.join(1, 2)
    t.join(2, 6)
    t.advance()
    t.advance()
    assert (t.width, t.length(1), t.length(2)) == (8, 4, 8)
    # The long row leaves: the 4 leading columns are padding in every row left.
    assert t.leave(2) == [DropRow(1), DropColumns(4)]
    assert t.width == 4 and t.mask().tolist() == [[1, 1, 1, 1, 1]]
    assert t.leave(1) == [DropRow(0)] and t.width == 0 and len(t) == 0


def test_compaction_waits_for_enough_shared_padding() -> None:
    t = SlotTable(compact_min_columns=3)
    t.join(1, 4)
    t.join(2, 6)
    t.join(3, 1)
    assert t.leave(2) == [DropRow(1)]  # 2 shared padding columns: below the threshold
    assert t.shared_padding() == 2
    t.join(4, 2)
    assert t.leave(1) == [DropRow(0), DropColumns(4)]  # now rows of 1 and 2 in 6 columns
    assert t.width == 2 and t.ids == [3, 4]


def test_bad_joins_are_refused() -> None:
    t = SlotTable()
    t.join(1, 3)
    with pytest.raises(ValueError, match="already holds"):
        t.join(1, 3)
    with pytest.raises(ValueError, match=">= 1 position"):
        t.join(2, 0)


def test_host_executor_keeps_each_rows_values_right_aligned() -> None:
    """Apply the ops to [L, 2, B, H, W, hd] arrays whose values name their
    (request, position): after joins, steps and leaves every row holds its
    own positions in its last columns and zeros in front."""
    t = SlotTable(compact_min_columns=1)
    kv = None

    def cache(rid: int, n: int) -> np.ndarray:
        return (rid * 100 + np.arange(n, dtype=np.float32)).reshape(1, 1, 1, 1, n, 1).repeat(2, axis=1)

    lens: dict[int, int] = {}

    def join(rid: int, n: int) -> None:
        nonlocal kv
        for op in t.join(rid, n):
            kv = apply_op(kv, op, cache(rid, n))
        lens[rid] = n

    def step() -> None:
        nonlocal kv
        assert kv is not None
        new = np.array([r * 100 + lens[r] for r in t.ids], dtype=np.float32).reshape(1, 1, -1, 1, 1, 1)
        kv = np.concatenate((kv, np.broadcast_to(new, (1, 2, len(t), 1, 1, 1))), axis=4)
        t.advance()
        for r in t.ids:
            lens[r] += 1

    def leave(rid: int) -> None:
        nonlocal kv
        for op in t.leave(rid):
            kv = apply_op(kv, op)
        del lens[rid]

    join(1, 3)
    step()
    join(2, 6)
    step()
    join(3, 2)
    leave(2)
    step()
    assert kv is not None and kv.shape[4] == t.width == 6
    for row, rid in enumerate(t.ids):
        n = lens[rid]
        values = kv[0, 0, row, 0, :, 0]
        assert values[t.width - n:].tolist() == [rid * 100 + i for i in range(n)]
        assert not values[:t.width - n].any()
    leave(1)
    leave(3)
    assert kv is None


# --- admission -------------------------------------------------------------------------

def w(key: int, priority: int = 0, arrived: float = 0.0) -> Waiting:
    return Waiting(key, priority, arrived)


def test_no_delay_joins_at_once_up_to_the_free_slots() -> None:
    s = BatchSettings(max_batch_size=3)
    assert [x.key for x in admit(s, [w(1), w(2)], active=0, now=0.0).join] == [1, 2]
    assert [x.key for x in admit(s, [w(1), w(2)], active=2, now=0.0).join] == [1]
    assert admit(s, [w(1)], active=3, now=0.0).join == []


def test_delay_holds_requests_until_a_preferred_size_or_the_deadline() -> None:
    s = BatchSettings(max_batch_size=4, preferred_batch_sizes=(2,), max_queue_delay_ms=50)
    first = admit(s, [w(1, arrived=10.0)], active=0, now=10.0)
    assert first.join == [] and first.wake_at == pytest.approx(10.05)
    assert admit(s, [w(1, arrived=10.0)], active=0, now=10.049).join == []
    assert [x.key for x in admit(s, [w(1, arrived=10.0)], active=0, now=10.05).join] == [1]
    # A second request makes the preferred size: both join before the deadline.
    both = admit(s, [w(1, arrived=10.0), w(2, arrived=10.01)], active=0, now=10.01)
    assert [x.key for x in both.join] == [1, 2]
    # Three waiting, preferred 2, max 4: the largest reachable target (4) wins.
    assert len(admit(s, [w(1), w(2), w(3), w(4)], active=0, now=0.0).join) == 4
    # Joining a running batch of 1: 1 + 1 = 2 is preferred.
    assert [x.key for x in admit(s, [w(5, arrived=3.0)], active=1, now=3.0).join] == [5]
    # A batch of 2 plus 1 makes 3, neither preferred nor max: wait for the delay.
    assert admit(s, [w(6, arrived=3.0)], active=2, now=3.0).join == []
    # The engine's load hint cuts the delay.
    assert [x.key for x in admit(s, [w(6, arrived=3.0)], active=2, now=3.0, delay_ms=0.0).join] == [6]


def test_scarce_slots_go_to_higher_priority_then_fifo() -> None:
    s = BatchSettings(max_batch_size=3)
    waiting = [w(1, 0), w(2, 5), w(3, 0), w(4, 5), w(5, -1)]
    assert [x.key for x in admit(s, waiting, active=1, now=0.0).join] == [2, 4]
    assert [x.key for x in admit(s, waiting, active=0, now=0.0).join] == [2, 4, 1]


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_batch_size": 0}, "max_batch_size must be between 1 and 256 requests"),
    ({"max_batch_size": 4, "preferred_batch_sizes": (2, 5)}, r"preferred_batch_sizes must lie in 1..max_batch_size"),
    ({"max_queue_delay_ms": -1}, "max_queue_delay_ms must be between 0 and 10000 ms"),
    ({"max_queue_size": 0}, "max_queue_size must be >= 1 request"),
    ({"compact_min_columns": 0}, "compact_min_columns must be >= 1 cache position"),
])
def test_settings_say_what_is_allowed(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchSettings(**kw)  # type: ignore[arg-type]
