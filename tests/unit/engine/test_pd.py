"""Prefill/decode disaggregation on CPU with the shared-memory transport.

Real spawned worker processes (one prefill P0, one decode D0) behind the engine
contract: outputs equal the local engine's bit for bit at max_num_seqs 1 in fp32;
publication reaches every worker and a worker's failed update blocks generation until
a newer full update; abort, the stop/stopped handshake and its counters; and faults —
a worker killed mid-request or hanging — end in a clear WorkerFailed within the
timeout with every process joined. (The same contract suite runs against this engine
with OURO_ENGINE_FACTORIES=ouro_cli.engine.pd:make_pd_engine.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ouro_cli.engine import LLM, GenerationBlocked, PublicationError, SamplingParams
from ouro_cli.engine.pd import PDEngine, WorkerFailed, make_pd_engine
from ouro_cli.testing import faults

from .conftest import prompts, tiny_model

OPTIONS = dict(device="cpu", max_num_seqs=1, kv_blocks=64, block_size=4, transport="shm")


def _params() -> list[SamplingParams]:
    common = dict(max_tokens=9, logprobs=0, ignore_eos=True)
    return [
        SamplingParams(seed=1, exit_threshold=0.5, **common),
        SamplingParams(seed=2, exit_threshold=0.5, exit_mode="delayed", min_loops=2, **common),
        SamplingParams(seed=3, max_loops=2, logprobs_mode="raw", **common),
        SamplingParams(seed=4, temperature=0.7, top_k=8, top_p=0.8, **common),
        SamplingParams(seed=5, max_tokens=1, logprobs=0),
        SamplingParams(seed=6, temperature=0.0, max_tokens=5, logprobs=0),
    ]


def _same(a, b) -> None:
    assert a.output_token_ids == b.output_token_ids
    assert a.exit_depths == b.exit_depths
    assert a.log_probs == b.log_probs  # bit for bit: float equality, no tolerance
    assert a.finish_reason == b.finish_reason and a.sampling_params == b.sampling_params


def _publish(engine, version: int, model) -> None:
    engine.start_weight_update(version)
    items = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    for i in range(0, len(items), 5):
        engine.update_weights(items[i : i + 5])
    engine.finish_weight_update()


@pytest.fixture(scope="module")
def pd():
    with faults.pd_faults({"D0": {"fail_update_version": 2}}):
        engine = make_pd_engine(tiny_model(0), [0], [1], timeout=30, **OPTIONS)
    yield engine
    engine.close()


def test_pd_outputs_equal_the_local_engine_bit_for_bit(pd):
    assert isinstance(pd, PDEngine) and pd.transport == "shm" and pd.devices() == {"cpu"}
    ps, params = prompts(6, seed=3), _params()
    local = LLM(tiny_model(0), max_num_seqs=1, kv_blocks=64, block_size=4)
    expected = local.generate(ps, params)
    got = pd.generate(ps, params)
    for a, b in zip(got, expected, strict=True):
        _same(a, b)
    assert {len(o.output_token_ids) for o in got} == {9, 1, 5} and all(o.weight_version == 0 for o in got)
    counters = pd.work_counters()
    assert counters["kv_transfers"] == 6 and counters["kv_transfer_bytes"] > 0
    for key in ("prefill_layer_tokens", "decode_layer_tokens"):
        assert counters[key] == local.work_counters()[key], key


def test_publication_reaches_every_worker_and_a_failed_one_blocks(pd):
    new = tiny_model(1)
    ps, params = prompts(3, seed=5), _params()[:3]
    _publish(pd, 1, new)
    expected = LLM(tiny_model(1), max_num_seqs=1, kv_blocks=64, block_size=4).generate(ps, params)
    for a, b in zip(pd.generate(ps, params), expected, strict=True):
        _same(a, b)
        assert a.weight_version == 1
    pd.start_weight_update(2)  # D0 is rigged to refuse version 2
    with pytest.raises(PublicationError, match="D0"):
        pd.update_weights([(n, p.detach().clone()) for n, p in new.named_parameters()])
    with pytest.raises(GenerationBlocked):
        pd.generate(ps, params)
    with pytest.raises(PublicationError):
        pd.finish_weight_update()
    with pytest.raises(PublicationError):
        pd.start_weight_update(2)  # a version must exceed every version ever attempted
    _publish(pd, 3, new)
    outs = pd.generate(ps, params)
    assert pd.get_weight_version() == 3 and all(o.weight_version == 3 for o in outs)
    for a, b in zip(outs, expected, strict=True):
        _same(a, b)  # the KV was invalidated: nothing of the failed attempt survives


def test_abort_ends_in_flight_requests_and_frees_blocks(pd):
    result: dict = {}
    params = SamplingParams(max_tokens=50, seed=0, ignore_eos=True)
    worker = threading.Thread(target=lambda: result.setdefault("outs", pd.generate([[1, 2, 3], [4, 5]], params)))
    before = pd.work_counters()["decode_tokens"]
    worker.start()
    _wait_for(lambda: pd.work_counters()["decode_tokens"] >= before + 3)
    pd.pause_generation(abort=True)
    worker.join(timeout=30)
    outs = result["outs"]
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert 1 <= len(outs[0].output_token_ids) < 50 and len(outs[0].exit_depths) == len(outs[0].output_token_ids)
    pd.resume_generation()
    (out,) = pd.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0, ignore_eos=True))
    assert out.finish_reason == "length"


def test_stop_handshake_returns_per_worker_counters(pd):
    counters = pd.stop()
    assert set(counters) == {"P0", "D0"}
    for c in counters.values():
        assert {"tokens", "bytes", "transfers", "seconds", "blocks_in_use", "weight_version"} <= set(c)
        assert c["blocks_in_use"] == 0 and c["weight_version"] == 3 and c["transfers"] > 0
    assert counters["P0"]["bytes"] == counters["D0"]["bytes"] > 0
    assert all(w.process.exitcode == 0 for w in pd.workers)  # stopped, never killed


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def _generate_in_thread(engine: PDEngine, max_tokens: int) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def body():
        try:
            result["outs"] = engine.generate(
                [[1, 2, 3]], SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True)
            )
        except Exception as err:  # noqa: BLE001
            result["error"], result["at"] = err, time.monotonic()

    thread = threading.Thread(target=body)
    thread.start()
    return thread, result


def test_decode_worker_killed_mid_request_fails_clearly_and_joins_all():
    engine = make_pd_engine(tiny_model(0), [0], [1], timeout=10, **OPTIONS)
    thread, result = _generate_in_thread(engine, max_tokens=200)
    _wait_for(lambda: engine.work_counters().get("decode_tokens", 0) >= 2)
    d0 = next(w for w in engine.workers if w.name == "D0")
    killed = time.monotonic()
    os.kill(d0.process.pid, signal.SIGKILL)
    thread.join(timeout=30)
    err = result["error"]
    assert isinstance(err, WorkerFailed) and "D0" in str(err) and "exited with code -9" in str(err)
    assert result["at"] - killed < 10
    assert all(not w.process.is_alive() and w.process.exitcode is not None for w in engine.workers)
    with pytest.raises(WorkerFailed):
        engine.generate([[1]], SamplingParams())


def test_hanging_prefill_worker_times_out_naming_it():
    with faults.pd_faults({"P0": {"hang_on_prefill": True}}):
        engine = make_pd_engine(tiny_model(0), [0], [1], timeout=3, **OPTIONS)
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"no answer within 3 s .*prefill worker P0"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert time.monotonic() - start < 3 + 10  # the timeout, plus stopping (and killing) the hung worker
    assert all(not w.process.is_alive() for w in engine.workers)


def test_pd_factory_rejects_bad_devices():
    with pytest.raises(ValueError):
        make_pd_engine(tiny_model(0), [], [1])
    with pytest.raises(ValueError):
        make_pd_engine(tiny_model(0), [0, 0], [1])
    with pytest.raises(ValueError):
        PDEngine(tiny_model(0), prefill_devices=[0], decode_devices=[1], transport="carrier-pigeon")


def test_nixl_transport_matches_the_local_engine_bit_for_bit():
    pytest.importorskip("nixl._api", reason="NIXL is not installed here")
    ps, params = prompts(3, seed=7), _params()[:3]
    expected = LLM(tiny_model(0), max_num_seqs=1, kv_blocks=64, block_size=4).generate(ps, params)
    with make_pd_engine(tiny_model(0), [0], [1], timeout=30, **{**OPTIONS, "transport": "nixl"}) as engine:
        assert engine.transport == "nixl"
        for a, b in zip(engine.generate(ps, params), expected, strict=True):
            _same(a, b)
        assert engine.work_counters()["kv_transfers"] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_pd_on_one_gpu_matches_the_local_engine(transport):
    """P0 and D0 as two processes on GPU 0 (fp32): CUDA IPC (shm) or NIXL VRAM-to-VRAM."""
    if transport == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL is not installed here")
    ps, params = prompts(3, seed=7), _params()[:4]
    ps.append(ps[0])
    expected = LLM(tiny_model(0), device="cuda", max_num_seqs=1, kv_blocks=64, block_size=4).generate(ps, params)
    with make_pd_engine(
        tiny_model(0),
        [0],
        [0],
        device="cuda",
        timeout=120,
        max_num_seqs=1,
        kv_blocks=64,
        block_size=4,
        transport=transport,
    ) as engine:
        assert engine.devices() == {"cuda:0"} and engine.transport == transport
        for a, b in zip(engine.generate(ps, params), expected, strict=True):
            _same(a, b)


def conformance_factory(model, **options):
    """For the contract suite: OURO_ENGINE_FACTORIES=tests.unit.engine.test_pd:conformance_factory."""
    return make_pd_engine(model, [0], [1], device="cpu", transport="shm", timeout=30, **options)
