"""engines.pd (docs/deploy.md, "Prefill/decode disaggregation"): a prefill and a decode engine
group (LeaderWorkerSets), each engine core started with --kv-transfer-config in its role and its
own engine id, and the smg gateway in PD mode (static --prefill/--decode, or kubernetes discovery
by the pd-role label); what cannot work is refused at render time. Launched too: the CPU ci
values' two groups run as local processes (local_cluster.py) and a chat goes through both."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helm import chart_render as cr
from tests.helm.launched import launched, pod_counter
from tests.helm.local_cluster import LocalCluster
from tests.helm.test_engine_groups import flag_values_after, gateway_args

PD = cr.load_values(cr.CI_DIR / "cpu-pd-values.yaml")
ENGINES_VALUES = cr.CI_DIR / "cpu-engines-values.yaml"


def _leader(m: cr.Manifests, role: str) -> Any:
    lws = m.get("LeaderWorkerSet", f"{m.release}-engine-{role}")
    return lws, lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]


def test_prefill_and_decode_groups_get_their_roles_and_ids() -> None:
    m = cr.render(cr.deep_merge(PD, {"engines": {"pd": {"decodeReplicas": 2,
                                                   "extraConfig": {"lease_seconds": 20}}}}))  # fmt: skip
    assert not [w for w in m.of_kind("LeaderWorkerSet") if w["metadata"]["name"] ==
                f"{m.release}-engine"]  # fmt: skip
    for role, kv_role, replicas in (("prefill", "kv_producer", 1), ("decode", "kv_consumer", 2)):
        lws, leader = _leader(m, role)
        assert lws["spec"]["replicas"] == replicas
        assert leader["metadata"]["labels"]["splitserve.dev/pd-role"] == role
        core = {c["name"]: c for c in leader["spec"]["containers"]}["core"]
        engine = f"{m.release}-engine-{role}"
        assert cr.flag_value(core["args"], "--engine-id") == f"{role}-$(ENGINE_INDEX)"
        host = f"{engine}-$(ENGINE_INDEX)-1.{engine}.{cr.NAMESPACE}.svc.{cr.CLUSTER_DOMAIN}"
        assert cr.flag_value(core["args"], "--worker-addrs") == f"{host}:50071"
        config = json.loads(cr.flag_value(core["args"], "--kv-transfer-config") or "")
        assert config == {"kv_connector": "GrpcConnector", "kv_role": kv_role,
                          "engine_id": f"{role}-$(ENGINE_INDEX)",
                          "kv_connector_extra_config": {"lease_seconds": 20}}  # fmt: skip


def test_the_gateway_runs_in_pd_mode_with_static_urls() -> None:
    m = cr.render(PD)
    args = gateway_args(m)
    assert "--pd-disaggregation" in args and "--worker-urls" not in args
    for role in ("prefill", "decode"):
        engine = f"{m.release}-engine-{role}"
        url = f"grpc://{engine}-0.{engine}.{cr.NAMESPACE}.svc.{cr.CLUSTER_DOMAIN}:50051"
        assert flag_values_after(args, f"--{role}") == [url]


def test_kubernetes_discovery_selects_each_groups_leaders() -> None:
    m = cr.render(cr.deep_merge(PD, {"gateway": {"discovery": "kubernetes"}}))
    args = gateway_args(m)
    assert "--selector" not in args
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        selector = dict(s.split("=", 1) for s in flag_values_after(args, f"--{role}-selector"))
        assert cr.labels_match(selector, _leader(m, role)[1]["metadata"]["labels"])
        assert not cr.labels_match(selector, _leader(m, other)[1]["metadata"]["labels"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"engines": {"autoscaling": {"enabled": True}}}, "autoscaling is not supported"),
        ({"parallelism": {"tensorParallelSize": 2}}, "engines of one rank"),
        ({"gateway": {"enabled": False}}, "engines.pd needs the gateway"),
    ],
)
def test_values_that_cannot_work_are_refused(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        cr.render(cr.deep_merge(PD, extra))


def test_the_gateway_allows_a_long_prefill_its_silence() -> None:
    args = gateway_args(cr.render(PD))
    assert flag_values_after(args, "--worker-wedge-secs") == ["60"]
    assert "--worker-wedge-secs" not in gateway_args(cr.render(cr.load_values(ENGINES_VALUES)))


@pytest.fixture(scope="module")
def pd_cluster(
    tmp_path_factory: pytest.TempPathFactory, cpu_kernels_dir: Path | None
) -> Iterator[tuple[cr.Manifests, LocalCluster]]:
    manifests = cr.render(PD)
    with launched(manifests, tmp_path_factory.mktemp("pd"), cpu_kernels_dir) as local:
        yield manifests, local


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.extended
def test_a_chat_goes_through_the_prefill_and_the_decode_group(
    pd_cluster: tuple[cr.Manifests, LocalCluster],
) -> None:
    """Launched from the rendered chart: the gateway sends the prefill leg to the prefill group,
    the decode group's rank pulls the prompt's KV from the prefill group's rank (their pods'
    DNS names, mutual TLS) instead of computing it."""
    manifests, local = pd_cluster
    host = f"{manifests.release}-gateway.{cr.NAMESPACE}.svc.{cr.CLUSTER_DOMAIN}"
    client = openai.OpenAI(
        base_url=f"http://{local.address(host, 8000)}/v1", api_key="-", max_retries=0, timeout=60
    )
    cores = {flag_values_after(p.argv, "--engine-id")[0]: p for p in local.pods_of("core")}
    assert sorted(cores) == ["decode-0", "prefill-0"]
    before = pod_counter(cores["decode-0"], "vllm:external_prefix_cache_hits_total")
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "river stone light window garden"}],
        max_tokens=4,
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage is not None
    deadline = time.monotonic() + 10
    while (hits := pod_counter(cores["decode-0"], "vllm:external_prefix_cache_hits_total")) == (
        before
    ):
        assert time.monotonic() < deadline, "the decode engine loaded nothing from the prefill one"
        time.sleep(0.2)
    assert hits - before == reply.usage.prompt_tokens
    (frontend,) = [p for p in local.pods_of("frontend") if "-engine-prefill-" in p.name]
    computed = pod_counter(frontend, "vllm:prompt_tokens_total", "metrics")
    assert computed >= reply.usage.prompt_tokens  # the prefill engine computed the prompt
