"""`edgc simulate` cost sources: the GPU roofline model against hand arithmetic, the cost
profile's JSON, and CUDA timing done with events (CUDA mocked: CI has no GPU)."""

import json
import types

import pytest
import torch

from edgc.bench.simulate import (
    GPUS,
    ClusterSpec,
    CostProfile,
    DeviceTimer,
    EntropyCost,
    GPUSpec,
    OpCost,
    RooflineModel,
    SimOptions,
    StepProjection,
    find_gpu,
    load_cluster,
    match_gpu,
    profile_needs,
    simulate,
    stage_gradients,
    stage_sync,
)
from edgc.bench.simulate import profile as profile_module
from edgc.bench.simulate.costs import DDP_BUCKET_BYTES
from edgc.models.gpt2 import build_model

V100 = GPUS["V100-SXM2"]
V100_BW = 0.8 * 900e9  # 80% of the datasheet's 900 GB/s
LAT = 5e-6


# --- the table


def test_gpu_table_and_lookup():
    assert {"V100-SXM2", "A100-SXM4", "H100-SXM5", "H200"} <= set(GPUS)
    assert find_gpu("v100") is V100 and find_gpu("H100") is GPUS["H100-SXM5"] and find_gpu("A100") is GPUS["A100-SXM4"]
    assert ((V100.fp32_flops, V100.half_flops, V100.hbm_bandwidth, V100.half_dtype)
            == (15.7e12, 125e12, 900e9, "float16"))
    h100 = GPUS["H100-SXM5"]
    assert (h100.half_flops, h100.hbm_bandwidth, h100.half_dtype) == (989.5e12, 3.35e12, "bfloat16")  # dense bf16
    with pytest.raises(ValueError, match="unknown GPU 'K80'.*V100-SXM2"):
        find_gpu("K80")
    assert match_gpu("Tesla V100-SXM2-32GB") is V100
    assert match_gpu("NVIDIA H100 80GB HBM3") is GPUS["H100-SXM5"]
    assert match_gpu("NVIDIA H200") is GPUS["H200"]
    assert match_gpu("NVIDIA A10") is None and match_gpu("cpu (x86_64, 2 threads)") is None


def test_cluster_gpu_field():
    assert load_cluster("paper-2.5b").gpu_spec is V100
    assert load_cluster("paper-12.1b").gpu_spec is GPUS["H100-SXM5"]
    values = dict(name="c", preset="tiny", gpus=2, tp=1, pp=1, dp=2, bandwidth=1e9, latency=0.0, step_compute_s=1.0,
                  global_batch=8, micro_batch=1)
    assert ClusterSpec(**values).gpu_spec is None
    with pytest.raises(ValueError, match=r"ClusterSpec.gpu='TPU'.*unknown GPU"):
        ClusterSpec(**values, gpu="TPU")


# --- roofline arithmetic, by hand


def test_op_seconds_is_max_of_compute_and_memory_plus_launches():
    gpu = GPUSpec(name="G", aliases=(), fp32_flops=10e12, half_flops=100e12, fp64_flops=5e12, half_dtype="bfloat16",
                  hbm_bandwidth=1e12, launch_latency=5e-6, source="hand")
    model = RooflineModel(gpu=gpu, matmul_efficiency=0.5, bandwidth_efficiency=0.5)
    assert model.peak_matmul_flops == 10e12  # the tensor-core peak is not used for fp32 arithmetic
    # compute-bound matmul (fp32 working dtype): 1e12 flops at 5 TFLOP/s = 0.2 s; 1 GB at
    # 500 GB/s = 2 ms; 2 launches
    assert model.seconds(OpCost("mm", 1e12, 1e9, 2, matmul=True)) == pytest.approx(0.2 + 1e-5, rel=1e-12)
    # memory-bound: 1e9 flops (0.2 ms) against 1 GB (2 ms)
    assert model.seconds(OpCost("vec", 1e9, 1e9, 1)) == pytest.approx(2e-3 + 5e-6, rel=1e-12)
    assert (model.dtype, model.matmul_flops) == ("float32", 5e12)  # bf16 gradients, fp32 arithmetic
    with pytest.raises(ValueError, match="grad_bytes=1"):
        RooflineModel(gpu=gpu, element_bytes=1)


def test_lowrank_round_hand_computed_on_v100():
    # B = 3 matrices of (1024, 512) at r = 8, fp16 gradients compressed in float32 as the hook
    # does, over min(4 units, 3) = 3 batches: every op is memory-bound on a V100 (720 GB/s;
    # fp32 matmuls at 10.2 TFLOP/s, fp64 at 5.1)
    model = RooflineModel(gpu=V100)
    assert (model.grad_dtype, model.dtype, model.matmul_flops) == ("float16", "float32", 0.65 * 15.7e12)
    ops = model.lowrank_ops(1024, 512, 8, 3)
    by_name = {op.name: op for op in ops}
    assert by_name["P = M Q"].flops == 2 * 3 * 1024 * 512 * 8
    assert by_name["orthogonalise: Gram matrices P^T P (x2)"].flops == 2 * 2 * 3 * 1024 * 8 * 8
    mn, x = 3 * 1024 * 512, 3 * 1024 * 8  # gradient elements, P's elements
    nbytes = [
        3 * mn * (2 * 2 + 3 * 4),  # M made three times: read G (2) and E (2), write M, add into it (3·4)
        3 * (1024 * 512 + 512 * 8 + 1024 * 8) * 4,  # P = MQ
        2 * x * (4 + 2),  # P to fp16 and back
        2 * x * (4 + 8),  # P to float64 and back
        3 * x * 8,  # unit columns
        2 * (x + 3 * 64) * 8,  # two Gram matrices
        2 * 2 * 3 * 64 * 8,  # two shifts and Cholesky factors
        2 * 2 * x * 8,  # two triangular solves
        3 * (1024 * 512 + 1024 * 8 + 512 * 8) * 4,  # Q = MᵀP
        2 * 3 * 512 * 8 * 6 + 2 * 3 * 512 * 8 * 4,  # Q to fp16 and back, Q /= N
        3 * 3 * 512 * 8 * 4,  # keep Q
        3 * (1024 * 8 + 512 * 8) * 4 + mn * (4 + 2),  # E = M − P Qᵀ: read M, write E (fp16)
        3 * (1024 * 8 + 512 * 8) * 4 + mn * (2 * 4 + 2),  # P Qᵀ into the workspace, then the buckets
    ]
    assert [op.bytes for op in ops] == nbytes
    # per unit: M made 3x (copy, add), P, its casts, Cholesky-QR2's 13, Q, its casts and /N,
    # keep Q, E, the average and its copy out; per shape the dead-Q check's 2
    launches = 3 * (6 + 1 + 2 + 13 + 1 + 3 + 1 + 1 + 2) + 2
    assert sum(op.launches for op in ops) == launches
    expected = sum(nbytes) / V100_BW + launches * LAT
    assert model.lowrank(1024, 512, [8], 3) == {8: pytest.approx(expected, rel=1e-12)}
    # rank clipped as the hook does; no error feedback: one op fewer, and M made without E
    assert model.lowrank_ops(1024, 4, 8, 1)[1].flops == 2 * 1024 * 4 * 4
    assert len(RooflineModel(gpu=V100, error_feedback=False).lowrank_ops(1024, 512, 8, 3)) == len(ops) - 1
    # fp32 gradients: E added into the gradient, M gathered for each read, no casts
    fp32 = RooflineModel(gpu=V100, element_bytes=4).lowrank_ops(1024, 512, 8, 3)
    assert [op.name for op in fp32[:2]] == ["error feedback in (G += E)", "gather M into the workspace (x3)"]
    assert len(fp32) == len(ops) and fp32[0].bytes == 3 * mn * 4 and fp32[1].bytes == 3 * 2 * mn * 4
    # one unit: every op launched once for the whole batch
    one = RooflineModel(gpu=V100, units=1).lowrank_ops(1024, 512, 8, 3)
    assert sum(op.launches for op in one) == (6 + 1 + 2 + 13 + 1 + 3 + 1 + 1 + 2) + 2
    with pytest.raises(ValueError, match="orthogonalization"):
        RooflineModel(gpu=V100, orthogonalization="qr")


def test_working_dtype_is_the_hooks():
    from edgc.comm.units import working_dtype

    for grad in (torch.float16, torch.bfloat16, torch.float32):
        model = RooflineModel(gpu=GPUS["H100-SXM5"], element_bytes=grad.itemsize)
        assert model.dtype == str(working_dtype(grad)).removeprefix("torch.")


def test_orthogonalisation_paths_and_the_qr_fit():
    model = RooflineModel(gpu=V100, orthogonalization="householder")
    (gs,) = model.orthogonalize_ops(1024, 2, 3)  # r <= 2: Gram-Schmidt, one batch-wide loop
    assert gs.name == "orthogonalise P (Gram-Schmidt)" and gs.launches == 6 * 2 - 3
    assert gs.flops == 2 * 3 * 1024 * 2 * 2  # 2·B·m·r²
    # the Householder fit against the public torch.linalg.qr timings it was fitted to
    # (FlagGems PR #5586: single fp32 matrices; pytorch issue #143281: batches of 3x3)
    timings = {(128, 32, 1): 0.179e-3, (512, 64, 1): 0.259e-3, (4096, 4, 1): 0.074e-3, (8192, 8, 1): 0.112e-3,
               (3, 3, 32): 0.920e-3, (3, 3, 256): 6.865e-3}
    for (m, r, b), measured in timings.items():
        (qr,) = model.orthogonalize_ops(m, r, b)
        assert qr.name == "orthogonalise P (Householder QR)"
        assert model.seconds(qr) == pytest.approx(measured, rel=0.3), (m, r, b)


def test_gds_step_hand_computed():
    model = RooflineModel(gpu=V100)
    n = DDP_BUCKET_BYTES  # fp16: 2 buckets
    ops = model.gds_ops(n, 0.25, "histogram", 1000)
    # stride 4 x 2 bytes < 32-byte sectors: the sample reads the whole gradient
    nbytes = 2 * n + (2 * n + n) + n + (n + 4000) + 40_000
    launches = 3 * 2 + 2 + 3 + 1 + 10
    assert sum(op.bytes for op in ops) == nbytes and sum(op.launches for op in ops) == launches
    expected = nbytes / V100_BW + launches * LAT
    assert model.total_seconds(ops) == pytest.approx(expected, rel=1e-12)
    cost = model.entropy(0.25, "histogram", 1000)
    assert cost.fixed_seconds == pytest.approx(44_000 / V100_BW + 14 * LAT, rel=1e-12)
    assert cost.seconds(n) == pytest.approx(expected, rel=1e-9)
    # a sparse sample (stride 100 x 2 bytes > 32) reads one sector per sampled element
    sparse = {op.name: op for op in model.gds_ops(n, 0.01, "histogram", 1000)}
    assert sparse["sample every k-th element"].bytes == pytest.approx(n / 100 * 32 + 4 * n / 100)
    with pytest.raises(ValueError, match="entropy_estimator"):
        model.gds_ops(n, 0.25, "kde", 1000)


# --- the projection onto the paper's 2.5B cluster


def test_paper_2_5b_roofline_against_cpu_timing():
    cluster = load_cluster("paper-2.5b")
    opts = SimOptions()
    roofline = CostProfile(RooflineModel(gpu=cluster.gpu_spec, element_bytes=cluster.grad_bytes))
    proj = simulate(cluster, roofline, opts)
    assert roofline.origins.keys() == {"roofline:V100-SXM2"} and roofline.measured == 0
    none, psgd = proj.method("none"), proj.method("powersgd")
    # a V100's PowerSGD round over a stage's ~150M fp16 elements: a few passes over 300 MB at
    # 720 GB/s plus ~1000 launches, i.e. milliseconds
    assert 2e-3 < psgd.overhead_s < 30e-3
    assert psgd.step_s < none.step_s and psgd.sync_s < 0.2 * none.sync_s
    # the same step with the arithmetic timed on this CPU (rank 32 only, one matrix per shape)
    cpu = CostProfile(DeviceTimer("cpu", repeats=1, max_batch=1, entropy_elements=1 << 16))
    model = build_model(cluster.preset, block_size=cluster.seq_len, device="meta")
    stages = stage_gradients(model, cluster.tp, cluster.pp)
    shapes, _ = profile_needs(stages, opts)
    cpu.ensure_lowrank(shapes, [opts.rank_max])
    assert cpu.origins.keys() == {f"measured:{profile_module.device_name(torch.device('cpu'))}"}
    syncs = tuple(stage_sync(s, opts.rank_max, cluster, cpu, opts, entropy=False) for s in stages)
    cpu_step = StepProjection((opts.rank_max,) * cluster.pp, syncs, proj.compute_s, proj.t_mb)
    assert psgd.first.ranks == cpu_step.ranks
    assert psgd.step_s < cpu_step.step_s
    assert psgd.first.stages[0].compress_s < cpu_step.stages[0].compress_s / 10


# --- the profile file


def test_profile_file_records_origins_and_entropy_cost(tmp_path):
    profile = CostProfile(RooflineModel(gpu=V100))
    profile.ensure_lowrank({(256, 128): 4}, [4])
    profile.ensure_entropy(0.25, "histogram", 1000)
    assert sorted(r for (_, _, r) in profile.lowrank) == [1, 2, 3, 4]  # a model fills every rank up to the max
    assert profile.modelled == 5 and profile.batches[(256, 128, 4)] == 4
    path = tmp_path / "p.json"
    profile.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == 2 and [o["origin"] for o in d["origins"]] == ["roofline:V100-SXM2"]
    assert "not a measurement" in d["origins"][0]["detail"]
    again = CostProfile()
    again.load(path)
    assert again.lowrank == profile.lowrank and again.entropy == profile.entropy and again.origins == profile.origins
    # nothing to fill a missing shape from
    with pytest.raises(ValueError, match=r"no cost for a \(512, 128\) matrix"):
        again.ensure_lowrank({(512, 128): 1}, [4])
    again.ensure_lowrank({(256, 128): 4}, [8])  # a known shape: interpolated instead
    assert again.lowrank_seconds(256, 128, 8) == pytest.approx(2 * profile.lowrank[(256, 128, 4)])


def test_version_1_profile_still_loads(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({
        "format": "edgc-cost-profile", "version": 1, "sources": ["cuda: Tesla V100-SXM2-32GB, torch 2.5"],
        "lowrank": [{"m": 64, "n": 64, "rank": 8, "seconds_per_matrix": 1e-4}],
        "entropy": [{"gradient_sample_rate": 0.25, "estimator": "histogram", "bins": 1000,
                     "seconds_per_element": 1e-10}],
    }))
    profile = CostProfile()
    profile.load(path)
    assert profile.lowrank == {(64, 64, 8): 1e-4}
    assert profile.entropy[(0.25, "histogram", 1000)] == EntropyCost(0.0, 1e-10)
    assert list(profile.origins) == ["measured:cuda: Tesla V100-SXM2-32GB, torch 2.5"]


# --- timing on a device


def test_cpu_timer_times_the_hooks_round():
    timer = DeviceTimer("cpu", repeats=1, max_batch=2, entropy_elements=1 << 12)
    seconds = timer.lowrank(64, 32, [4, 100], 5)  # 100 is clipped to min(m, n) = 32
    assert set(seconds) == {4, 32} and all(s > 0 for s in seconds.values())
    cost = timer.entropy(0.25, "histogram", 100)
    assert cost.fixed_seconds >= 0 and cost.seconds_per_element >= 0 and cost.seconds(1 << 12) > 0
    assert timer.origin.startswith("measured:cpu")


def test_cuda_is_not_available_here_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeviceTimer("cuda")


def test_cuda_timing_uses_events_read_after_sync(monkeypatch):
    """On CUDA the clock is the GPU's: events around the work, read after the end event syncs.

    perf_counter around asynchronous launches would time the launches, so using it fails here.
    """
    log = []

    class FakeEvent:
        made = 0

        def __init__(self, enable_timing=False):
            assert enable_timing is True
            self.synced = False
            FakeEvent.made += 1
            self.index = FakeEvent.made

        def record(self, stream=None):
            assert stream == "stream0"
            log.append(f"record {self.index}")

        def synchronize(self):
            self.synced = True
            log.append(f"sync event {self.index}")

        def elapsed_time(self, end):
            assert end.synced, "read before the end event completed"
            log.append("elapsed")
            return {2: 4.0, 4: 2.0, 6: 3.0}[end.index]  # ms, per repeat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("device sync"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream0")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def no_wall_clock():
        raise AssertionError("perf_counter used to time CUDA work")

    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(perf_counter=no_wall_clock))
    timer = DeviceTimer("cuda", dtype="bfloat16", repeats=3)
    assert timer.origin == "measured:NVIDIA H100 80GB HBM3" and "CUDA events" in timer.detail
    seconds = timer.time(lambda: log.append("work"))
    assert seconds == pytest.approx(3e-3)  # median of 4, 2, 3 ms
    assert log[:2] == ["work", "device sync"]  # warm-up, then drain the queue before timing
    assert log[2:] == [
        *("record 1", "work", "record 2", "sync event 2", "elapsed"),
        *("record 3", "work", "record 4", "sync event 4", "elapsed"),
        *("record 5", "work", "record 6", "sync event 6", "elapsed"),
    ]
