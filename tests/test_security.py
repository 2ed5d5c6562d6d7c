"""The control plane against another local user (docs/reliability.md, "Security model").

Each attack from the audit (issue #11, point 3) is tried with real processes: the receiver process, and a
second connection opened by the test playing the hostile user, who can reach the port but does not hold the
receiver's secret. `vllm serve --api-key` gets the same treatment on the routes streamsync drives.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import anyio
import psutil
import pytest
import torch

from streamsync import WeightSync
from streamsync.engines.receiver import ReceiverEngine
from streamsync.errors import EngineError
from streamsync.models.synthetic import StateModule, mixed_specs
from streamsync.pack import TensorSpec, plan_layout
from streamsync.receiver.protocol import proof
from streamsync.testing.receiver import ReceiverProcess
from streamsync.transports.shm import MEMFD_PREFIX


@pytest.fixture(scope="module")
def rx(mixed_specs_path):
    with ReceiverProcess(str(mixed_specs_path), name="rx-sec") as rp:
        yield rp


def _hostile(rp: ReceiverProcess, timeout: float = 10.0) -> tuple[socket.socket, dict]:
    """A connection from someone without the secret; returns it and the receiver's greeting."""
    s = socket.create_connection(("127.0.0.1", rp.port), timeout=timeout)
    return s, json.loads(s.makefile("rb").readline())


def _reply(s: socket.socket) -> dict:
    return json.loads(s.makefile("rb").readline())


async def test_a_forged_version_without_the_secret_is_refused(rx):
    engine = rx.engine()
    before = await engine.get_version()
    for forged in ([{"op": "start"}, {"op": "finish", "version": 424242}],
                   [{"op": "auth", "nonce": "0" * 32, "mac": "0" * 64}, {"op": "finish", "version": 424242}]):
        s, hello = _hostile(rx)
        with s:
            assert "challenge" in hello and "ok" not in hello  # nothing is served before authentication
            s.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in forged))
            reply = _reply(s)
            assert reply["ok"] is False
            assert reply["error"] in ("authentication failed", 'authentication required: the first message must '
                                      'be {"op": "auth", "nonce", "mac"}')
            assert rx.secret not in json.dumps(reply)
            assert s.recv(100) == b""  # and the connection is closed: the second line was never read as an op
    assert await engine.get_version() == before
    assert (await engine.call("status"))["updating"] is False
    await engine.close()


async def test_shutdown_without_the_secret_is_refused(rx):
    s, _ = _hostile(rx)
    with s:
        s.sendall(b'{"op": "shutdown"}\n')
        assert _reply(s)["ok"] is False
    time.sleep(0.3)
    assert rx.proc.poll() is None
    engine = rx.engine()
    assert await engine.call("ping") == "pong"
    await engine.close()


async def test_a_client_with_the_wrong_secret_cannot_connect(rx):
    engine = ReceiverEngine("127.0.0.1", rx.port, secret=secrets.token_hex(32), name="guess")
    with pytest.raises(EngineError, match="refused the connection: authentication failed"):
        await engine.get_version()
    await engine.close()


async def test_a_receiver_that_cannot_prove_the_secret_is_not_trusted():
    # Someone else listening on the port the trainer was told (the receiver died, another user took the port).
    with socket.create_server(("127.0.0.1", 0)) as impostor:

        def answer() -> None:
            conn, _ = impostor.accept()
            with conn:
                conn.sendall(b'{"challenge": "' + b"1" * 32 + b'"}\n')
                conn.makefile("rb").readline()
                conn.sendall(b'{"ok": true, "result": {"mac": "' + b"0" * 64 + b'"}}\n')
                conn.recv(100)

        threading.Thread(target=answer, daemon=True).start()
        engine = ReceiverEngine("127.0.0.1", impostor.getsockname()[1], secret=secrets.token_hex(32), timeout=10)
        with pytest.raises(EngineError, match="could not prove it holds the secret"):
            await engine.start_update()
        await engine.close()


async def test_idle_connections_do_not_block_a_push(rx, mixed_specs_path):
    hostile, _ = _hostile(rx)  # says nothing after the greeting
    idle = rx.raw_socket()  # an authenticated client that went quiet
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=2048, timeout=20)
    try:
        report = await sync.push(StateModule(mixed_specs(), fill="random", seed=11), version=7)
        assert report.chunks > 1
        assert await engine.get_version() == 7
    finally:
        await sync.close()
        idle.close()
    # The one that never authenticated is dropped once the handshake time (5 s) is up.
    hostile.settimeout(15)
    t0 = time.monotonic()
    assert hostile.recv(100) == b""
    assert time.monotonic() - t0 < 10
    hostile.close()


def test_a_client_trickling_bytes_is_dropped_when_the_handshake_time_is_up(rx):
    s, _ = _hostile(rx)
    t0 = time.monotonic()
    with s:
        try:
            while time.monotonic() - t0 < 15:  # one byte a second: no single read ever waits long
                s.sendall(b"{")
                time.sleep(1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - t0 < 9  # the handshake as a whole gets 5 s


async def test_waiting_handshakes_are_capped_and_the_slots_come_back(rx):
    waiting = [_hostile(rx)[0] for _ in range(64)]
    try:
        s, hello = _hostile(rx)
        with s:
            assert hello == {"ok": False, "error": "too many connections waiting to authenticate; try again"}
        with pytest.raises(EngineError, match="refused the connection: too many connections waiting"):
            await rx.engine().get_version()
    finally:
        for w in waiting:
            w.close()
    time.sleep(0.5)
    engine = rx.engine()
    assert await engine.call("ping") == "pong"
    await engine.close()


def test_a_receiver_started_by_hand_writes_its_secret_to_a_private_new_file(mixed_specs_path, tmp_path):
    path = tmp_path / "secret"
    cmd = [sys.executable, "-m", "streamsync.receiver.process", "--specs", str(mixed_specs_path)]
    env = {k: v for k, v in os.environ.items() if k != "STREAMSYNC_RECEIVER_SECRET"}
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "no secret" in refused.stderr
    proc = subprocess.Popen([*cmd, "--secret-file", str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        assert path.stat().st_mode & 0o777 == 0o600
        secret = path.read_text().strip()
        assert len(secret) == 64 and secret not in " ".join(psutil.Process(proc.pid).cmdline())

        async def ping() -> str:
            engine = ReceiverEngine("127.0.0.1", port, secret=secret)
            try:
                return await engine.call("ping")
            finally:
                await engine.close()

        assert anyio.run(ping) == "pong"
    finally:
        proc.terminate()
        proc.wait(30)
    again = subprocess.run([*cmd, "--secret-file", str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "FileExistsError" in again.stderr  # never reuses a file someone may have placed


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_a_huge_line_is_refused_without_memory_growth(rx):
    before = _rss(rx.pid)
    s, _ = _hostile(rx)
    block = b"x" * (1 << 20)
    sent = 0
    with s:
        try:
            for _ in range(192):  # a 192 MiB line with no newline
                s.sendall(block)
                sent += len(block)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 64 << 20  # the receiver hung up long before the end
        try:
            reply = _reply(s)
            assert reply == {"ok": False, "error": "line longer than 4096 bytes before authentication"}
        except (ConnectionResetError, json.JSONDecodeError):
            pass  # the reason may be lost to the reset when the sender kept writing; the cut is what matters
    assert _rss(rx.pid) - before < 32 << 20


def test_an_authenticated_line_over_the_limit_is_refused_with_a_reason(rx):
    with rx.raw_socket() as s:
        s.sendall(b'{"op": "ping", "pad": "' + b"x" * (8 << 20) + b'"}\n')
        reply = _reply(s)
        assert reply == {"ok": False, "error": f"request line longer than {8 << 20} bytes: connection closed"}
        assert s.recv(100) == b""


async def test_a_wait_longer_than_the_owner_allows_is_refused(rx):
    engine = rx.engine(timeout=10)
    info = {"transport": "collective", "backend": "gloo", "group": "g", "master_addr": "127.0.0.1",
            "master_port": 1, "world_size": 2, "rank_offset": 1, "workers": 1, "timeout_s": 1e9}
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"timeout_s must be in \(0, 600\] s here"):
        await engine.init_transfer(info)
    assert time.monotonic() - t0 < 5
    await engine.close()


async def test_a_token_prefix_is_refused_and_errors_never_show_the_token(rx):
    token = secrets.token_hex(8)
    fd = os.memfd_create(f"{MEMFD_PREFIX}{token}", os.MFD_CLOEXEC)  # a segment as the trainer makes them
    os.ftruncate(fd, 4096)
    layout = plan_layout([TensorSpec("model.norm.weight", torch.float32, (13,))]).to_json()
    engine = rx.engine()
    try:
        await engine.init_transfer({"transport": "shm"})
        await engine.start_update()
        for guess in (token[:1], token[:-1], token + "0"):
            with pytest.raises(EngineError, match="token mismatch") as err:
                await engine.update({"layout": layout,
                                     "handle": {"pid": os.getpid(), "fd": fd, "token": guess, "nbytes": 4096}})
            assert token not in str(err.value)
        # The exact token is accepted: the refusals above are the token check, not a broken handle.
        await engine.update({"layout": layout, "handle": {"pid": os.getpid(), "fd": fd, "token": token,
                                                          "nbytes": 4096}})
    finally:
        await engine.abort_update()
        await engine.close()
        os.close(fd)


def test_the_listener_is_bound_to_loopback_only(rx):
    listening = [c.laddr for c in psutil.Process(rx.pid).net_connections(kind="inet") if c.status == "LISTEN"]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", rx.port)]
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in others:  # the same port on any other address of this machine is closed
        with pytest.raises(OSError):
            socket.create_connection((ip, rx.port), timeout=2).close()


def test_proofs_bind_the_connection():
    secret = secrets.token_hex(32)
    a = proof(secret, "client", "c" * 32, "n" * 32)
    assert a != proof(secret, "server", "c" * 32, "n" * 32)  # a server cannot replay the client's proof
    assert a != proof(secret, "client", "d" * 32, "n" * 32)  # nor anyone a proof from another connection
    assert secret not in a


# ------------------------------------------------------------------------------------ vllm serve --api-key
# One keyed server for this module (~30 s, ~2.5 GB here); the key goes in through the environment.

ROUTES = [("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
          ("POST", "/finish_weight_update"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"),
          ("POST", "/reset_prefix_cache"), ("GET", "/weight_info"), ("GET", "/is_paused"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    from streamsync.engines.vllm.launch import VllmServer
    from streamsync.testing.vllm import cpu_env

    cpu_env()
    key = secrets.token_urlsafe(24)
    with VllmServer(model_dir, api_key=key, log=tmp_path_factory.mktemp("serve") / "keyed.log") as s:
        yield s, key


@pytest.mark.vllm
@pytest.mark.slow
async def test_vllm_serve_routes_refuse_requests_without_the_key(keyed_server):
    import aiohttp

    server, key = keyed_server
    assert key not in " ".join(psutil.Process(server.proc.pid).cmdline())  # not readable by other users
    tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    listening = {(p.pid, c.laddr.ip, c.laddr.port) for p in tree for c in p.net_connections(kind="inet")
                 if c.status == "LISTEN"}
    assert (server.proc.pid, "127.0.0.1", server.port) in listening
    assert {ip for _, ip, _ in listening} <= {"127.0.0.1", "::1"}, listening  # nothing on other interfaces
    async with aiohttp.ClientSession() as s:
        for method, path in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"}):
                async with s.request(method, server.url + path, headers=headers, json={}) as r:
                    assert r.status == 401, (method, path, headers)
        async with s.get(server.url + "/health") as r:
            assert r.status == 200  # probes stay open
        async with s.get(server.url + "/is_paused", headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200 and (await r.json())["is_paused"] is False


@pytest.mark.vllm
@pytest.mark.slow
async def test_the_http_engine_with_the_key_pushes_and_without_it_is_refused(keyed_server, model_dir):
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.testing.vllm import trainer_from

    server, key = keyed_server
    keyless = VllmHttpEngine(server.url, name="keyless", timeout=30)
    with pytest.raises(EngineError, match="HTTP 401"):
        await keyless.get_version()
    await keyless.close()
    engine = VllmHttpEngine(server.url, name="keyed", api_key=key)
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    async with sync.paused():
        assert await engine.is_paused()
        await sync.push(trainer_from(model_dir, step=3), version=5)
    assert await engine.get_version() == 5
    await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_streamsync_run_reaches_a_keyed_server_through_the_variable_its_spec_names(keyed_server, model_dir,
                                                                                     tmp_path):
    from pathlib import Path

    server, key = keyed_server
    root = Path(__file__).resolve().parents[1]
    spec = root / "pipelines" / "checkpoint-to-server.toml"
    cmd = [sys.executable, "-m", "streamsync", "run", str(spec), "--set", f"model.path={model_dir}",
           "--set", f"engines.0.url={server.url}", "--set", f'work_dir="{tmp_path}"', "--set", "sync.pushes=1"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "STREAMSYNC_LOG": "warning"}
    keyed = subprocess.run([*cmd, "--set", "engines.0.api_key_env=ROLLOUT_KEY"], env={**env, "ROLLOUT_KEY": key},
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert keyed.returncode == 0, keyed.stderr
    assert "weights equal the trainer's bit for bit: True" in keyed.stdout
    keyless = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert keyless.returncode == 2 and "HTTP 401" in keyless.stderr, keyless.stderr
    assert keyless.stderr.count("\n") == 1, keyless.stderr  # one line, no traceback


def test_the_middleware_takes_the_keys_vllm_was_started_with():
    # `--api-key` reaches middleware only through the app's parsed arguments: a real Starlette app holding them.
    pytest.importorskip("vllm")
    from argparse import Namespace

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from streamsync.vllm.server.auth import RequireApiKey

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/pause", "/health")])
    app.state.args = Namespace(api_key=["k1", "k2"])
    app.add_middleware(RequireApiKey)
    client = TestClient(app)
    assert client.post("/pause").status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer k3"}).status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert client.post("//pause").status_code == 401  # every path but the open ones, however spelled
    assert client.get("/health").status_code == 200
