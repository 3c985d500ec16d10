"""The load generator's pure parts: ramp parsing, the rate curve, departures, the header."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.loadgen import Ramp, replica_of


@pytest.mark.parametrize(
    ("text", "points"),
    [
        ("0:1,60:8,120:1", ((0.0, 1.0), (60.0, 8.0), (120.0, 1.0))),
        (" 0:0 , 10:2.5 ", ((0.0, 0.0), (10.0, 2.5))),
        ("5:3", ((5.0, 3.0),)),
    ],
)
def test_parse(text: str, points: tuple[tuple[float, float], ...]) -> None:
    assert Ramp.parse(text).points == points


@pytest.mark.parametrize(
    "text", ["", "1", "a:b", "0:1,0:2", "10:1,5:1", "0:-1", "-1:1", "0:1,,5:2"]
)
def test_parse_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        Ramp.parse(text)


@pytest.mark.parametrize(
    ("t", "rate"),
    [(-1.0, 1.0), (0.0, 1.0), (30.0, 4.5), (60.0, 8.0), (90.0, 4.5), (120.0, 1.0), (500.0, 1.0)],
)
def test_rate_is_linear_between_points(t: float, rate: float) -> None:
    assert Ramp.parse("0:1,60:8,120:1").rate_at(t) == pytest.approx(rate)


def test_zero_rate_sends_nothing() -> None:
    assert Ramp.parse("0:0,10:0").departures() == []
    sent = Ramp.parse("0:0,10:0,10.5:0,20:2").departures()
    assert sent and min(sent) > 10.0


@given(st.lists(st.tuples(st.floats(0.5, 20.0), st.floats(0.0, 10.0)), min_size=1, max_size=5))
def test_departures_follow_the_integral(steps: list[tuple[float, float]]) -> None:
    t, points = 0.0, [(0.0, steps[0][1])]
    for dt, rate in steps:
        t += dt
        points.append((round(t, 3), rate))
    ramp = Ramp(tuple(points))
    total = sum((t1 - t0) * (r0 + r1) / 2 for (t0, r0), (t1, r1) in itertools.pairwise(points))
    sent = ramp.departures()
    assert sent == sorted(sent)
    assert all(0 < x <= ramp.duration_s + 1e-6 for x in sent)
    # the 10 ms integration step may move the count by one either way
    assert abs(len(sent) - math.floor(total)) <= 1


@pytest.mark.parametrize(
    ("header", "replica"),
    [
        ("arm=a; replica=local-3; reason=prefix_hit; predicted_hit_tokens=0", "local-3"),
        ("arm=a; replica=-; reason=no_healthy_replica; predicted_hit_tokens=0", None),
        ("", None),
        (None, None),
    ],
)
def test_replica_of(header: str | None, replica: str | None) -> None:
    assert replica_of(header) == replica
