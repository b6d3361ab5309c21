"""A real Prometheus server (Debian's `prometheus`) scraping a running stack, for tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from splitserve.loopback_ports import free_ports

SCRAPE_INTERVAL = "1s"


class PrometheusServer:
    """Started with a config that scrapes the given /metrics URLs; stopped by PID. Each target's
    series get the label pod=<its job name>, as Prometheus Operator's ServiceMonitor gives them
    the pod's name (the dashboard's `pod` variable)."""

    def __init__(self, targets: dict[str, str], workdir: Path) -> None:
        self.binary = shutil.which("prometheus")
        self.targets = targets
        self.workdir = workdir
        self.port = free_ports(1)[0]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        jobs = []
        for job, url in self.targets.items():
            parsed = urllib.parse.urlparse(url)
            jobs.append(
                {
                    "job_name": job,
                    "metrics_path": parsed.path,
                    "static_configs": [{"targets": [parsed.netloc], "labels": {"pod": job}}],
                }
            )
        return json.dumps(
            {
                "global": {
                    "scrape_interval": SCRAPE_INTERVAL,
                    "evaluation_interval": SCRAPE_INTERVAL,
                },
                "scrape_configs": jobs,
            }
        )

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        assert self.binary is not None, "prometheus is not installed"
        config = self.workdir / "prometheus.yml"
        config.write_text(self._config())  # JSON is YAML
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir}/data",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # ready, then every target scraped once
            try:
                health = self.targets_up()
                if len(health) == len(self.targets) and set(health.values()) == {"up"}:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError("prometheus did not start scraping every target")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def label_values(self, label: str, selector: str) -> list[str]:
        """Values of `label` on the series `selector` matches (Grafana's label_values())."""
        query = urllib.parse.urlencode({"match[]": selector})
        url = f"{self.url}/api/v1/label/{label}/values?{query}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return sorted(body["data"])

    def value(self, expr: str) -> float:
        """The single value of an instant query (summed over series)."""
        result = self.query(f"sum({expr})")
        return float(result[0]["value"][1]) if result else float("nan")

    def wait_for(self, expr: str, expected: float, timeout: float = 30.0) -> float:
        """Poll until `sum(expr)` equals `expected` (scrapes lag), returning the last value."""
        deadline = time.monotonic() + timeout
        value = float("nan")
        while time.monotonic() < deadline:
            value = self.value(expr)
            if value == expected:
                return value
            time.sleep(0.5)
        return value

    def settled(self, expr: str, timeout: float = 30.0) -> float:
        """`sum(expr)` once two reads a scrape interval apart agree (no scrape still pending)."""
        deadline = time.monotonic() + timeout
        value = self.value(expr)
        while time.monotonic() < deadline:
            time.sleep(1.1)
            again = self.value(expr)
            if again == value:
                return value
            value = again
        return value

    def targets_up(self) -> dict[str, str]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as reply:
            active = json.load(reply)["data"]["activeTargets"]
        return {t["labels"]["job"]: t["health"] for t in active}
