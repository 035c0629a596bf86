"""The model API for your own scripts: ``import SD_Model`` keeps working.

The code lives in ``sd/model.py`` (UNet presets and build, the frozen VAE / text encoder / tokenizer
loaders, the DDPM schedule, noise, targets and the Min-SNR loss); this module re-exports it
unchanged, so ``SD_Model.build_unet(...)`` and ``from SD_Model import load_vae`` work as before.
"""

from sd.model import *  # noqa: F401,F403
