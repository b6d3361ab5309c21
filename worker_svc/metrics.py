"""Prometheus metrics of a worker rank: step time split by phase, KV blocks in use."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve_contracts.output_types import ModelRunnerOutput

STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ["model_name", "engine", "rank"]


class WorkerMetrics:
    """The rank's metric families; `bind` names the model, engine and rank (LoadModel says
    which, and a reload may say otherwise), and only then may steps be observed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._step = Histogram(
            "splitserve_worker_step_seconds",
            "Worker step time on the rank's clock, by phase: prepare_inputs, "
            "forward, sample, total (receipt of the step to its reply).",
            [*LABELS, "phase"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self._kv_blocks = Gauge(
            "splitserve_worker_kv_blocks_used",
            "KV blocks referenced by the rank's live requests.",
            LABELS,
            registry=registry,
        )
        self._tokens = Histogram(
            "splitserve_worker_step_tokens",
            "Tokens computed per step on this rank.",
            LABELS,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self._steps = Counter(
            "splitserve_worker_steps", "Steps this rank ran.", LABELS, registry=registry
        )

    def bind(self, model_name: str, engine: str, rank: int) -> None:
        values = (model_name, engine, str(rank))
        self.prepare = self._step.labels(*values, "prepare_inputs")
        self.forward = self._step.labels(*values, "forward")
        self.sample = self._step.labels(*values, "sample")
        self.total = self._step.labels(*values, "total")
        self.kv_blocks = self._kv_blocks.labels(*values)
        self.tokens = self._tokens.labels(*values)
        self.steps = self._steps.labels(*values)

    def observe_step(
        self, output: ModelRunnerOutput | None, num_tokens: int, total_seconds: float
    ) -> None:
        """One step; `output` is None on ranks that do not answer (not the output rank)."""
        self.steps.inc()
        self.total.observe(total_seconds)
        if num_tokens:
            self.tokens.observe(num_tokens)
        if output is None:
            return
        if output.timings is not None:
            self.prepare.observe(output.timings.prepare_inputs_seconds)
            self.forward.observe(output.timings.forward_seconds)
            self.sample.observe(output.timings.sample_seconds)
        self.kv_blocks.set(output.num_used_kv_blocks)
