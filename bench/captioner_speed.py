"""Benchmark: automatic captioning's time per 1,000 images (pipeline/03c_caption_images.py's models).

    python bench/captioner_speed.py                       # about 10 minutes on a 2-core CPU
    python bench/captioner_speed.py --images 64 --batch_size 16 --device cuda

Each model is built at its released size from its configuration with random weights (the hub is not
needed; the time of a forward pass does not depend on the weights' values), asked through
``sd.data.captioning``'s own classes, and made to write exactly ``--tokens`` new tokens per caption
(random weights would stop anywhere), so the times are those of captions of that length:

* ``blip``: Salesforce/blip-image-captioning-large (ViT-L/16 at 384 px, a BERT-base decoder), 20 tokens
  by default (its captions run 10-20).
* ``florence2``: florence-community/Florence-2-base (DaViT at 768 px, a 6+6-layer BART), 40 tokens (a
  ``<DETAILED_CAPTION>`` answer).
* ``wd14``: a SwinV2-base at 448 px with 10,861 sigmoid outputs, as SmilingWolf/wd-swinv2-tagger-v3,
  exported to ONNX here and run by onnxruntime (one pass, no generation).

Each model runs in a process of its own. Per model: seconds per image batched (``--batch_size``) and one image per call, their ratio (what the
batch buys over a loop calling the model per image), seconds per 1,000 images, and the process's peak
RSS. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = ("blip", "florence2", "wd14")
TOKENS = {"blip": 20, "florence2": 40}
WD14_TAGS = 10861


def blip(folder: Path, tiny: bool = False):
    import transformers as t

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"] + [f"w{i}" for i in range(200)]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = t.BertTokenizer(str(folder / "vocab.txt"))
    side = 32 if tiny else 384
    processor = t.BlipProcessor(image_processor=t.BlipImageProcessorPil(size={"height": side, "width": side}),
                                tokenizer=tokenizer)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64) if tiny else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2) if tiny else \
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
    config = t.BlipConfig(
        text_config=dict(vocab_size=30524, bos_token_id=30522, pad_token_id=0, sep_token_id=102, eos_token_id=102,
                         **text),
        vision_config=dict(image_size=side, patch_size=16, **vision), projection_dim=256)
    model = t.BlipForConditionalGeneration(config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def florence2(folder: Path, tiny: bool = False):
    import transformers as t

    from sd.data.tiny_captioners import florence_processor

    side, tokens = (32, 17) if tiny else (768, 577)
    processor = florence_processor(side, tokens)
    tokenizer = processor.tokenizer
    text = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64) if tiny else \
        dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
             encoder_ffn_dim=3072, decoder_ffn_dim=3072)
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 2], num_groups=[2, 2], window_size=2,
                  projection_dim=32, max_position_embeddings=16) if tiny else dict(projection_dim=768)
    config = t.Florence2Config(
        text_config=dict(vocab_size=51289, max_position_embeddings=1024, bos_token_id=0, pad_token_id=1,
                         eos_token_id=2, decoder_start_token_id=2, **text),
        vision_config=vision, image_token_id=tokenizer.image_token_id)
    model = t.Florence2ForConditionalGeneration(config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def wd14(folder: Path, tiny: bool = False):
    """A SwinV2-base tagger at 448 px in ONNX, NHWC input as WD14's."""
    import torch
    import transformers as t

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = t.Swinv2Config(image_size=32, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2) \
                if tiny else t.Swinv2Config(image_size=448, embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32],
                                            window_size=8)
            self.backbone = t.Swinv2Model(config)
            self.head = torch.nn.Linear(config.hidden_size, WD14_TAGS)

        def forward(self, x):
            pooled = self.backbone(pixel_values=x.permute(0, 3, 1, 2) / 255.0).pooler_output
            return torch.sigmoid(self.head(pooled))

    model = Tagger().eval()
    buffer = io.BytesIO()
    with torch.no_grad():
        side = 32 if tiny else 448
        torch.onnx.export(model, torch.rand(1, side, side, 3) * 255, buffer, dynamo=False, input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                          opset_version=17)
    (folder / "model.onnx").write_bytes(buffer.getvalue())
    rows = ["tag_id,name,category,count"] + [f"{i},tag_{i},0,1" for i in range(WD14_TAGS)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n")
    return folder


def photos(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        small = rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
        images.append(Image.fromarray(small).resize((1024, 768), Image.BILINEAR))
    return images


def timed(call, images: list, batch_size: int) -> float:
    """Seconds per image over ``images`` in batches (one warm-up batch first, not timed)."""
    call(images[:batch_size])
    start = time.perf_counter()
    for i in range(0, len(images), batch_size):
        call(images[i : i + batch_size])
    return (time.perf_counter() - start) / len(images)


def measure(name: str, folder: Path, args) -> dict:
    import torch

    import sd.data.captioning

    device = torch.device(args.device)
    images = photos(args.images)
    if name == "wd14":
        tagger = sd.data.captioning.load_tagger(str(wd14(folder, args.tiny)), device=device)
        call = tagger.tag
    else:
        built = {"blip": blip, "florence2": florence2}[name](folder, args.tiny)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        captioner = sd.data.captioning.load_captioner(str(built), device=device, dtype=dtype,
                                                      max_length=args.tokens or TOKENS[name])
        captioner.model.generation_config.min_new_tokens = args.tokens or TOKENS[name]
        call = captioner.caption
    batched = timed(call, images, args.batch_size)
    single = timed(call, images[: max(2, len(images) // args.batch_size)], 1)
    return {"model": name, "tokens": 0 if name == "wd14" else args.tokens or TOKENS[name],
            "batch_size": args.batch_size, "s_per_image": round(batched, 3), "s_per_image_one_at_a_time": round(single, 3),
            "batched_speedup": round(single / batched, 2), "minutes_per_1000": round(batched * 1000 / 60, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--images", type=int, default=16, help="images timed per model (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=8, help="images per call (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per caption (default: 20 BLIP, 40 Florence-2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="small models of the same kinds (tests the script)")
    args = parser.parse_args(argv)
    import sd.runtime

    sd.runtime.start_process()
    names = args.models.split(",")
    for name in names:
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
    if len(names) == 1:
        with tempfile.TemporaryDirectory() as folder:
            rows = [measure(names[0], Path(folder), args)]
    else:  # each model in a process of its own: its peak RSS is its own
        rows = []
        for name in names:
            argv = [sys.executable, __file__, "--models", name, "--images", str(args.images), "--batch_size",
                    str(args.batch_size), "--device", args.device, *(["--tokens", str(args.tokens)] if args.tokens else []),
                    *(["--tiny"] if args.tiny else [])]
            result = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows += json.loads(result.stdout.strip().splitlines()[-1])["rows"]
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    print(f"{'model':10} {'tokens':>6} {'s/image':>8} {'one at a time':>14} {'batched x':>10} {'min/1000':>9} {'peak RSS GB':>12}")
    for row in rows:
        print(f"{row['model']:10} {row['tokens']:>6} {row['s_per_image']:>8} {row['s_per_image_one_at_a_time']:>14} "
              f"{row['batched_speedup']:>10} {row['minutes_per_1000']:>9} {row['peak_rss_gb']:>12}")
    print(json.dumps({"bench": "captioner_speed", "device": args.device, "tiny": args.tiny, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
