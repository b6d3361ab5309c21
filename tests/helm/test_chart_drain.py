"""The chart's pods drain like `splitserve up` (issue 11, item 7): the frontend's and the core's
--shutdown-timeout end before the kubelet's SIGKILL (terminationGracePeriodSeconds), so running
requests finish or are aborted cleanly instead of being cut."""

from __future__ import annotations

import pytest

from tests.helm.chart_render import Manifests, flag_value, only_container, pod_spec, render

DRAINING = ("frontend", "core")
MARGIN_S = 5
"""What the chart leaves between the end of the drain and SIGKILL (closing the server, exit)."""


def _drain_and_grace(manifests: Manifests, component: str) -> tuple[float, float]:
    workload = manifests.workload(component)
    timeout = flag_value(only_container(workload)["args"], "--shutdown-timeout")
    assert timeout is not None, f"the {component} has no --shutdown-timeout"
    return float(timeout), float(pod_spec(workload)["terminationGracePeriodSeconds"])


@pytest.mark.parametrize("component", DRAINING)
def test_the_drain_ends_before_the_kubelet_kills(
    default_manifests: Manifests, component: str
) -> None:
    timeout, grace = _drain_and_grace(default_manifests, component)
    assert 0 < timeout <= grace - MARGIN_S


def test_the_drain_follows_the_grace_period() -> None:
    manifests = render(
        {
            "frontend": {"terminationGracePeriodSeconds": 120},
            "core": {"terminationGracePeriodSeconds": 3},
        }
    )
    assert _drain_and_grace(manifests, "frontend") == (115.0, 120.0)
    assert _drain_and_grace(manifests, "core") == (1.0, 3.0)  # never 0: that would not drain
