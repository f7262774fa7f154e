"""The RSS measures the fuzz and soak suites bound."""

from __future__ import annotations

from tests.support.daemon_rss import growth_after_warmup, sample_due, steady_growth

# RSS samples (KiB) of a CI run of the Wyoming fuzz (stop 33): one 2.8 MiB step, flat afterwards.
ONE_STEP = [56032, 56256, 59120, 59128, 59144, 59168, 59172, 59176, 59176, 59176, 59176, 59176]


def test_one_step_is_not_counted_as_growth() -> None:
    assert growth_after_warmup(ONE_STEP) == 0.0561
    assert steady_growth(ONE_STEP) == round((59176 - 56032 - 2864) / 56032, 4)
    assert steady_growth(ONE_STEP) < 0.01


def test_a_leak_that_keeps_growing_is_counted() -> None:
    leak = [50_000 + 300 * k for k in range(12)]  # 300 KiB between every two samples
    assert steady_growth(leak) == round(300 * 10 / 50_000, 4)
    assert steady_growth(leak) > 0.05


def test_shrinking_memory_is_negative_growth() -> None:
    assert steady_growth([50_000, 49_000, 49_500]) == round(-1000 / 50_000, 4)


def test_sampling_after_the_warmup_then_every_twentieth() -> None:
    due = [n for n in range(1, 1001) if sample_due(n, 1000, 0.5)]
    assert due[0] == 500 and due[1:3] == [550, 600] and due[-1] == 1000
