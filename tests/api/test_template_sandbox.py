"""Request-supplied chat templates (``--trust-request-chat-template``) run in a sandbox (issue 44, item 7).

The attacks: ``{% set s = 'a' * 1000000000 %}`` took the API to 4 GB; four templates of nested
loops held every /tokenize and chat for 30 s; SIGTERM then left the process alive. Now each
render runs in a subprocess with a memory limit and a kill timer, ``*`` and ``**`` are
checked in the jinja sandbox, and a template's size is capped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import httpx
import psutil
import pytest

from services.api import template_sandbox
from services.api.chat_args import ChatSettings
from services.api.limits import ServingLimits
from services.ports import free_port
from tests.api.fake_engine_client import http_client, make_app
from tests.polling import wait_for

MESSAGES = [{"role": "user", "content": "Hi"}]
LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def trusted(monkeypatch):
    # Room for a child's start on a loaded machine; the endless templates' test shortens it.
    monkeypatch.setattr(template_sandbox, "TIMEOUT_S", 30.0)
    monkeypatch.setattr(template_sandbox, "MEMORY_BYTES", 256 << 20)
    app, engine = make_app(chat=ChatSettings(trust_request_chat_template=True))
    return http_client(app, timeout=60), engine


def _tokenize(client, template: str | None = None):
    body = {"messages": MESSAGES} | ({} if template is None else {"chat_template": template})
    return client.post("/tokenize", json=body)


def _refused(response, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and words in error["message"], error


async def test_huge_repetitions_and_powers_are_refused_before_they_cost(trusted):
    client, _ = trusted
    _refused(await _tokenize(client, "{% set s = 'a' * 1000000000 %}{{ s }}"), "sandbox refuses")
    _refused(await _tokenize(client, "{{ [1, 2] * 1000000000 }}"), "sandbox refuses")
    _refused(await _tokenize(client, "{{ 10 ** 100000000 }}"), "sandbox refuses")
    ok = await _tokenize(
        client, "{{ 'ab' * 3 }}{{ 2 ** 10 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert ok.status_code == 200 and ok.json()["count"] > 0


async def test_a_template_past_its_memory_is_stopped_in_its_own_process(trusted):
    client, _ = trusted
    doubling = (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    )
    server = psutil.Process()
    before = server.memory_info().rss
    _refused(await _tokenize(client, doubling + "{{ ns.s | length }}"), "memory")
    assert server.memory_info().rss - before < 200 << 20  # the server never held the string


async def test_endless_templates_are_killed_and_others_are_served_meanwhile(trusted, monkeypatch):
    client, engine = trusted
    monkeypatch.setattr(template_sandbox, "TIMEOUT_S", 2.0)
    endless = [asyncio.ensure_future(_tokenize(client, LOOPS)) for _ in range(4)]
    # The server's own template and plain prompts are not queued behind them.
    assert (await _tokenize(client)).status_code == 200
    assert (await client.post("/tokenize", json={"prompt": "Hello"})).status_code == 200
    chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200 and not all(e.done() for e in endless)
    for response in await asyncio.gather(*endless):
        _refused(response, "did not finish rendering")
    assert not _sandboxes(psutil.Process())


async def test_a_template_over_the_size_cap_is_refused(trusted):
    client, _ = trusted
    big = "{# " + "x" * template_sandbox.MAX_TEMPLATE_CHARS + " #}"
    response = await _tokenize(client, big)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    assert "at most" in response.json()["error"]["message"]


async def test_a_rendered_text_past_the_text_limit_is_refused(monkeypatch):
    app, _ = make_app(
        chat=ChatSettings(trust_request_chat_template=True), limits=ServingLimits(max_prompt_chars=100)
    )
    response = await _tokenize(http_client(app, timeout=60), "{{ 'a' * 1000 }}")
    _refused(response, "--max-prompt-chars")


_SERVER = textwrap.dedent(
    """
    import sys
    from services.api import template_sandbox
    from services.api.chat_args import ChatSettings
    from services.api import graceful
    from tests.api.fake_engine_client import make_app

    template_sandbox.TIMEOUT_S = 600.0  # only SIGTERM may end the render here
    graceful._FLUSH_GRACE_S = 0.0  # uvicorn cancels what still runs once the drain's second is up
    app, _ = make_app(chat=ChatSettings(trust_request_chat_template=True))
    graceful.serve(app, host="127.0.0.1", port=int(sys.argv[1]), shutdown_timeout_s=1.0, log_level="warning")
    """
)


@pytest.mark.slow
def test_sigterm_stops_a_server_rendering_an_endless_template():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), 60, "the server to answer")

        def sandbox():
            return next(iter(_sandboxes(psutil.Process(server.pid))), None)

        body = {"messages": MESSAGES, "chat_template": LOOPS}
        with httpx.Client(base_url=url, timeout=120) as http:
            request = _in_background(lambda: http.post("/tokenize", json=body))
            child = wait_for(sandbox, 60, "the template to render in its sandbox")
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0
            wait_for(
                lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 30, "the sandbox"
            )
            request.join(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _sandboxes(process: psutil.Process) -> list[psutil.Process]:
    return [c for c in process.children() if "services.api.template_sandbox" in c.cmdline()]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/version", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _in_background(call):
    import threading

    def run():
        try:
            call()
        except httpx.HTTPError:
            pass  # the server went away mid-request: expected

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
