"""`streamsync plan`: a sharded push planned from shapes alone, its bytes, bounding link and refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streamsync.cli import main
from streamsync.plan.scale import Engines, Links, Trainer, cpu_seconds, predict
from streamsync.plan.shapes import PRESETS, Shape

TINY_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_experts": 8, "vocab_size": 1000, "torch_dtype": "bfloat16"}


def test_cli_json_bytes_add_up_to_the_model_times_the_engines(capsys):
    assert main(["plan", "qwen3-8b", "--trainer", "tp=4,pp=2,dp=2", "--engines", "3", "--engine-tp", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = Shape(PRESETS["qwen3-8b"]).parameters() * 2
    assert out["model_bytes"] == model
    # every engine receives the model once; TP2 workers each hold the norms whole (a few KB more)
    assert 3 * model <= out["plan_bytes"] <= 3 * model * 1.001
    assert out["received_per_worker"]["mean"] * 6 == pytest.approx(out["plan_bytes"])
    assert out["bound"]["kind"] in ("nic-tx", "nic-rx") and out["bound"]["who"]
    # the finite check of what each rank holds (2000 GB/s by default), then the busiest link's bytes at 50 GB/s
    assert out["check_s"] == pytest.approx(out["held_per_rank"]["max"] / 2000e9)
    assert out["predicted_s"] == pytest.approx(out["check_s"] + out["bound"]["bytes"] / 50e9)


def test_cli_text_names_the_bounding_link():
    r = subprocess.run([sys.executable, "-m", "streamsync", "plan", "qwen3-30b-a3b", "--trainer",
                        "tp=4,pp=2,ep=4,dp=2", "--engines", "2", "--engine-tp", "2", "--engine-ep", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "bounding link" in r.stdout and "predicted push" in r.stdout
    assert "engine e" in r.stdout or "trainer rank" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--trainer", "tp=3"], ["tp=3", "kv heads"]),
    (["--trainer", "tp=2,ep=3"], ["ep=3", "8 experts"]),
    (["--engine-tp", "3"], ["engine tp=3"]),
    (["--engine-tp", "2", "--engine-ep", "3"], ["ep=3", "tp=2"]),
    (["--trainer", "tp=2,zz=1"], ["zz=1", "KEY=N"]),
    (["--cpu-cores", "0"], ["cpu cores", "got 0"]),
])
def test_bad_layouts_are_refused_naming_what_is_wrong(tmp_path, capsys, args, words):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MOE))
    assert main(["plan", str(cfg), *args]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_unknown_model_is_refused(capsys):
    assert main(["plan", "no-such-model"]) == 2
    assert "qwen3-8b" in capsys.readouterr().err


def test_layer_repetition_matches_planning_every_layer():
    shape = Shape(TINY_MOE)
    for trainer, engines in [(Trainer(tp=2, pp=2, ep=2, dp=2), Engines(2, 2, 4)),
                             (Trainer(fsdp=4), Engines(1, 2)), (Trainer(tp=4, pp=3), Engines(3, 4))]:
        fast = predict(shape, trainer, engines, Links(), bucket_bytes=1 << 14)
        full = predict(shape, trainer, engines, Links(), bucket_bytes=1 << 14, full=True)
        assert fast.planned_layers < full.planned_layers == 6
        assert fast.plan_bytes == full.plan_bytes >= shape.parameters() * 2 * engines.count
        assert fast.received == full.received
        assert sum(fast.sent.values()) == sum(full.sent.values())
        # replicas break ties per planned layer: the busiest link may differ a little, never much
        assert fast.seconds == pytest.approx(full.seconds, rel=0.1)


def test_presets_have_their_published_sizes():
    sizes = {n: Shape(c).parameters() / 1e9 for n, c in PRESETS.items()}
    assert sizes["qwen3-8b"] == pytest.approx(8.2, abs=0.1)
    assert sizes["qwen3-235b-a22b"] == pytest.approx(235, abs=1)
    assert sizes["deepseek-v3"] == pytest.approx(671, abs=1)
    assert sizes["kimi-k2"] == pytest.approx(1026, abs=5)


def test_a_cpu_host_bounds_by_its_processes_cpu_time_over_its_cores():
    """`cpu_cores`: every process's CPU time (per byte sent, per byte received, per bucket taken part in) shares
    the node's cores; with fast links that is the bound, and it grows with the per-bucket cost."""
    shape = Shape(TINY_MOE)
    trainer, engines = Trainer(fsdp=4, per_node=64), Engines(1, 2, per_node=64)
    fast = Links(nic_gbit=8e4, nvlink_gbyte=1e4, copy_gbyte=1e4, colocated=True)  # one node: every process
    base = predict(shape, trainer, engines, fast, bucket_bytes=1 << 14)
    cpu = Links(**{**fast.__dict__, "cpu_cores": 2, "cpu_tx_ns": 1.0, "cpu_rx_ns": 2.0})
    pred = predict(shape, trainer, engines, cpu, bucket_bytes=1 << 14)
    assert pred.bound["kind"] == "cpu" and pred.bound["who"] == "node 0"
    work = sum(pred.sent.values()) * 1e-9 + sum(pred.received.values()) * 2e-9
    assert pred.seconds == pytest.approx(work / 2) and pred.seconds > base.seconds
    per_bucket = predict(shape, trainer, engines, Links(**{**cpu.__dict__, "cpu_bucket_us": 100.0,
                                                           "cpu_rx_bucket_us": 100.0}), bucket_bytes=1 << 14)
    # each bucket: the ranks that send in it and the workers that receive in it, 100 us each, over 2 cores
    assert per_bucket.seconds > pred.seconds + per_bucket.buckets * 2 * 100e-6 / 2
    one_core = predict(shape, trainer, engines, Links(**{**cpu.__dict__, "cpu_cores": 1}), bucket_bytes=1 << 14)
    assert one_core.seconds == pytest.approx(2 * pred.seconds)


def test_the_finite_check_comes_before_the_push_and_ranks_on_a_cpu_host_share_its_cores():
    """`check_gbyte`: every rank scans what it holds before any byte moves (replicas too), so its time adds to
    the push's; on a CPU host the ranks of a node scan on its shared cores."""
    shape = Shape(TINY_MOE)
    model = shape.parameters() * 2
    engines = Engines(1, 2)
    for trainer, copies in [(Trainer(fsdp=4), 1), (Trainer(tp=2, pp=2, ep=2, dp=2), 2)]:
        base = predict(shape, trainer, engines, Links(), bucket_bytes=1 << 14)
        checked = predict(shape, trainer, engines, Links(check_gbyte=1.0), bucket_bytes=1 << 14)
        # FSDP shards every tensor; megatron's TP ranks each hold the norms whole as well
        assert model * copies <= sum(checked.held.values()) <= model * copies * 1.02
        assert set(checked.held) == set(range(trainer.world))
        assert checked.check_seconds == pytest.approx(max(checked.held.values()) / 1e9)
        assert checked.seconds == pytest.approx(base.seconds + checked.check_seconds)
        assert checked.summary()["check_s"] == checked.check_seconds
    host = Links(check_gbyte=1.0, cpu_cores=2)
    shared = predict(shape, Trainer(fsdp=4, per_node=64), Engines(1, 2, per_node=64), host, bucket_bytes=1 << 14)
    assert shared.check_seconds == pytest.approx(model / 2 / 1e9)  # four ranks' scans on two cores


def test_the_cpu_model_charges_each_process_its_pushes_pieces_and_the_engines_rounds():
    """Per push, a trainer rank (even one that sends nothing) and an engine worker each pay their fixed CPU
    cost; per piece each side pays its own; rank 0, which holds the engines, pays per bucket per worker; and
    the ranks' agreement adds per rank beyond the first."""
    shape = Shape(TINY_MOE)
    trainer, engines = Trainer(tp=2, dp=2, per_node=64), Engines(1, 2, per_node=64)
    links = Links(cpu_cores=64, cpu_push_us=1000.0, cpu_rx_push_us=2000.0, cpu_piece_us=10.0,
                  cpu_rx_piece_us=20.0, cpu_control_us=5.0)
    pred = predict(shape, trainer, engines, links, bucket_bytes=1 << 14)
    procs = pred.processes
    assert {w for w in procs if w.startswith("trainer")} == {f"trainer rank {r}" for r in range(4)}
    assert sum(p["pieces"] for w, p in procs.items() if w.startswith("trainer")) == sum(
        p["pieces"] for w, p in procs.items() if w.startswith("engine")) >= pred.pieces  # counted per layer
    worker = procs["engine e0 worker 0"]
    assert cpu_seconds(links, worker) == pytest.approx(2e-3 + worker["pieces"] * 20e-6)
    rank0 = procs["trainer rank 0"]
    assert rank0["control"] == sum(p["buckets"] for w, p in procs.items() if w.startswith("engine")) > 0
    assert cpu_seconds(links, rank0) == pytest.approx(1e-3 + rank0["pieces"] * 10e-6 + rank0["control"] * 5e-6)
    # 64 cores, so the busiest process bounds it
    assert pred.seconds == pytest.approx(max(cpu_seconds(links, p) for p in procs.values()))
    agree = predict(shape, trainer, engines, Links(**{**links.__dict__, "agree_ms": 2.0}), bucket_bytes=1 << 14)
    assert agree.seconds == pytest.approx(pred.seconds + 3 * 2e-3)


def test_engines_on_the_trainers_node_but_other_gpus_go_over_nvlink():
    """`first_gpu`: with colocated engines, worker 0 on that trainer GPU; one rank to a worker on the next GPU of
    its node is an NVLink transfer, on its own GPU a copy."""
    shape = Shape(TINY_MOE)
    links = Links(nvlink_gbyte=100.0, copy_gbyte=1000.0, colocated=True)
    own = predict(shape, Trainer(), Engines(1, 1), links)
    other = predict(shape, Trainer(), Engines(1, 1, first_gpu=1), links)
    assert own.link_bytes["same-gpu"] == other.link_bytes["intra-node"] == own.plan_bytes
    assert own.bound["kind"] == "copy" and other.bound["kind"] == "nvlink-tx"
    assert other.seconds == pytest.approx(other.plan_bytes / 100e9)
    assert main(["plan", "qwen3-8b", "--colocated", "--engine-first-gpu", "-1"]) == 2


def test_one_host_mode_uses_no_nic_and_every_prediction_says_what_it_assumed_and_how_to_calibrate(capsys):
    """A trainer and its engines on one machine go over NVLink (or the host), never a NIC; the output names the
    placement and rates it assumed and, until CPU costs are given, how to measure them."""
    assert main(["plan", "qwen3-8b", "--trainer", "tp=2", "--engine-tp", "2", "--json"]) == 0
    apart = json.loads(capsys.readouterr().out)
    assert apart["bound"]["kind"].startswith("nic") and "separate nodes" in apart["assumed"]["assumed"]
    assert "benchmarks.sharded" in apart["assumed"]["calibrate"]
    assert main(["plan", "qwen3-8b", "--trainer", "tp=2", "--engine-tp", "2", "--one-host", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["link_bytes"]["inter-node"] == 0 and not one["bound"]["kind"].startswith("nic")
    assert "one machine" in one["assumed"]["assumed"] and one["predicted_s"] < apart["predicted_s"]
    assert main(["plan", "qwen3-8b", "--one-host", "--cpu-cores", "2", "--host-gbyte", "2",
                 "--cpu-tx-ns", "0.5", "--cpu-rx-ns", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "2 CPU cores" in text and "calibrate" not in text
