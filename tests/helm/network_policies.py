"""Evaluate the chart's NetworkPolicies: would a connection from one peer to another be let
through (both the source's egress and the destination's ingress policies)?"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tests.helm.chart_render import (
    Doc,
    Manifests,
    component_of,
    labels_match,
    only_container,
    pod_labels,
)


@dataclass(frozen=True)
class Peer:
    """A traffic endpoint: a pod (labels, namespace, named ports) or a client outside the cluster."""

    labels: Mapping[str, str] = field(default_factory=dict)
    namespace: str | None = None  # None: outside the cluster
    ports: Mapping[str, int] = field(default_factory=dict)


def _peer_matches(rule_peers: list[Doc] | None, peer: Peer, policy_ns: str) -> bool:
    if rule_peers is None:
        return True
    for p in rule_peers:
        if "ipBlock" in p:
            return True
        if peer.namespace is None:
            continue
        ns_sel = p.get("namespaceSelector")
        ns_ok = (
            peer.namespace == policy_ns
            if ns_sel is None
            else labels_match(
                ns_sel.get("matchLabels", {}), {"kubernetes.io/metadata.name": peer.namespace}
            )
        )
        pod_sel = p.get("podSelector")
        pod_ok = pod_sel is None or labels_match(pod_sel.get("matchLabels", {}), peer.labels)
        if ns_ok and pod_ok:
            return True
    return False


def _port_matches(rule_ports: list[Doc] | None, port: int, target: Peer) -> bool:
    if rule_ports is None:
        return True
    for p in rule_ports:
        wanted = p["port"]
        if wanted == port or (isinstance(wanted, str) and target.ports.get(wanted) == port):
            return True
    return False


def allowed(m: Manifests, src: Peer, dst: Peer, port: int) -> bool:
    """Would the chart's NetworkPolicies let `src` open a connection to `dst`:`port`?"""
    policies = m.of_kind("NetworkPolicy")

    def side(direction: str, subject: Peer, other: Peer) -> bool:
        selecting = [
            p
            for p in policies
            if subject.namespace == m.namespace
            and direction in p["spec"]["policyTypes"]
            and labels_match(p["spec"]["podSelector"]["matchLabels"], subject.labels)
        ]
        if not selecting:
            return True
        key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        return any(
            _peer_matches(rule.get(peers_key), other, m.namespace)
            and _port_matches(rule.get("ports"), port, dst)
            for policy in selecting
            for rule in policy["spec"].get(key, [])
        )

    return side("Egress", src, dst) and side("Ingress", dst, src)


def peers(m: Manifests) -> dict[str, Peer]:
    found = {}
    for workload in m.workloads():
        container = only_container(workload)
        found[component_of(workload)] = Peer(
            pod_labels(workload),
            m.namespace,
            {p["name"]: p["containerPort"] for p in container["ports"]},
        )
    found["client"] = Peer()
    found["monitoring"] = Peer({"app": "prometheus"}, "monitoring")
    found["ingress"] = Peer({"app": "nginx"}, "ingress-nginx")
    found["other-pod"] = Peer({"app": "other"}, m.namespace)
    return found
