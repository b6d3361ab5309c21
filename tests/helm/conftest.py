"""Renderings of the chart shared by the helm tests (each rendered once per session)."""

from __future__ import annotations

import pytest

from tests.helm.chart_render import CI_DIR, Manifests, render, render_values_file


@pytest.fixture(scope="session")
def default_manifests() -> Manifests:
    return render()


@pytest.fixture(scope="session")
def cpu_manifests() -> Manifests:
    return render_values_file(CI_DIR / "cpu-values.yaml")


@pytest.fixture(scope="session")
def gpu_manifests() -> Manifests:
    return render_values_file(CI_DIR / "gpu-tp2-pp2-values.yaml")
