"""The memory plan of a run (ouro_cli/rl/sizing.py), checked by hand at the Ouro-1.4B shape."""

from __future__ import annotations

import pytest
import torch

from ouro_cli.errors import ResourceError, UserError
from ouro_cli.model.config import OuroConfig
from ouro_cli.rl import sizing
from ouro_cli.rl.sizing import GIB, DeviceMemory, size_run

H200 = DeviceMemory("cuda", total=int(139.8 * GIB), free=int(139.0 * GIB))
BF16 = torch.bfloat16


def ouro_14b() -> OuroConfig:
    return OuroConfig()  # the defaults are Ouro-1.4B's


def plan(**kw):
    args = dict(
        utilization=0.9,
        dtype=BF16,
        block_size=16,
        seq_tokens=640,
        sequences_needed=256,
        tokens_per_update=256 * 640,
        planes=4,
        engine_releases_memory=True,
    )
    args.update(kw)
    return size_run(ouro_14b(), kw.pop("memory", H200), **{k: v for k, v in args.items() if k != "memory"})


def test_parameter_count_is_ouro_14b():
    total, trainable = sizing.parameter_counts(ouro_14b())
    assert total == 1_434_652_673  # the public checkpoint's count (269 tensors)
    assert trainable == total - 2049  # the exit gate (weight [1, 2048] + bias) is frozen


def test_kv_bytes_per_token_follow_the_planes():
    # 24 layers x 16 KV heads x 128 dims x 2 bytes, for K and V: 192 KiB per plane
    assert sizing.kv_bytes_per_token(ouro_14b(), BF16, 4) == 768 * 2**10
    assert sizing.kv_bytes_per_token(ouro_14b(), BF16, 2) == 384 * 2**10


def test_an_fp8_cache_counts_its_packed_rows_and_holds_about_twice_the_tokens():
    # 24 layers x 16 KV heads x (128 fp8 bytes + 1 scale byte + 15 bytes of alignment), for K and V
    assert sizing.kv_bytes_per_token(ouro_14b(), BF16, 4, fp8_kv=True) == 2 * 24 * 4 * 16 * 144
    assert sizing.kv_bytes_per_token(ouro_14b(), torch.float32, 1, fp8_kv=True) == 2 * 24 * 16 * 144
    bf16, fp8 = plan(sequences_needed=4096), plan(sequences_needed=4096, fp8_kv=True)  # a cache the memory caps
    # both fill the same room in whole blocks: they differ by less than the larger block
    assert abs(fp8.kv_bytes - bf16.kv_bytes) < sizing.kv_bytes_per_token(ouro_14b(), BF16, 4) * 16
    assert fp8.resident_bytes == bf16.resident_bytes
    assert fp8.kv_blocks == pytest.approx(bf16.kv_blocks * 256 / 144, rel=1e-3)
    assert fp8.tokens_at(4, ouro_14b(), 16) > 1.77 * bf16.tokens_at(4, ouro_14b(), 16)


def test_resident_parts_by_hand():
    total, trainable = sizing.parameter_counts(ouro_14b())
    parts = sizing.resident_bytes(ouro_14b(), BF16, kind="cuda", offload_optimizer=False)
    assert parts == {
        "trainer_weights": 2 * total,
        "gradients": 4 * trainable,
        "optimizer": 12 * trainable,
        "engine_weights": 2 * total,
        "runtime": sizing.CUDA_RUNTIME_RESERVE,
        "engine_graphs": sizing.GRAPH_POOL_BASE + 24 * sizing.GRAPH_POOL_PER_LAYER,
    }
    cpu = sizing.resident_bytes(ouro_14b(), BF16, kind="cpu", offload_optimizer=False)
    assert cpu["engine_graphs"] == 0 and cpu["runtime"] == sizing.CPU_RUNTIME_RESERVE
    assert sizing.resident_bytes(ouro_14b(), BF16, kind="cuda", offload_optimizer=True)["optimizer"] == 0
    assert (
        sizing.resident_bytes(ouro_14b(), BF16, kind="cuda", offload_optimizer=False, optimizer_shards=4)["optimizer"]
        == 3 * trainable
    )


def test_kv_takes_what_is_left_when_the_rollout_does_not_fit():
    s = plan()
    budget = int(0.9 * H200.total)
    # the engine hands its cache back, so the trainer frees its gradients while it rolls out:
    # they are not resident, and the KV cache gets their 4 bytes per parameter
    assert s.gradients_released
    resident = sum(sizing.resident_bytes(ouro_14b(), BF16, kind="cuda", offload_optimizer=False).values())
    resident += int(sizing.SLACK_FRACTION * budget) - 4 * sizing.parameter_counts(ouro_14b())[1]
    assert (s.budget_bytes, s.resident_bytes) == (budget, resident)
    block = 16 * 768 * 2**10
    assert s.kv_blocks == (budget - resident) // block - 1
    assert s.kv_bytes == (s.kv_blocks + 1) * block <= budget - resident
    # 256 x 640 tokens at 4 planes would be 120 GiB: fewer fit, twice as many at K = 2
    at4, at2 = s.tokens_at(4, ouro_14b(), 16) // 640, s.tokens_at(2, ouro_14b(), 16) // 640
    assert 100 < at4 < 256 and at2 >= 2 * at4
    assert s.max_num_seqs == 256


def test_offload_auto_moves_the_optimizer_off_the_gpu_only_when_the_rollout_does_not_fit():
    # 256 x 640 tokens at K = 4 (120 GiB) do not fit beside the optimizer state: auto offloads,
    # the 12 bytes per parameter go to the KV cache, and more sequences fit at once
    kept, auto = plan(), plan(offload_optimizer="auto")
    trainable = sizing.parameter_counts(ouro_14b())[1]
    assert auto.offload_optimizer and not kept.offload_optimizer
    assert auto.resident_bytes == kept.resident_bytes - 12 * trainable
    assert auto.kv_blocks > kept.kv_blocks
    assert auto.tokens_at(4, ouro_14b(), 16) // 640 > kept.tokens_at(4, ouro_14b(), 16) // 640
    # where the rollout fits anyway, on CPU (host memory is the device), or when told: as asked
    assert not plan(offload_optimizer="auto", sequences_needed=32, tokens_per_update=32 * 640).offload_optimizer
    cpu = DeviceMemory("cpu", total=64 * GIB, free=60 * GIB)
    assert not plan(offload_optimizer="auto", memory=cpu).offload_optimizer
    assert plan(offload_optimizer="on", sequences_needed=32, tokens_per_update=32 * 640).offload_optimizer
    assert not plan(offload_optimizer="off").offload_optimizer
    # a resumed run passes its recorded cache: the same decision
    assert plan(offload_optimizer="auto", kv_blocks=auto.kv_blocks).offload_optimizer
    small = plan(offload_optimizer="auto", sequences_needed=32, tokens_per_update=32 * 640)
    assert not plan(
        offload_optimizer="auto", kv_blocks=small.kv_blocks, sequences_needed=32, tokens_per_update=32 * 640
    ).offload_optimizer
    with pytest.raises(UserError, match="--offload-optimizer must be auto, on or off"):
        plan(offload_optimizer="sometimes")


def test_offload_auto_keeps_the_state_on_the_gpu_for_the_calls_that_fit_beside_it():
    # beside an engine that hands its cache back, auto's state leaves the device only for the
    # calls whose cache needs its room: 240 x 640 tokens fit beside it at K = 2 and 3, not at 4
    auto = plan(offload_optimizer="auto")
    c, trainable = ouro_14b(), sizing.parameter_counts(ouro_14b())[1]
    state, grads = 12 * trainable, sizing.gradient_bytes(c)
    assert auto.state_per_call
    assert auto.kv_room_beside_state == auto.budget_bytes - auto.resident_bytes - state
    # the micro-batches leave the state its room in the train phase
    off = sizing.activation_bytes_per_token(c, BF16, False, 640)
    room = auto.budget_bytes - auto.resident_bytes - grads - state
    assert auto.max_tokens_per_micro_batch == room // off // 128 * 128
    call = {
        k: sizing.call_kv_bytes(
            c, BF16, block_size=16, planes=k, sequences=240, seq_tokens=640, kv_blocks=auto.kv_blocks
        )
        for k in (2, 3, 4)
    }
    # 641 tokens: 41 blocks each, and the scratch block; more than the cache holds, so the call takes it all
    assert (
        (240 * 41 + 1) * 16 * 768 * 2**10
        == sizing.call_kv_bytes(c, BF16, block_size=16, planes=4, sequences=240, seq_tokens=640, kv_blocks=None)
        > call[4]
    )
    assert call[4] == (auto.kv_blocks + 1) * 16 * 768 * 2**10
    assert auto.state_fits(call[2]) and auto.state_fits(call[3]) and not auto.state_fits(call[4])
    # "on" keeps it on the host between steps; an engine that keeps its cache: the same
    assert not plan(offload_optimizer="on").state_per_call
    assert not plan(offload_optimizer="auto", engine_releases_memory=False).state_per_call
    assert not plan().state_fits(0)
    # micro-batches asked for that leave the state no room: it goes to the host between steps
    big = plan(offload_optimizer="auto", max_tokens_per_micro_batch=auto.max_tokens_per_micro_batch + 4096)
    assert big.offload_optimizer and not big.state_per_call
    assert plan(offload_optimizer="auto", max_tokens_per_micro_batch=auto.max_tokens_per_micro_batch).state_per_call


def test_kv_is_only_as_large_as_the_run_needs():
    s = plan(sequences_needed=32, tokens_per_update=32 * 640)
    assert s.kv_blocks == 32 * 40  # 32 sequences of 40 blocks, one spare block beside the scratch block
    assert s.max_num_seqs == 32


def test_micro_batch_budget_and_recompute_auto():
    s = plan()
    grads = sizing.gradient_bytes(ouro_14b())
    # the engine hands its cache back while the trainer steps; the trainer's gradients take
    # their part of that room again
    room = s.budget_bytes - s.resident_bytes - grads
    off = sizing.activation_bytes_per_token(ouro_14b(), BF16, False, 640)
    assert not s.recompute
    assert s.max_tokens_per_micro_batch == room // off // 128 * 128 >= sizing.MIN_EFFICIENT_MICRO_BATCH
    # an engine that keeps its cache gets half the room and the trainer the rest, which holds
    # too few tokens for efficient micro-batches without recompute: recompute; the
    # gradients stay resident (freeing them would buy the cache nothing)
    kept = plan(engine_releases_memory=False)
    assert not kept.gradients_released and kept.resident_bytes == s.resident_bytes + grads
    assert kept.kv_bytes <= room // 2 < kept.kv_bytes + 16 * 768 * 2**10
    on = sizing.activation_bytes_per_token(ouro_14b(), BF16, True, 640)
    assert (room - kept.kv_bytes) // off < sizing.MIN_EFFICIENT_MICRO_BATCH
    assert kept.recompute and kept.max_tokens_per_micro_batch == (room - kept.kv_bytes) // on // 128 * 128
    # a small update that fits without recompute never recomputes
    assert not plan(utilization=0.5, tokens_per_update=4 * 640).recompute


def test_explicit_values_win():
    s = plan(kv_blocks=5000, max_num_seqs=128, max_tokens_per_micro_batch=4096, recompute="on")
    assert (s.kv_blocks, s.max_num_seqs, s.max_tokens_per_micro_batch, s.recompute) == (5000, 128, 4096, True)
    assert s.token_cost is None  # a budget the user gives counts plain positions


def test_a_budget_sized_here_counts_full_depth_positions_by_the_activation_model():
    c = ouro_14b()
    s, kept = plan(), plan(engine_releases_memory=False)  # recompute off, and on
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    for p, per_call in ((s, 9 * h + 3 * i), (kept, 3 * h)):
        full = sizing.activation_bytes_per_token(c, BF16, p.recompute, 0)
        assert p.token_cost == {"loop": layers * per_call * 2 / full, "idle": 2 * 16 * 128 / per_call}
    # at 1.4B a loop is 0.21 of a full-depth position without recompute: a K = 2 response
    # position (plus its share of the K/V copies of loops 3 and 4) costs about 0.62 of one
    assert s.token_cost["loop"] == pytest.approx(0.213, abs=1e-3)
    # a resumed run keeps what its plan recorded, a plan from before it none
    recorded = plan(max_tokens_per_micro_batch=s.max_tokens_per_micro_batch, token_cost=s.token_cost)
    assert recorded.token_cost == s.token_cost
    assert plan(max_tokens_per_micro_batch=s.max_tokens_per_micro_batch, token_cost=None).token_cost is None


def test_one_line_errors_name_the_numbers():
    small = DeviceMemory("cuda", total=32 * GIB, free=32 * GIB)
    with pytest.raises(
        ResourceError, match=r"does not fit: .* GiB, more than --gpu-memory-utilization 0.9 of 32.0 GiB"
    ):
        plan(memory=small)
    with pytest.raises(ResourceError, match=r"not even one sequence fits .* 768 KiB per token at 4 planes"):
        plan(memory=DeviceMemory("cuda", total=48 * GIB, free=48 * GIB), seq_tokens=65536)
    with pytest.raises(ResourceError, match="does not fit a training micro-batch"):
        plan(seq_tokens=40000, sequences_needed=1, tokens_per_update=40000, recompute="off")
    with pytest.raises(ResourceError, match=r"^--kv-blocks 2 holds 32 tokens at 4 planes, but one sequence needs 640"):
        plan(kv_blocks=2)
    with pytest.raises(UserError, match="--gpu-memory-utilization must lie in"):
        plan(utilization=1.5)


def test_check_fits_names_other_processes():
    s = plan()
    sizing.check_fits(s, H200, used_now=0)
    crowded = DeviceMemory("cuda", total=H200.total, free=60 * GIB)
    with pytest.raises(ResourceError, match="held by other processes"):
        sizing.check_fits(s, crowded, used_now=10 * GIB)


def test_cpu_uses_host_memory():
    host = DeviceMemory("cpu", total=24 * GIB, free=20 * GIB)
    from ouro_cli.model import tiny_config

    s = size_run(
        tiny_config(),
        host,
        utilization=0.9,
        dtype=torch.float32,
        block_size=16,
        seq_tokens=80,
        sequences_needed=128,
        tokens_per_update=128 * 80,
        planes=4,
        engine_releases_memory=True,
    )
    assert s.kv_blocks == 128 * 5 and s.max_num_seqs == 128 and not s.recompute
    assert s.budget_bytes == int(0.9 * 20 * GIB)  # host memory is shared: what is available, in whole GiB
    sizing.check_fits(s, DeviceMemory("cpu", total=24 * GIB, free=int(2.5 * GIB)), used_now=0)  # no device to share


def test_room_for_call_sends_the_state_to_the_host_only_for_a_call_that_needs_its_room():
    from types import SimpleNamespace

    from ouro_cli.rl.loop import room_for_call
    from ouro_cli.settings import ExecutionSettings

    class Offload:
        on_host = False

        def to_host(self):
            self.on_host = True

    auto = plan(offload_optimizer="auto")
    session = SimpleNamespace(
        trainer=SimpleNamespace(
            offload=Offload(), config=SimpleNamespace(torch_dtype=BF16), device=torch.device("cpu")
        ),
        sizing=auto,
        config=ouro_14b(),
        seq_tokens=640,
        prompt_tokens=128,
        sampling=SimpleNamespace(speculative_tokens=0),
        options=SimpleNamespace(engine=SimpleNamespace(block_size=16), execution=ExecutionSettings()),
    )
    for k in (2, 3):
        room_for_call(session, k, 240)
        assert not session.trainer.offload.on_host
    room_for_call(session, 4, 240)
    assert session.trainer.offload.on_host
    session.trainer.offload, session.sizing = Offload(), plan(offload_optimizer="on")  # "on": the trainer's business
    room_for_call(session, 4, 256)
    assert not session.trainer.offload.on_host


@pytest.mark.parametrize("draft,fp8_kv", [(0, False), (3, False), (0, True)])
def test_call_kv_bytes_is_what_a_released_engine_allocates_at_most(draft, fp8_kv):
    """The loop decides where the optimizer state waits from `call_kv_bytes`; the engine must
    never allocate more for the call than that figure says (an fp8 cache counted as packed)."""
    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.model import build, tiny_config
    from ouro_cli.settings import ExecutionSettings

    config = tiny_config()
    model = build(config, seed=0)
    execution = ExecutionSettings(kv_cache_dtype="fp8" if fp8_kv else "auto")
    llm = LLM(model, max_num_seqs=4, kv_blocks=400, block_size=4, execution=execution)
    try:
        llm.release_memory()
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3] * 11]
        params = SamplingParams(
            max_tokens=9, seed=1, max_loops=None if draft else 2, ignore_eos=True, speculative_tokens=draft
        )
        llm.generate(prompts, params)
        planes = config.num_loops if draft else 2
        bound = sizing.call_kv_bytes(
            config,
            torch.float32,
            block_size=4,
            planes=planes,
            sequences=3,
            seq_tokens=11 + 9,
            kv_blocks=400,
            draft_tokens=draft,
            fp8_kv=fp8_kv,
        )
        assert llm.kv.planes == planes and 0 < llm.kv.nbytes <= bound and llm.kv.fp8 == fp8_kv
        assert llm.kv.bytes_per_token() == sizing.kv_bytes_per_token(config, torch.float32, planes, fp8_kv)
    finally:
        llm.close()


def test_a_plan_without_how_it_cut_its_micro_batches_is_refused_naming_it():
    """A fresh run records how it cuts micro-batches (token costs, prompt heads, their order); a
    plan that lacks them is not read as some earlier way of cutting them."""
    from ouro_cli.config import build
    from ouro_cli.rl import plan as plans
    from ouro_cli.rl.options import TrainOptions

    s = plan()
    assert s.prompt_heads and s.deep_parts_first and s.token_cost is not None
    entry = plans.sizing_entry(s)
    old = {k: v for k, v in entry.items() if k not in ("token_cost", "prompt_heads", "deep_parts_first")}
    base = plans.build_contract(
        build(TrainOptions, {"device": "cpu"}),
        data_sha256="d" * 64,
        model_config={"x": 1},
        tokenizer_sha256=None,
        template={"name": "chatml"},
        num_loops=4,
    )
    plans.check_same_contract(
        {**base, "sizing": entry}, {**base, "sizing": plans.sizing_entry(plan())}, allow_scheduler=False
    )
    with pytest.raises(UserError, match="^resume would change sizing.deep_parts_first: the run has None"):
        plans.check_same_contract({**base, "sizing": old}, {**base, "sizing": entry}, allow_scheduler=False)


def test_exact_mode_counts_its_own_activations():
    """Exact mode's replay keeps more per layer call (eager autograd around its kernels), so its
    micro-batches are sized by its own count: smaller than the default's at the same memory."""
    c = ouro_14b()
    for recompute in (False, True):
        default = sizing.activation_bytes_per_token(c, BF16, recompute, 640)
        exact = sizing.activation_bytes_per_token(c, BF16, recompute, 640, exact=True)
        assert exact > default
    room = plan().budget_bytes - plan().resident_bytes - sizing.gradient_bytes(c)
    exact_plan = plan(exact=True)
    per = sizing.activation_bytes_per_token(c, BF16, exact_plan.recompute, 640, exact=True)
    assert exact_plan.max_tokens_per_micro_batch == room // per // 128 * 128 < plan().max_tokens_per_micro_batch
    assert exact_plan.token_cost == sizing.token_cost_shares(c, exact_plan.recompute, exact=True)


@pytest.mark.parametrize("draft", [0, 3])
def test_call_kv_bytes_counts_a_groups_prompt_once(draft):
    """Three prompts of 3, 8 and 11 tokens, four samples each: the engine holds each prompt's full
    blocks once, and never allocates more than the grouped count, which is below the count of
    private copies."""
    from ouro_cli.engine import LLM, SamplingParams
    from ouro_cli.model import build, tiny_config

    config = tiny_config()
    llm = LLM(build(config, seed=0), max_num_seqs=12, kv_blocks=400, block_size=4)
    try:
        llm.release_memory()
        prompts = [p for p in ([5, 6, 7], list(range(8, 16)), [3] * 11) for _ in range(4)]
        params = SamplingParams(
            max_tokens=9, seed=1, max_loops=None if draft else 2, ignore_eos=True, speculative_tokens=draft
        )
        llm.generate(prompts, params)
        planes = config.num_loops if draft else 2
        common = dict(block_size=4, planes=planes, sequences=12, seq_tokens=11 + 9, kv_blocks=400, draft_tokens=draft)
        grouped = sizing.call_kv_bytes(config, torch.float32, prompts=3, prompt_tokens=11, **common)
        private = sizing.call_kv_bytes(config, torch.float32, **common)
        assert llm.kv.planes == planes and 0 < llm.kv.nbytes <= grouped < private
    finally:
        llm.close()


def test_memory_plan_counts_a_groups_prompt_once_and_resumes_as_recorded():
    """4 prompts x 8 samples of a 128-token prompt (8 full blocks of 16) and 512 response tokens:
    each sample holds 33 blocks of its own (the response and a token in flight: 513 tokens), and
    each prompt its 8 blocks once, instead of 41 blocks per sample. A
    resumed run sizes itself from its recorded plan: the same, and a plan recorded with private
    copies keeps its cache."""
    from ouro_cli.config import build
    from ouro_cli.rl import plan as plans
    from ouro_cli.rl.loop import memory_plan
    from ouro_cli.rl.options import TrainOptions

    options = build(TrainOptions, {"device": "cpu", "prompts_per_update": 4, "group_size": 8, "eval_prompts": 16})
    common = dict(seq_tokens=640, eval_rows=100, world=1)
    fresh = memory_plan(options, ouro_14b(), H200, prompt_tokens=128, saved=None, **common)
    assert fresh.kv_blocks == 4 * 8 + 32 * 33
    private = memory_plan(options, ouro_14b(), H200, saved=None, **common)
    assert private.kv_blocks == 32 * 40  # the count before prompts were shared (old callers)
    for recorded in (fresh, private):
        saved = {"contract": {"sizing": plans.sizing_entry(recorded)}}
        resumed = memory_plan(options, ouro_14b(), H200, prompt_tokens=128, saved=saved, **common)
        assert resumed.to_dict() == recorded.to_dict()
