"""LoHa and LoKr adapters (sd.lora.adapters, through PEFT's layers) laid out, scaled and initialised as LyCORIS'
own modules make them, and their kohya-layout files (sd.lora.formats) read by readers written from LyCORIS' and
ComfyUI's math (tests/lycoris_reference.py) to the deltas the layers trained with."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import sd.lora.adapters
import sd.lora.formats
import sd.lora.mode
import sd.run_folder

import lycoris_reference

RANK, ALPHA, CONV_RANK, CONV_ALPHA = 4, 2.0, 2, 1.0
# at these ranks (lycoris_reference.lokr_shapes), with lora_factor -1: whole: w1 (4, 4), w2 (8, 8) whole; low: w2
# (16, 8) from a rank-4 product; conv: w2 (8, 8) from a rank-2 product; conv_whole: w2 (4, 4, 3, 3) whole
LAYERS = ("whole", "low", "conv", "conv_whole")


class Layers(torch.nn.Module):
    """A Linear and a convolution of each LoKr case, named as a file's keys spell them (lora_unet_<name>)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.whole, self.low = torch.nn.Linear(32, 32), torch.nn.Linear(64, 128)
            self.conv, self.conv_whole = torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1)


def adapted(kind: str, factor: int = -1, seed: int = 0, layout: int | None = None) -> Layers:
    """``Layers`` with a LoHa or LoKr of rank 4 / alpha 2 (convolutions 2 / 1), its factors random (trained);
    ``layout``: a LoKr's (None: the current one)."""
    model = sd.lora.adapters.add_lora(Layers(), list(LAYERS), RANK, ALPHA, conv_rank=CONV_RANK, conv_alpha=CONV_ALPHA,
                                      kind=kind, factor=factor, **({} if layout is None else {"layout": layout}))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in sd.lora.adapters.adapter_state(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def factors(layer) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name)["default"] for name in (*sd.lora.formats.LYCORIS_KEYS["loha"],
                                                               *sd.lora.formats.LYCORIS_KEYS["lokr"])
            if "default" in getattr(layer, name, {})}


def applied_delta(layer) -> torch.Tensor:
    """The change of weight the layer applies in its forward: its output less its base's for inputs of one-hot
    channels (a convolution's: one pixel of a 3x3 input, its output read at the centre: padding 1)."""
    base = layer.get_base_layer()
    with torch.no_grad():
        if isinstance(base, torch.nn.Linear):
            eye = torch.eye(base.in_features)
            return (layer(eye) - base(eye)).T
        channels, k = base.in_channels, base.kernel_size[0]
        x = torch.eye(channels * k * k).reshape(-1, channels, k, k)
        change = (layer(x) - base(x))[:, :, k // 2, k // 2]  # (in * k * k, out)
        return change.T.reshape(base.out_channels, channels, k, k)


def test_lycoris_factorization_splits_a_side_as_lycoris_does():
    """The sides of a LoKr's factors: LyCORIS' examples (its factorization's docstring, but 360 by 16, which its
    code splits (15, 24)), a factor above the square root put second (PEFT keeps it first), and every side and
    factor up to 130 as LyCORIS' loop takes them."""
    table = {(127, -1): (1, 127), (128, -1): (8, 16), (128, 2): (2, 64), (128, 4): (4, 32), (250, -1): (10, 25),
             (250, 4): (2, 125), (250, 8): (5, 50), (360, 8): (8, 45), (360, 16): (15, 24), (512, 16): (16, 32),
             (1024, -1): (32, 32), (1024, 16): (16, 64), (320, 32): (10, 32), (32, 16): (2, 16)}
    for (side, factor), split in table.items():
        assert sd.lora.adapters.lycoris_factorization(side, factor) == split, (side, factor)
    for side in range(1, 131):
        for factor in (-1, *range(1, 131)):
            assert sd.lora.adapters.lycoris_factorization(side, factor) == lycoris_reference.factorization(side, factor)


def test_a_lokr_of_two_whole_factors_trains_at_scale_one_as_in_lycoris(tmp_path):
    """Both factors whole (rank 4 reaches half of w2's sides): the layer adds kron(w1, w2) in its forward, scale 1
    as LyCORIS' LokrModule trains it ("alpha is ignored in this case"), not alpha / r = 0.5; with a low-rank w2
    it adds alpha / r times it. The file holds w1 as it trained and alpha = r, as LyCORIS writes it."""
    model = adapted("lokr")
    for name, scale in (("whole", 1.0), ("conv_whole", 1.0), ("low", ALPHA / RANK), ("conv", CONV_ALPHA / CONV_RANK)):
        layer = getattr(model, name)
        t = {k: v.detach().double() for k, v in factors(layer).items()}
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
        w1 = t["lokr_w1"][:, :, None, None] if w2.dim() == 4 else t["lokr_w1"]
        shape = layer.get_base_layer().weight.shape
        want = scale * torch.kron(w1, w2).reshape(shape)
        assert ("lokr_w2" in t) == (scale == 1.0), name
        torch.testing.assert_close(applied_delta(layer).double(), want, atol=1e-5, rtol=1e-5, msg=name)
    written = load_file(sd.lora.formats.save_model_lora(tmp_path / "whole.safetensors", model))
    for name in ("whole", "conv_whole"):
        assert torch.equal(written[f"lora_unet_{name}.lokr_w1"], getattr(model, name).lokr_w1["default"].detach())
        assert float(written[f"lora_unet_{name}.alpha"]) == (RANK if name == "whole" else CONV_RANK)


@pytest.mark.parametrize("kind,factor", [("lokr", -1), ("lokr", 16), ("loha", -1)])
def test_a_trained_layer_s_file_gives_its_delta_in_lycoris_comfyui_and_ours(kind, factor, tmp_path):
    """Every case of layer (LoKr: w2 whole or low-rank, Linear and 3x3 convolution; LoHa) and a lora_factor of 16,
    above the square root of 32 and 64 (PEFT's factors would be (16, 2) and (16, 4)): the file holds the tensors
    LyCORIS' LokrModule makes for the layer (its factorization's smaller side first) and each reader, LyCORIS'
    (its module; its loader, which infers the factor from the tensors), ComfyUI's and ours (read_lora,
    merge_lora), computes from it the delta the layer applies. LyCORIS' loader infers another factor for a
    convolution whose w2 is low-rank (it counts the kernel in w2_b's columns as a side) and refuses that layer,
    as it refuses LyCORIS' own file of it."""
    model = adapted(kind, factor)
    path = sd.lora.formats.save_model_lora(tmp_path / f"{kind}.safetensors", model)
    in_file = lycoris_reference.layers_of_file(load_file(path))
    ours = sd.lora.formats.read_lora(path, Layers())["unet"]
    for name in LAYERS:
        layer = getattr(model, name)
        shape = layer.get_base_layer().weight.shape
        rank = CONV_RANK if name.startswith("conv") else RANK
        tensors, alpha = in_file[name]
        if kind == "lokr":
            assert {k: tuple(v.shape) for k, v in tensors.items()} == lycoris_reference.lokr_shapes(shape, rank, factor)
        trained = applied_delta(layer).double()
        assert trained.abs().max() > 1e-2
        merged = Layers()
        sd.lora.formats.merge_lora({"unet": merged}, {"unet": {name: ours[name]}})
        readers = {reader: delta(tensors, alpha, shape) for reader, delta in lycoris_reference.READERS[kind].items()
                   if reader != "LyCORIS" or kind == "loha"}
        if kind == "lokr":
            readers["LyCORIS' module"] = lycoris_reference.lycoris_lokr_delta(tensors, alpha, shape, factor)
            if name == "conv" and factor != -1:  # LyCORIS' loader's own limit (the docstring)
                assert lycoris_reference.lycoris_lokr_factor(tensors) != factor
                with pytest.raises(ValueError, match="LyCORIS' loader makes"):
                    lycoris_reference.lycoris_lokr_delta(tensors, alpha, shape)
            else:
                readers["LyCORIS' loader"] = lycoris_reference.lycoris_lokr_delta(tensors, alpha, shape)
        readers["ours"] = (getattr(merged, name).weight - getattr(Layers(), name).weight).double()
        for reader, delta in readers.items():
            torch.testing.assert_close(delta, trained, atol=2e-5, rtol=1e-4, msg=f"{reader}: {name}")


def test_loha_and_lokr_start_as_lycoris_draws_them():
    """At the start (a layer of 256 x 256): a LoHa's (rank 8) w2_a is zero, w1_a normal with std 0.1 and w1_b and
    w2_b with std 1 (LyCORIS' LohaModule), so its first product w1_a w1_b has std 0.1 sqrt(r); a LoKr's (rank 4)
    w2 (or w2_b) is zero and w1 (and w2_a) Kaiming-uniform, bound 1 / sqrt(its columns) (LyCORIS' LokrModule;
    PEFT zeroes w1 instead). Both add nothing yet."""
    def layer(kind, rank):
        model = torch.nn.Sequential(torch.nn.Linear(256, 256))
        sd.lora.adapters.add_lora(model, ["0"], rank, 8.0, kind=kind, seed=3)
        return model[0], {k: v.detach() for k, v in factors(model[0]).items()}

    loha, t = layer("loha", 8)
    assert not t["hada_w2_a"].any()
    for name, std in (("hada_w1_a", 0.1), ("hada_w1_b", 1.0), ("hada_w2_b", 1.0)):
        assert abs(t[name].mean()) < 0.15 * std and abs(t[name].std() / std - 1) < 0.1, name
    product = t["hada_w1_a"] @ t["hada_w1_b"]
    assert abs(product.std() / (0.1 * 8 ** 0.5) - 1) < 0.05
    assert not loha.get_delta_weight("default").any()

    lokr, t = layer("lokr", 4)  # sides 16 x 16 each: w1 (16, 16), w2 = w2_a (16, 4) @ w2_b (4, 16)
    assert set(t) == {"lokr_w1", "lokr_w2_a", "lokr_w2_b"} and not t["lokr_w2_b"].any()
    for name, columns in (("lokr_w1", 16), ("lokr_w2_a", 4)):
        bound = columns ** -0.5
        assert t[name].abs().max() <= bound and t[name].abs().max() > 0.9 * bound, name
        assert abs(t[name].std() / (bound / 3 ** 0.5) - 1) < 0.2, name
    assert not lokr.get_delta_weight("default").any()
    whole = sd.lora.adapters.add_lora(Layers(), ["whole"], RANK, ALPHA, kind="lokr").whole  # both factors whole
    assert not whole.lokr_w2["default"].any() and whole.lokr_w1["default"].abs().min() > 0


@pytest.mark.parametrize("factor", [-1, 16])
def test_a_lokr_run_of_the_earlier_layout_keeps_its_factors_and_scales(factor, caplog, tmp_path):
    """A run trained before LyCORIS' layout (layout 1: PEFT's, lora_factor 16 first on sides it divides, two whole
    factors at alpha / r) saved its adapter without a layout: loaded into the adapter its config builds now, its
    layers take back the factors and scales it trained with and apply its deltas; exported, ComfyUI's reader gets
    them (its alpha / r in lokr_w1 where both factors are whole) and a warning names the layers whose factors
    LyCORIS' loader refuses. A run training on never changes its factors under the optimizer: refused."""
    old = adapted("lokr", factor=factor, layout=1)
    if factor == 16:  # PEFT's sides (16, 8) x (16, 4): w2 whole
        assert "lokr_w2" in factors(old.low) and factors(old.low)["lokr_w1"].shape == (16, 16)
    assert old.whole.scaling["default"] == ALPHA / RANK  # two whole factors, at PEFT's alpha / r
    trained = {name: applied_delta(getattr(old, name)) for name in LAYERS}
    state = sd.lora.adapters.AdapterWeights(unet=old).state_dict()
    assert int(state.pop(sd.lora.adapters.LAYOUT_KEY)) == 1  # what an earlier version wrote: no layout

    with pytest.raises(ValueError, match="layout 1"):
        sd.lora.adapters.AdapterWeights(relayout=False, unet=adapted("lokr", factor=factor)).load_state_dict(state)
    loaded = sd.lora.adapters.add_lora(Layers(), list(LAYERS), RANK, ALPHA, conv_rank=CONV_RANK,
                                       conv_alpha=CONV_ALPHA, kind="lokr", factor=factor)
    sd.lora.adapters.AdapterWeights(unet=loaded).load_state_dict(state)
    assert sd.lora.adapters.lokr_layout_of(loaded) == 1
    for name in LAYERS:
        torch.testing.assert_close(applied_delta(getattr(loaded, name)), trained[name], atol=1e-6, rtol=1e-6)
    assert int(sd.lora.adapters.AdapterWeights(unet=loaded).state_dict()[sd.lora.adapters.LAYOUT_KEY]) == 1

    with caplog.at_level(logging.WARNING, logger="sd_lora"):
        path = sd.lora.formats.save_model_lora(tmp_path / "old.safetensors", loaded)
    swapped = [name for name in LAYERS if f"{name}: its LoKr factors are PEFT's split" in caplog.text]
    assert swapped == (list(LAYERS) if factor == 16 else [])  # 16 first on every side it divides
    for name, (tensors, alpha) in lycoris_reference.layers_of_file(load_file(path)).items():
        shape = getattr(Layers(), name).weight.shape
        torch.testing.assert_close(lycoris_reference.comfyui_lokr_delta(tensors, alpha, shape),
                                   trained[name].double(), atol=2e-5, rtol=1e-4, msg=name)


def test_a_resumed_lokr_run_takes_the_layout_of_its_newest_checkpoint(tmp_path):
    """The layout a resume builds before its optimizer (sd.lora.mode.resumed_lokr_layout): the newest complete
    checkpoint's, whose adapter file records it (layout 1 when it holds LoKr tensors and no record; a damaged
    file passes to the next older); LyCORIS' for a new run or a LoRA's checkpoints."""
    checkpoints = tmp_path / "checkpoints"
    assert sd.lora.mode.resumed_lokr_layout(checkpoints) == sd.lora.adapters.LOKR_LAYOUT

    def checkpoint(step, tensors, complete=True):
        folder = checkpoints / sd.run_folder.step_dir_name(step)
        folder.mkdir(parents=True)
        if tensors is None:
            (folder / "adapter.safetensors").write_bytes(b"damaged")
        else:
            save_file(tensors, str(folder / "adapter.safetensors"))
        if complete:
            (folder / sd.run_folder.COMPLETE).write_text("")

    lokr = {"unet.a.lokr_w1.default": torch.ones(2, 2)}
    checkpoint(2, {"unet.a.lora_A.default.weight": torch.ones(2, 2)})
    assert sd.lora.mode.resumed_lokr_layout(checkpoints) == sd.lora.adapters.LOKR_LAYOUT
    checkpoint(4, lokr)
    assert sd.lora.mode.resumed_lokr_layout(checkpoints) == 1
    checkpoint(6, {**lokr, sd.lora.adapters.LAYOUT_KEY: torch.tensor(2, dtype=torch.int32)})
    checkpoint(8, None)
    checkpoint(10, lokr, complete=False)
    assert sd.lora.mode.resumed_lokr_layout(checkpoints) == 2



@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_loha_or_lokr_file_records_its_convolutions_rank_as_lycoris_kohya_network_args(kind, tmp_path):
    """Written from its layers alone (no settings: save_lora) or read back from its file, a LoHa's or LoKr's
    3x3 convolutions (their factors 2-D, as PEFT holds them) are told apart from its Linear layers: the header
    records their rank and alpha as conv_dim / conv_alpha in ss_network_args (strings, as sd-scripts'
    train_network.py records its --network_args and LyCORIS' kohya network reads them), the Linear layers'
    as ss_network_dim / ss_network_alpha; the sd-scripts line names lycoris.kohya and the algorithm."""
    import json

    from safetensors import safe_open

    model = adapted(kind)
    written = sd.lora.formats.adapter_lora_modules(model)
    assert [n for n, m in written.items() if m.is_spatial_conv] == ["conv", "conv_whole"]
    first = sd.lora.formats.save_lora(tmp_path / "first.safetensors", {"unet": written})
    again = sd.lora.formats.save_lora(tmp_path / "again.safetensors", sd.lora.formats.read_lora(first, Layers()))
    args = {"algo": kind, "conv_dim": str(CONV_RANK), "conv_alpha": str(CONV_ALPHA)}
    for path in (first, again):
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata()
        assert json.loads(header["ss_network_args"]) == args
        assert (header["ss_network_module"], header["ss_network_dim"], header["ss_network_alpha"]) == (
            "lycoris.kohya", str(RANK), str(ALPHA))
        assert (header["lora_conv_rank"], header["lora_conv_alpha"]) == (str(CONV_RANK), str(CONV_ALPHA))
    assert sd.lora.formats.sd_scripts_usage(first) == (
        f"sd-scripts loads it with --network_module lycoris.kohya --network_weights {first} --network_dim {RANK} "
        f'--network_alpha {ALPHA} --network_args "algo={kind}" "conv_dim={CONV_RANK}" "conv_alpha={CONV_ALPHA}"')
