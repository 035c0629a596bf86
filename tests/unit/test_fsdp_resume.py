"""A resume of an fsdp run keeps AdamW's state in host memory until the UNet is split, then splits it
tensor by tensor: loaded into the optimizer first, the whole state would sit on every GPU (13.8 GB at SD 1.x)."""

import copy

import pytest
import torch
import torch.distributed as dist

import sd.model
import sd.train.optimizers
import sd.train.sharding
import sd.train.step
from sd.distributed import Dist
from sd.train.config import TrainConfig


def tiny_step(**fields) -> sd.train.step.Step:
    config = TrainConfig(unet="tiny", text_encoder="tiny", vae="tiny", batch_size=2, grad_accum=1, precision="fp32",
                         grad_checkpointing=False, ema_decay=0.0, datasets=[], sharding="fsdp", **fields)
    d = Dist.single(torch.device("cpu"))
    unet = sd.model.build_unet("tiny", seed=0).train()
    step = sd.train.step.build_step(config, d, unet, sd.model.load_text_encoder("tiny"), torch.full((1, 77), 49407),
                                   0.18215)
    step.sharding = "fsdp"  # as build_step sets it on 2 or more ranks
    return step


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fields", [pytest.param({}, id="one_group"),
                                    pytest.param(dict(down_lr_scale=0.5, up_lr_scale=2.0), id="block_groups",
                                                 marks=pytest.mark.slow)])
def test_the_adamw_state_stays_in_host_memory_until_the_split_and_arrives_whole(one_rank_group, fields):
    trained = tiny_step(**fields)
    batch = [(torch.randn(2, 4, 8, 8).half(), torch.randint(0, 49407, (2, 77)))]
    with sd.model.attention_context("cpu"):
        sd.train.step.read_results([sd.train.step.train_step(trained, batch, 0)])
    saved = copy.deepcopy(sd.train.optimizers.OptimizerState(trained.optimizer).state_dict())

    resumed = tiny_step(**fields)
    groups = [(g["name"], g["lr"], len(g["params"])) for g in resumed.optimizer.param_groups]
    states = sd.train.sharding.whole_states({"optimizer": sd.train.optimizers.OptimizerState(resumed.optimizer)},
                                            resumed)
    assert isinstance(states["optimizer"], sd.train.sharding.HeldForSharding)
    states["optimizer"].load_state_dict(copy.deepcopy(saved))
    assert not resumed.optimizer.state  # nothing on the device yet
    held = [t for s in resumed.held_optimizer_state["state"].values() for t in s.values() if torch.is_tensor(t)]
    assert held and {t.device.type for t in held} == {"cpu"}

    sd.train.step.wrap_model(resumed, compile=False)  # shard_unet: the weights, then the state, split
    assert sd.train.sharding.is_sharded(resumed.unet) and resumed.held_optimizer_state is None
    assert [(g["name"], g["lr"], len(g["params"])) for g in resumed.optimizer.param_groups] == groups
    assert len(groups) == (4 if fields else 1)
    names = sd.train.sharding.trainable_names(resumed.unet, resumed.optimizer)
    params = dict(resumed.unet.named_parameters())
    assert len(resumed.optimizer.state) == len(saved["state"]) == len(names)
    for index, name in enumerate(names):
        now, then = resumed.optimizer.state[params[name]], saved["state"][index]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd.train.sharding.whole(now[key]), then[key]), (name, key)
        assert float(now["step"]) == float(then["step"])
