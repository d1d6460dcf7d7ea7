"""``bench.prefix_cache``'s ratio column says what it divides and which way is better."""

from __future__ import annotations

import pytest

from kvserve.bench import prefix_cache


def test_the_ratio_column_names_its_terms_and_that_lower_is_better(capsys) -> None:
    assert prefix_cache.main(["--requests", "50"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    headers = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert headers[3] == "us/request / hashing-only (lower: better)"
    row = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    # us/request over the hashing baseline (both printed rounded to 0.1 us).
    assert float(row[3].removesuffix("x")) == pytest.approx(float(row[1]) / float(row[2]), rel=0.05)
