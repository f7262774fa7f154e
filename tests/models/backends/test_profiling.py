"""The graph threads' trace (models/backends/profiling.py): what a GraphThread ran, in order, with
each item's wait and run; bounded by a window and a limit."""

from __future__ import annotations

import threading
import time

import pytest
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.profiling import FIELDS, GraphTrace, TraceItem, busy_between
from cosyedge_models.tools.timeline import render_graph_trace


def _item(label: str, start: float, end: float, thread: str = "t") -> TraceItem:
    return TraceItem(thread, label, "normal", start, start, end)


def test_the_trace_keeps_the_items_that_start_in_its_window_up_to_its_limit() -> None:
    trace = GraphTrace(since_s=10.0, window_s=0.5, limit=3)
    trace.add(_item("early", 9.9, 10.1))  # started before the window
    for k in range(4):
        trace.add(_item(f"in{k}", 10.1 + 0.1 * k, 10.15 + 0.1 * k))
    trace.add(_item("late", 10.6, 10.7))  # started after it
    assert [i.label for i in trace.items()] == ["in0", "in1", "in2"] and trace.dropped == 1
    out = trace.as_dict()
    assert out["fields"] == list(FIELDS) and out["window_ms"] == 500.0 and out["dropped"] == 1
    assert out["items"][1] == ["t", "in1", "normal", 200.0, 200.0, 250.0, ""]  # ms since the window opened
    with pytest.raises(ValueError, match="window_s"):
        GraphTrace(0.0, 0.0)
    with pytest.raises(ValueError, match="limit"):
        GraphTrace(0.0, 1.0, limit=0)


def test_a_graph_thread_records_what_it_ran_its_priority_and_how_long_it_waited() -> None:
    with GraphThread(name="g") as worker:
        trace = GraphTrace(time.perf_counter(), 60.0)
        worker.trace = trace
        started = threading.Event()
        first = worker.submit(lambda: (started.set(), worker.note("rows 2"), time.sleep(0.05)), label="replay")
        assert started.wait(10)
        worker.submit(lambda: None, GraphPriority.LLM, label="step").result(10)  # queued behind the replay
        first.result(10)
        worker.trace = None
        worker.call(lambda: None, label="after")  # not recorded: the trace was taken off
    replay, step = trace.items()
    assert (replay.thread, replay.label, replay.priority, replay.detail) == ("g", "replay", "normal", "rows 2")
    assert (step.label, step.priority, step.detail) == ("step", "llm", "")  # a note is its own item's only
    assert replay.submitted_s <= replay.started_s < replay.ended_s <= step.started_s <= step.ended_s
    assert replay.ended_s - replay.started_s >= 0.045
    assert step.started_s - step.submitted_s >= 0.03  # it waited for the replay


def test_busy_between_clips_each_item_to_the_span_and_counts_the_idle_rest() -> None:
    items = [_item("flow", 0.000, 0.010), _item("llm", 0.012, 0.014), _item("flow", 0.018, 0.030)]
    assert busy_between(items, 0.005, 0.020) == {"flow": 7.0, "llm": 2.0, "idle": 6.0}
    # two threads at once: idle is where the busiest thread did nothing
    two = [_item("flow", 0.0, 0.010, "flow-thread"), _item("llm", 0.0, 0.004, "llm-thread")]
    assert busy_between(two, 0.0, 0.010) == {"flow": 10.0, "llm": 4.0, "idle": 0.0}


def test_the_trace_renders_a_row_per_kind_of_work_and_the_idle_cells() -> None:
    trace = GraphTrace(0.0, 1.0)
    for item in (_item("flow", 0.000, 0.010), _item("llm", 0.010, 0.012), _item("flow", 0.020, 0.030)):
        trace.add(item)
    lines = render_graph_trace(trace.as_dict(), width=15).splitlines()
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in lines[1:]}
    assert lines[0].startswith("graph trace: 0 to 30 ms, one column = 2.0 ms, 3 items")
    assert rows["flow"] == "#" * 5 + " " * 5 + "#" * 5
    assert rows["llm"] == " " * 5 + "#" + " " * 9
    assert rows["idle"] == " " * 6 + "." * 4 + " " * 5
    assert render_graph_trace(GraphTrace(0.0, 1.0).as_dict()) == "graph trace: no items"
