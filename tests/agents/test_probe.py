"""The one probe check (``streamrl.agents.probe``) that the trainer's publisher, the vLLM backend and the Ray
engines share: its tolerance rule, and the probe file round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from streamrl.agents.probe import check_probe, read_adapter_probe, write_adapter_probe


def test_the_check_passes_within_the_tolerance_on_its_measure_and_never_on_nan() -> None:
    expected = [-1.0, -2.0, -3.0, -4.0]
    served = [-1.0, -2.0, -3.0, -3.6]  # one token 0.4 away: mean 0.1, max 0.4
    assert check_probe(served, expected, atol=0.1) is None
    found = check_probe(served, expected, atol=0.3, measure="max")
    assert found is not None and found.worst == pytest.approx(0.4) and found.mean == pytest.approx(0.1)
    assert found.tokens == 4
    assert check_probe(served, expected, atol=0.4, measure="max") is None
    assert check_probe([-1.0, math.nan, -3.0, -4.0], expected, atol=1.0) is not None
    with pytest.raises(ValueError, match=r"is (shorter|longer) than argument"):
        check_probe(served[:3], expected, atol=1.0)
    with pytest.raises(ValueError, match="measure must be 'mean' or 'max'"):
        check_probe(served, expected, atol=1.0, measure="median")  # type: ignore[arg-type]


def test_the_probe_file_round_trips_and_refuses_a_wrong_count(tmp_path: Path) -> None:
    assert read_adapter_probe(tmp_path) is None
    write_adapter_probe(tmp_path, [5, 6, 7], [-0.5, -0.25])
    assert read_adapter_probe(tmp_path) == ([5, 6, 7], [-0.5, -0.25])
    with pytest.raises(ValueError, match="need len\\(token_ids\\) - 1 log-probs"):
        write_adapter_probe(tmp_path, [5, 6, 7], [-0.5])
