"""``--kv-transfer-config``: parsing, validation, and where it may be given."""

from __future__ import annotations

import json

import pytest

from services.config.cli_args import add_engine_args, engine_args_from
from services.config.engine_args import EngineArgs
from services.config.kv_transfer_args import (
    SharedStorageOptions,
    connector_options,
    resolve_kv_transfer_config,
    with_kv_transfer_config,
)
from services.engine_core.cli import engine_args
from services.engine_core.cli import parse_args as engine_core_args

ZMQ = {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": 15000}


def test_json_and_dicts_resolve_to_the_same_frozen_config():
    from_json = resolve_kv_transfer_config(json.dumps(ZMQ))
    assert from_json == resolve_kv_transfer_config(ZMQ)
    assert (from_json.kv_ip, from_json.kv_port, from_json.is_consumer, from_json.is_producer) == (
        "127.0.0.1",
        15000,
        True,
        False,
    )
    assert resolve_kv_transfer_config(None) is None and resolve_kv_transfer_config("") is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"kv_role": "kv_producer"}, "needs kv_connector"),
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
            "one of SharedStorageConnector, ZmqConnector",
        ),
        ({"kv_connector": "ZmqConnector", "kv_role": "prefill"}, "kv_role"),
        ({"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": 0}, "kv_port"),
        ({**ZMQ, "kv_buffer_device": "cuda"}, "kv_buffer_device"),
        ({**ZMQ, "kv_connector_extra_config": {"shared_storage_path": "/x"}}, "shared_storage_path"),
        ({**ZMQ, "kv_connector_extra_config": {"timeout_s": -1}}, "timeout_s"),
    ],
)
def test_bad_configs_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        resolve_kv_transfer_config(value)


def test_shared_storage_options_have_defaults():
    config = resolve_kv_transfer_config({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"})
    assert connector_options(config) == SharedStorageOptions()


def test_engine_args_carry_it_and_refuse_what_cannot_work():
    config = EngineArgs(kv_transfer_config=ZMQ).create_engine_config()
    assert config.kv_transfer.kv_connector == "ZmqConnector"
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_transfer_config=ZMQ, enable_prefix_caching=False).create_engine_config()
    assert EngineArgs().create_engine_config().kv_transfer is None


def test_the_serve_flag_is_generated_from_the_engine_args():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-transfer-config", json.dumps(ZMQ)])
    assert engine_args_from(args).create_engine_config().kv_transfer.kv_port == 15000
    assert "kv_transfer_config" in EngineArgs.__dataclass_fields__


def test_engine_core_takes_it_and_passes_it_to_each_engine_process():
    argv = [
        "--headless",
        "--data-parallel-size",
        "1",
        "--data-parallel-address",
        "h",
        "--data-parallel-rpc-port",
        "1",
        "--kv-transfer-config",
        json.dumps(ZMQ),
    ]
    args = engine_core_args(argv)
    command = engine_args(args, 0, "tcp://h:1").to_argv()
    assert command[command.index("--kv-transfer-config") + 1] == json.dumps(ZMQ)
    with pytest.raises(SystemExit):
        engine_core_args([*argv[:-1], '{"kv_connector": "Nope"}'])


def test_an_engine_core_override_replaces_the_apis_choice():
    api_config = EngineArgs().create_engine_config()
    engine_config = with_kv_transfer_config(api_config, json.dumps(ZMQ))
    assert engine_config.kv_transfer.kv_role == "kv_consumer"
    assert with_kv_transfer_config(api_config, None) is api_config


def test_the_curve_keys_folder_secures_the_kv_transfer_unless_it_names_its_own():
    from services.config.kv_transfer_args import with_default_keys_dir

    config = EngineArgs(kv_transfer_config=ZMQ).create_engine_config()
    secured = with_default_keys_dir(config, "/keys")
    assert connector_options(secured.kv_transfer).keys_dir == "/keys"
    own = EngineArgs(kv_transfer_config={**ZMQ, "kv_connector_extra_config": {"keys_dir": "/other"}})
    kept = with_default_keys_dir(own.create_engine_config(), "/keys")
    assert connector_options(kept.kv_transfer).keys_dir == "/other"
    assert with_default_keys_dir(config, None) is config
    plain = EngineArgs().create_engine_config()
    assert with_default_keys_dir(plain, "/keys") is plain
