"""The Grafana dashboard shipped in the Helm chart, built with grafana-foundation-sdk.

`make dashboard` (`python -m splitserve.dashboard --output helm/splitserve/dashboards/
splitserve.json`) rewrites the committed JSON; a test fails when it differs from `build()`. What
the panels show lives in splitserve/dashboard_panels.py; this module lays them out as Grafana
rows and panels with the variables every query filters on: the Prometheus data source,
`model_name`, `engine` and `pod`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import prometheus as prometheus_models

from splitserve.dashboard_panels import ROWS, PanelSpec

JSON_PATH = Path(__file__).resolve().parents[1] / "helm/splitserve/dashboards/splitserve.json"
DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
HEIGHT = 8
VARIABLES = (
    ("model_name", "label_values(vllm:num_requests_running, model_name)", False),
    ("engine", 'label_values(vllm:num_requests_running{model_name="$model_name"}, engine)', True),
    ("pod", 'label_values({model_name="$model_name", engine=~"$engine"}, pod)', True),
)
"""(name, query, is_multi) of each query variable, in the order Grafana resolves them. A multi
variable offers All, which matches every value, and series without the label too."""


def _variables() -> list[Builder[models.VariableModel]]:
    found: list[Builder[models.VariableModel]] = [
        builders.DatasourceVariable("DS_PROMETHEUS").label("datasource").type("prometheus")
    ]
    for name, query, is_multi in VARIABLES:
        variable = (
            builders.QueryVariable(name)
            .label(name)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(models.VariableSort.ALPHABETICAL_ASC)
        )
        if is_multi:
            variable = variable.multi(True).include_all(True).all_value(".*")
        found.append(variable)
    return found


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | heatmap.Panel:
    is_heatmap = spec.kind == "heatmap"
    panel: timeseries.Panel | heatmap.Panel
    if is_heatmap:
        panel = heatmap.Panel().calculate(False).show_legend().show_tooltip()
    else:
        panel = timeseries.Panel().legend(_legend())
    panel = (
        panel.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .height(HEIGHT)
        .span(spec.width)
    )
    for i, query in enumerate(spec.queries):
        target = (
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + i))
            .expr(query.expr)
            .legend_format(query.legend)
            .range()
        )
        if is_heatmap:
            target = target.format(prometheus_models.PromQueryFormat.HEATMAP)
        panel = panel.with_target(target)
    return panel


def build() -> dict[str, Any]:
    """The dashboard as Grafana JSON (a dict, as committed)."""
    board = (
        builders.Dashboard("splitserve")
        .uid("splitserve")
        .description("vLLM's panels, errors, the hops of the split stack and recovery.")
        .tags(["splitserve", "vllm"])
        .editable()
        .timezone("browser")
        .time("now-30m", "now")
        .refresh("10s")
        .variables(_variables())
    )
    next_id = 1
    for row in ROWS:  # expanded rows: their panels follow them on the dashboard's top level
        board = board.with_row(builders.Row(row.title).id(next_id).collapsed(False))
        for panel in row.panels:
            next_id += 1
            board = board.with_panel(_panel(panel, next_id))
        next_id += 1
    encoded: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return encoded


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows' panels included)."""
    return [target["expr"] for panel in panels(board) for target in panel.get("targets", [])]


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that is not a row, in order (a row's own panels follow it)."""
    found: list[dict[str, Any]] = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write splitserve's Grafana dashboard JSON.")
    parser.add_argument("--output", type=Path, help=f"file to write (e.g. {JSON_PATH})")
    args = parser.parse_args(argv)
    text = render()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
