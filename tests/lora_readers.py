"""ComfyUI's and sd-scripts' LoRA loaders as key maps: which keys of a LoRA file each applies to an SD 1.x model
(their code read: comfy/lora.py, sd-scripts' networks/lora.py), for tests of the files this project writes."""

import torch

CLIP_LORA_LAYERS = ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj", "mlp_fc1",
                    "mlp_fc2")
SD_SCRIPTS_UNET_MODULES = ("Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D")
SD_SCRIPTS_TEXT_MODULES = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")
LORA_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")


def comfyui_loaded_keys(keys: set[str], unet, encoder) -> set[str]:
    """The keys of a LoRA file ComfyUI applies to an SD 1.x model, as comfy/lora.py maps them: a name is
    'lora_unet_' + a UNet weight's diffusers module path with '_' for '.', or
    'lora_te_text_model_encoder_layers_<i>_<CLIP_LORA_LAYERS>'; NAME.lora_up.weight is applied with
    NAME.lora_down.weight and NAME.alpha. Every other key is logged as "lora key not loaded" and skipped."""
    names = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_") for k in unet.state_dict() if k.endswith(".weight")}
    names |= {f"lora_te_text_model_encoder_layers_{i}_{layer}" for i in range(encoder.config.num_hidden_layers)
              for layer in CLIP_LORA_LAYERS}
    return {k for k in keys for suffix in LORA_SUFFIXES if k.endswith(suffix)
            and k.removesuffix(suffix) in names and f"{k.removesuffix(suffix)}.lora_up.weight" in keys}


def sd_scripts_loaded_keys(keys: set[str], unet, encoder) -> set[str]:
    """The keys sd-scripts' networks/lora.py loads (create_network_from_weights, then load_state_dict
    with strict=False): a module for each name whose NAME.lora_down.weight the file holds, among
    'lora_unet_' / 'lora_te_' + the path of every Linear / Conv2d inside the module classes it adapts,
    '.' as '_' (the text model's path from transformers 4's text_model.)."""
    def names(prefix, model, classes, root=""):
        return {prefix + (root + name + "." + child).replace(".", "_")
                for name, module in model.named_modules() if type(module).__name__ in classes
                for child, layer in module.named_modules() if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d))}

    text_root = "" if any(n.startswith("text_model.") for n, _ in encoder.named_modules()) else "text_model."
    known = names("lora_unet_", unet, SD_SCRIPTS_UNET_MODULES) | names("lora_te_", encoder, SD_SCRIPTS_TEXT_MODULES, text_root)
    return {k for k in keys if k.split(".")[0] in known and f"{k.split('.')[0]}.lora_down.weight" in keys
            and k.endswith(LORA_SUFFIXES)}
