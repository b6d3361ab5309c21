"""values.yaml is fully documented (helm-docs `# --` comments) and values.schema.json guards it."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.helm.chart_render import CHART_DIR, ci_values_files, load_values

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_./-]+):(\s|$)")


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART_DIR / "values.schema.json").read_text())
    return loaded


def documented_keys() -> list[tuple[str, bool]]:
    """(dotted key, has its own `# --` comment block right above it) for every values.yaml key."""
    result: list[tuple[str, bool]] = []
    stack: list[tuple[int, str]] = []
    comment_block: list[str] = []
    for line in (CHART_DIR / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment_block.append(stripped)
            continue
        match = KEY_LINE.match(line)
        if match is None:  # blank lines and list items of a default value
            comment_block = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([k for _, k in stack] + [match["key"]])
        result.append((dotted, any(c.startswith("# --") for c in comment_block)))
        stack.append((indent, match["key"]))
        comment_block = []
    return result


def undocumented_keys() -> list[str]:
    """Keys without a `# --` comment, except keys inside a default value that is documented as a
    whole (e.g. the fields of podSecurityContext, or of a probe), whose own keys carry none."""
    keys = documented_keys()
    own = {k for k, documented in keys if documented}
    missing = []
    for key, documented in keys:
        if documented:
            continue
        parts = key.split(".")
        ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
        whole_values = [
            a for a in ancestors if a in own and not any(k.startswith(a + ".") for k in own)
        ]
        if not whole_values:
            missing.append(key)
    return missing


def test_every_values_key_has_a_helm_docs_comment() -> None:
    assert len(documented_keys()) > 150
    missing = undocumented_keys()
    assert not missing, f"values.yaml keys without a `# --` comment: {missing}"


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """Follow $ref, and an allOf without own properties to its first $ref / properties part."""
    if "$ref" in node:
        resolved: dict[str, Any] = root["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return _resolve(resolved, root)
    if "properties" not in node and "allOf" in node:
        for part in node["allOf"]:
            if "$ref" in part or "properties" in part:
                return _resolve(part, root)
    return node


def _schema_node(node: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The schema of the value at `path`; None below a free-form object, {} when undeclared."""
    root = schema()
    for part in path:
        node = _resolve(node, root)
        props = node.get("properties")
        if props is None:
            return None  # a free-form object: anything below is the user's
        if part not in props:
            return {}
        node = props[part]
    return node


def test_schema_describes_every_values_key() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    missing = []

    def walk(node: Any, path: list[str]) -> None:
        found = _schema_node(schema(), path)
        if found == {}:
            missing.append(".".join(path))
            return
        if found is None or not isinstance(node, dict):
            return
        if _resolve(found, schema()).get("additionalProperties") is not False:
            return  # free-form map (labels, resources, securityContext ...)
        for key, child in node.items():
            walk(child, [*path, key])

    walk(values, [])
    assert not missing, f"values.yaml keys missing from values.schema.json: {missing}"


@pytest.mark.parametrize("path", ci_values_files(), ids=lambda p: p.name)
def test_ci_values_validate_against_the_schema(path: Any) -> None:
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        chart.validate_schema(load_values(path))


def test_defaults_validate_against_the_schema_as_plain_jsonschema() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema())
    jsonschema.validate(values, schema())


BAD_VALUES = [
    pytest.param({"parallelism": {"tensorParallelSize": 0}}, "minimum", id="tp-zero"),
    pytest.param({"parallelism": {"pipelineParallelSize": "2"}}, "string", id="pp-string"),
    pytest.param({"frontend": {"replica": 3}}, "replica", id="typo-key"),
    pytest.param({"bogus": True}, "bogus", id="unknown-top-level-key"),
    pytest.param({"model": {"source": "s3"}}, "source", id="bad-model-source"),
    pytest.param({"model": {"source": "pvc"}}, "existingClaim", id="pvc-without-claim"),
    pytest.param({"core": {"gpuMemoryUtilization": 1.5}}, "maximum", id="gpu-util-above-1"),
    pytest.param({"core": {"dtype": "fp8"}}, "dtype", id="bad-dtype"),
    pytest.param({"worker": {"port": 70000}}, "maximum", id="port-out-of-range"),
    pytest.param({"worker": {"device": "tpu"}}, "device", id="bad-device"),
    pytest.param({"logLevel": "verbose"}, "logLevel", id="bad-log-level"),
    pytest.param({"logFormat": "logfmt"}, "logFormat", id="bad-log-format"),
    pytest.param({"cache": {"sizeLimit": "lots"}}, "sizeLimit", id="bad-quantity"),
    pytest.param({"image": {"digest": "abc"}}, "digest", id="bad-digest"),
    pytest.param(
        {"metrics": {"serviceMonitor": {"interval": "soon"}}}, "interval", id="bad-duration"
    ),
    pytest.param(
        {"metrics": {"prometheusRule": {"alerts": {"kvCacheUsage": {"threshold": 95}}}}},
        "threshold",
        id="kv-threshold-percent",
    ),
    pytest.param({"frontend": {"service": {"type": "ExternalName"}}}, "type", id="svc-type"),
    pytest.param({"tlsSecrets": [{"name": "x", "certificate": "c"}]}, "key", id="tls-no-key"),
]


@pytest.mark.parametrize(("values", "expected"), BAD_VALUES)
def test_schema_rejects_bad_values(values: dict[str, Any], expected: str) -> None:
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert expected in str(err.value)


def test_rendering_refuses_bad_values() -> None:
    import helm_python as helm

    from tests.helm.chart_render import render_files

    with pytest.raises(helm.HelmError):
        render_files({"parallelism": {"tensorParallelSize": -1}})
