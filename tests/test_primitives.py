"""Every primitive at every world size, through the self-checks the demo also runs (bounded waits)."""

import dataclasses

import pytest
from conftest import worlds

import parallelkittens as pk
from parallelkittens.testing.primitive_checks import CHECKS, run_checks

_results: dict[int, object] = {}


def _run_all() -> list[dict]:
    return [dataclasses.asdict(r) for r in run_checks()]


def _rows(world: int) -> list[list[dict]]:
    """One spawn per world size runs every check; each test reads its own row."""
    if world not in _results:
        try:
            _results[world] = pk.spawn(_run_all, world, timeout=600)
        except Exception as e:  # reported by every test of this world
            _results[world] = e
    got = _results[world]
    if isinstance(got, Exception):
        raise got
    return got


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world", worlds())
def test_primitive(world, check):
    index = list(CHECKS).index(check)
    failures = [f"rank {r}: {rows[index]['op']}: {rows[index]['detail']}" for r, rows in enumerate(_rows(world))
                if not rows[index]["ok"]]
    assert not failures, "\n".join(failures)
