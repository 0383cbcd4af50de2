"""The README's disaggregated prefill/decode commands work as written.

- ``weft pd up``, read from the README's "Disaggregated prefill/decode"
  section (not copied here), runs as it is written there; the test appends
  only ``--port`` (a free one: 8000 may be taken on a shared machine) and a
  KV-block count (two servers share this machine's memory with the test's
  oracle). Through it, greedy completions equal an ordinary engine's, and the
  decode server loads the prompt's KV instead of computing it
  (``vllm:external_prefix_cache_hits`` > 0).
- The by-hand commands of the same section pass the proxy's secret to the
  proxy and both servers, and the keys folder to the service and both
  connectors (parsed by the real parsers; nothing starts).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from protocol import SamplingParams
from protocol.curve import SERVER, load_keys
from services.api.server import build_parser as serve_parser
from services.config.kv_transfer_args import resolve_kv_transfer_config
from services.kv_transfer import trust
from services.kv_transfer.proxy import build_parser as proxy_parser
from services.kv_transfer.service import build_parser as service_parser
from services.model_files import resolve
from services.ports import free_port
from tests.polling import wait_for
from tests.text_corpus import prompt_of_length
from tests.utils import REPO_ROOT

MODEL = resolve(None)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
STARTUP_DEADLINE_S = 600.0  # two model loads on two shared cores
TEST_ONLY = ["--num-gpu-blocks-override", "64"]


def readme_section_lines() -> list[str]:
    """The section's bash blocks, one command a line (continuations joined)."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Disaggregated prefill/decode\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def readme_section_commands() -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in readme_section_lines()]


def readme_command(*prefix: str) -> list[str]:
    (argv,) = [argv for argv in readme_section_commands() if argv[: len(prefix)] == list(prefix)]
    return argv


def test_the_by_hand_commands_pass_the_secret_and_the_keys(tmp_path):
    commands = readme_section_commands()
    keys = readme_command("weft", "keys")[3]
    # The set-up lines run for real (this checkout's `weft`): they make the keys and a private secret.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "weft").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m services.cli "$@"\n')
    (bin_dir / "weft").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT)}
    setup = [line for line in readme_section_lines() if "weft keys" in line or "secrets.token" in line]
    assert len(setup) == 2
    subprocess.run(["sh", "-c", "\n".join(setup)], cwd=tmp_path, env=env, check=True, timeout=60)
    secret = f"{keys}/kv-transfer-secret"
    assert trust.load_secret(tmp_path / secret)  # refuses a file others may read
    load_keys(tmp_path / keys, SERVER)
    service = service_parser().parse_args(readme_command("weft", "kv-transfer")[2:])
    assert service.zmq_curve_keys == keys
    serves = [serve_parser().parse_args(c[2:]) for c in commands if c[:2] == ["weft", "serve"]]
    assert len(serves) == 2
    roles = set()
    for args in serves:
        assert args.kv_transfer_secret_file == secret
        kv = resolve_kv_transfer_config(args.kv_transfer_config)
        assert kv.kv_connector_extra_config["keys_dir"] == keys and kv.kv_port == service.port
        roles.add(kv.kv_role)
    assert roles == {"kv_producer", "kv_consumer"}
    proxy = proxy_parser().parse_args(readme_command("weft", "pd-proxy")[2:])
    assert proxy.kv_transfer_secret_file == secret
    assert proxy.prefill == [
        f"http://127.0.0.1:{a.port}" for a in serves if "producer" in a.kv_transfer_config
    ]
    assert proxy.decode == [
        f"http://127.0.0.1:{a.port}" for a in serves if "consumer" in a.kv_transfer_config
    ]


@pytest.fixture(scope="module")
def pd_up(tmp_path_factory):
    argv = readme_command("weft", "pd", "up")
    port = free_port()
    log = tmp_path_factory.mktemp("pd-up") / "pd-up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv[1:], "--port", str(port), *TEST_ONLY],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    children: set[psutil.Process] = set()

    def ready() -> str | None:
        children.update(psutil.Process(proc.pid).children(recursive=True))
        assert proc.poll() is None, f"weft pd up exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        text = log.read_text()
        return text if "weft pd up: ready:" in text else None

    try:
        text = wait_for(ready, STARTUP_DEADLINE_S, "weft pd up: ready", interval_s=0.5)
        decode = re.search(r"weft pd up: decode: (\S+)", text).group(1)
        yield f"http://127.0.0.1:{port}", decode
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        finally:
            for child in children:  # only if the launcher did not stop them itself
                if child.is_running():
                    child.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def oracle():
    from services import LLM

    llm = LLM(str(MODEL.weights), num_gpu_blocks_override=64)
    yield llm
    llm.shutdown()


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.slow
def test_weft_pd_up_transfers_the_prompt_and_answers_as_one_server_would(pd_up, oracle):
    url, decode = pd_up
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = counter(decode, EXTERNAL_HITS)
    prompt = prompt_of_length(oracle.tokenizer, 330, offset=101)
    response = client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=8, temperature=0)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = oracle.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text
    assert response.choices[0].text == expected
    loaded = counter(decode, EXTERNAL_HITS) - before
    # Loaded, not computed: every prompt token but the last (the partial block too), as vLLM's connectors.
    assert loaded == len(prompt) - 1
    assert response.usage.prompt_tokens_details.cached_tokens == loaded
    # The proxy alone holds the secret: a client cannot hand the decode server parameters of its own.
    forged = httpx.post(
        decode + "/v1/completions",
        json={"model": MODEL.name, "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
        timeout=60,
    )
    assert forged.status_code == 403, forged.text
    assert json.loads(forged.text)  # a JSON error, not a crash
