"""Renderings of the chart shared by the helm tests (each rendered once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.kernel_cache import built_cpu_kernels
from tests.helm.chart_render import CI_DIR, Manifests, render, render_values_file
from tests.helm.security_values import GIVEN, TLS_OFF, user_secrets


@pytest.fixture(scope="session")
def default_manifests() -> Manifests:
    return render()


@pytest.fixture(scope="session")
def cpu_manifests() -> Manifests:
    return render_values_file(CI_DIR / "cpu-values.yaml")


@pytest.fixture(scope="session")
def gpu_manifests() -> Manifests:
    return render_values_file(CI_DIR / "gpu-tp2-pp2-values.yaml")


@pytest.fixture(scope="session")
def tls_off_manifests() -> Manifests:
    return render(TLS_OFF)


@pytest.fixture(scope="session")
def given_manifests() -> Manifests:
    """Every certificate from the user's Secrets, an API key, public TLS, both Ingresses."""
    return render(GIVEN)


@pytest.fixture(scope="session")
def user_secret_data() -> dict[str, dict[str, str]]:
    """The Secrets GIVEN names, with real certificates."""
    return user_secrets()


@pytest.fixture(scope="session")
def cpu_kernels_dir() -> Path | None:
    """This machine's build of the workers' CPU kernels (worker_caches.py)."""
    return built_cpu_kernels()
