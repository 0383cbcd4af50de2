"""Client-set ``kv_transfer_params`` on a P/D server: refused (403) unless
the request carries the P/D proxy's secret; the proxy's own requests pass."""

from __future__ import annotations

import os

import msgspec
import pytest

from protocol.kv_transfer import KVTransferConfig
from services.kv_transfer import trust
from tests.api.fake_engine_client import engine_config, http_client, make_app

PARK = {"do_remote_prefill": True, "remote_num_tokens": 4096}  # would park the request waiting for KV
SECRET = "proxy-secret"


def consumer_config():
    kv = KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_consumer")
    return msgspec.structs.replace(engine_config(), kv_transfer=kv)


@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ],
)
async def test_a_client_set_remote_prefill_without_the_proxy_key_is_refused(secret, path, body):
    app, engine = make_app(config=consumer_config(), kv_transfer_secret=secret)
    async with http_client(app) as client:
        for headers in ({}, {trust.HEADER: "a guess"}):
            response = await client.post(path, json={**body, "kv_transfer_params": PARK}, headers=headers)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["param"] == "kv_transfer_params"
        assert engine.requests == []  # nothing reached the engine
        plain = await client.post(path, json=body)  # the same request without the params is served
        assert plain.status_code == 200
        if secret is not None:  # the proxy's request is accepted, its params passed on
            trusted = await client.post(
                path, json={**body, "kv_transfer_params": PARK}, headers={trust.HEADER: SECRET}
            )
            assert trusted.status_code == 200
            assert engine.requests[-1].kv_transfer_params.remote_num_tokens == 4096


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(trust.ENV, raising=False)
    assert trust.load_secret(None) is None
    monkeypatch.setenv(trust.ENV, "from-env")
    assert trust.load_secret(None) == "from-env"
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    os.chmod(path, 0o600)
    assert trust.load_secret(path) == "from-file"
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        trust.load_secret(path)


@pytest.mark.asyncio
async def test_an_api_without_kv_transfer_config_still_requires_the_proxy_key():
    """The engines behind this API may be consumers started with their own
    ``engine-core --kv-transfer-config``: the API's config does not tell, so the
    secret is required for any kv_transfer_params."""
    app, engine = make_app(config=engine_config(), kv_transfer_secret=SECRET)
    async with http_client(app) as client:
        body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": PARK}
        refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["param"] == "kv_transfer_params"
        assert engine.requests == []
        trusted = await client.post("/v1/completions", json=body, headers={trust.HEADER: SECRET})
        assert trusted.status_code == 200
