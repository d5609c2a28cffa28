"""`--offload-optimizer auto` in a whole run, on CPU with the device's memory reported as a
GPU's, sized so that auto moves the optimizer state off the device and the K = 2 rollout's
cache fits beside it while K = 4's does not: the state leaves before the K = 4 rollouts
only, the trainer frees its gradients between updates, the released cache comes back as
large as each call needs, and the run computes the very bits of a plain CPU run whose state
never moves (the same micro-batches, given)."""

from __future__ import annotations

import json

from .tiny_checkpoint import REWARD, make_checkpoint

GIB = 2**30


def _train(tmp_path, name: str):
    from ouro_cli.rl.loop import prepare_run_dir, train
    from ouro_cli.rl.options import TrainOptions
    from ouro_cli.rl.run_dir import RunDir

    run = RunDir(tmp_path / name)
    options = TrainOptions.from_dict(
        {
            "model": str(tmp_path / "hf"),
            "data": str(tmp_path / "train.jsonl"),
            "eval_data": "",
            "run_dir": str(run.root),
            "updates": 4,
            "depths": [2, 4],
            "prompts_per_update": 4,
            "group_size": 4,
            "max_response_len": 48,
            "reward_function": REWARD,
            "save_interval": 0,
            "state_digest": True,
            "recompute": "on",
            "max_tokens_per_micro_batch": 96,
        }
    ).validate()
    prepare_run_dir(run, False)
    train(options, run)
    return [json.loads(line) for line in (run.root / "metrics.jsonl").read_text().splitlines()]


def test_the_state_leaves_only_for_the_calls_that_need_its_room(tmp_path, monkeypatch):
    from ouro_cli.rl import loop, sizing

    make_checkpoint(tmp_path)
    plain = _train(tmp_path, "plain")  # CPU: auto keeps the state where it is

    plans = []
    real_size_run = sizing.size_run

    def as_if_on_a_gpu(config, memory, **kw):
        """A GPU whose memory leaves, beside the state, room for the K = 2 call and not for K = 4's."""
        rollout = kw["calls"][0]  # the rollout's samples on its prompts, each prompt's blocks held once
        shape = dict(sequences=rollout.sequences, prompts=rollout.prompts, prompt_tokens=kw["prompt_tokens"])
        calls = {
            k: sizing.call_kv_bytes(
                config,
                kw["dtype"],
                block_size=kw["block_size"],
                planes=k,
                seq_tokens=kw["seq_tokens"],
                kv_blocks=None,
                **shape,
            )
            for k in (2, 4)
        }
        parts = sum(
            sizing.resident_bytes(
                config, kw["dtype"], kind="cuda", offload_optimizer=False, gradients_released=True
            ).values()
        )
        room = (calls[2] + calls[4]) // 2
        total = int((room + parts) / (0.95 * 0.9)) + 1024
        fake = sizing.DeviceMemory("cuda", total=total, free=total)
        monkeypatch.setattr(loop.DeviceMemory, "of", staticmethod(lambda device: fake))
        plan = real_size_run(config, fake, **kw)
        calls = {
            k: sizing.call_kv_bytes(
                config,
                kw["dtype"],
                block_size=kw["block_size"],
                planes=k,
                seq_tokens=kw["seq_tokens"],
                kv_blocks=plan.kv_blocks,
                **shape,
            )
            for k in (2, 4)
        }  # what the sized engine allocates (rounded up: kv_cache.restore_blocks)
        plans.append((plan, calls))
        return plan

    monkeypatch.setattr(loop, "size_run", as_if_on_a_gpu)
    rounds = []
    room_for_call = loop.room_for_call

    def watched(s, planes, sequences, prompts):
        before = s.trainer.offload.on_host
        room_for_call(s, planes, sequences, prompts)
        rounds.append((planes, before, s.trainer.offload.on_host))

    monkeypatch.setattr(loop, "room_for_call", watched)
    moved = _train(tmp_path, "per-call")

    ((plan, calls),) = plans
    assert plan.offload_optimizer and plan.state_per_call and plan.gradients_released
    assert plan.state_fits(calls[2]) and not plan.state_fits(calls[4])
    # before each rollout: K = 2 leaves the state where it is (on the host only before the first
    # step ever), K = 4 sends it to the host; every step brings it back and keeps it
    assert rounds == [(2, True, True), (4, False, True), (2, False, False), (4, False, True)]
    assert [m["train_optimizer_steps"] for m in moved] == [1, 1, 1, 1]
    # the same rollouts and the same weights after every update as the run whose state never moved
    assert [m["rewards"] for m in moved] == [m["rewards"] for m in plain]
    assert [m["state_sha256"] for m in moved] == [m["state_sha256"] for m in plain]
    assert all(m["state_sha256"] for m in moved)
