"""`--dp-routing`: prefix by default when KV events are published, refused without them."""

from __future__ import annotations

import json

import msgspec
import pytest

from protocol.kv_events import KVEventsConfig
from services.api.prefix_router import PrefixRouter
from services.api.server import build_parser, prefix_router_for
from tests.api.fake_engine_client import engine_config

EVENTS = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="ipc:///nowhere/kv")


def parse(*argv: str):
    return build_parser().parse_args(["--model", "m", *argv])


def test_prefix_routing_is_the_default_when_events_are_published():
    with_events = msgspec.structs.replace(engine_config(), kv_events=EVENTS)
    router = prefix_router_for(parse("--dp-prefix-max-imbalance", "3"), with_events)
    assert isinstance(router, PrefixRouter) and router.max_imbalance == 3
    assert prefix_router_for(parse("--dp-routing", "load"), with_events) is None
    assert prefix_router_for(parse(), engine_config()) is None, "no events: load"


def test_prefix_routing_without_published_events_is_refused():
    with pytest.raises(ValueError, match="kv-events-config"):
        prefix_router_for(parse("--dp-routing", "prefix"), engine_config())
    recorded_only = msgspec.structs.replace(
        engine_config(), kv_events=KVEventsConfig(enable_kv_cache_events=True)
    )
    with pytest.raises(ValueError, match="kv-events-config"):
        prefix_router_for(parse("--dp-routing", "prefix"), recorded_only)
    with pytest.raises(ValueError, match="non-negative"):
        prefix_router_for(
            parse("--dp-prefix-max-imbalance", "-1"),
            msgspec.structs.replace(engine_config(), kv_events=EVENTS),
        )


def test_the_kv_events_flag_reaches_the_engine_args():
    value = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq"})
    assert parse("--kv-events-config", value).kv_events_config == value


def test_weft_serve_refuses_events_other_hosts_reach_without_curve(tmp_path):
    """Issue 44 #1: before, the default bound tcp://*:5557, unauthenticated."""
    exposed = msgspec.structs.replace(
        engine_config(), kv_events=msgspec.structs.replace(EVENTS, endpoint="tcp://*:5557")
    )
    for routing in ("prefix", "load"):  # refused whether or not the API itself subscribes
        with pytest.raises(ValueError, match="needs CurveZMQ"):
            prefix_router_for(parse("--dp-routing", routing), exposed)
    assert prefix_router_for(parse("--zmq-curve-keys", str(tmp_path)), exposed) is not None
