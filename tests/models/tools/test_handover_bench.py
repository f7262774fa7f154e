"""The token hand-over benchmark (models/tools/handover_bench.py) at a size that fits CI: both ways
hand the streams the same tokens; the mailbox wakes a stream once a chunk, the producer path once a token."""

from __future__ import annotations

import json
from pathlib import Path

from cosyedge_models.tools import handover_bench


def test_both_ways_hand_over_every_token_and_the_mailbox_wakes_once_a_chunk(tiny_bundle: Path,
                                                                          tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    assert handover_bench.main(["--bundle", str(tiny_bundle), "--streams", "2", "--runs", "1", "--step-ms", "0.5",
                                "--chunk-ms", "1", "--json", str(out)]) == 0
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == ["mailbox", "producer"]
    producer, mailbox = runs["producer"], runs["mailbox"]
    assert producer["tokens"] == mailbox["tokens"] > 2 * (handover_bench.HOP + handover_bench.LOOKAHEAD)
    # a chunk's worth of tokens (or the end) per wake-up, against about one a token
    chunks = mailbox["tokens"] // handover_bench.HOP + 2 * 2
    assert 0 < mailbox["handovers"] <= chunks < producer["handovers"]
