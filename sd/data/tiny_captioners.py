"""Tiny random-weight captioning and tagging models built offline (as ``--unet tiny`` builds a UNet), for the
tests and benchmarks of pipeline/03c_caption_images.py.

``tiny_blip`` and ``tiny_florence`` save a model and its processor with ``save_pretrained``, as a hub download
would hold them; ``force`` makes the model answer one word at every step (a known answer: the word repeated
``max_length`` times). ``tiny_tagger`` writes a WD14-style ``model.onnx`` + ``selected_tags.csv`` whose
scores are known functions of the image's mean colour, read in WD14's BGR order.
"""

from pathlib import Path

import numpy as np

import sd.cli

BLIP_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "picture", "of", "photo", "red", "blue",
              "square", "circle", "on", "the", "background", "green", "cat", "dog"]


def tiny_blip(folder: Path, seed: int = 0, force: str | None = None) -> Path:
    import torch
    import transformers as t

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(BLIP_WORDS) + "\n")
    tokenizer = t.BertTokenizer(str(folder / "vocab.txt"), model_max_length=512)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    processor = t.BlipProcessor(image_processor=t.BlipImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer)
    config = t.BlipConfig(
        text_config=dict(vocab_size=len(BLIP_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=128, bos_token_id=5, pad_token_id=0,
                         sep_token_id=3, eos_token_id=3),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2), projection_dim=32)
    torch.manual_seed(seed)
    model = t.BlipForConditionalGeneration(config).eval()
    if force is not None:  # every logit is the head's bias: the forced word wins at every step
        head = model.text_decoder.cls.predictions
        with torch.no_grad():
            head.transform.LayerNorm.weight.zero_()
            head.transform.LayerNorm.bias.zero_()
            head.bias.zero_()
            head.bias[BLIP_WORDS.index(force)] = 10.0
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "vocab.txt").unlink()
    return folder


def florence_processor(side: int, image_tokens: int):
    """A Florence-2 processor at ``side`` px (``image_tokens``: what the vision tower makes of it) with a
    byte-level BPE vocabulary of single bytes (no merges): enough to prompt and decode, built offline."""
    import transformers as t
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<image>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = t.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                          unk_token="<unk>", extra_special_tokens={"image_token": "<image>"},
                                          model_max_length=1024)
    image_processor = t.CLIPImageProcessor(size={"height": side, "width": side}, do_center_crop=False,
                                           image_seq_length=image_tokens)
    return t.Florence2Processor(image_processor=image_processor, tokenizer=tokenizer)


def tiny_florence(folder: Path, seed: int = 0, force: str | None = None) -> Path:
    """A Florence-2 of 16x16 patches at 32 px (17 image tokens) and a byte-level BPE vocabulary of single bytes."""
    import torch
    import transformers as t

    processor = florence_processor(side=32, image_tokens=17)
    tokenizer = processor.tokenizer
    config = t.Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                           patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 2], num_groups=[2, 2],
                           window_size=2, projection_dim=32, max_position_embeddings=16),
        text_config=dict(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=256, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                         decoder_start_token_id=2),
        image_token_id=tokenizer.image_token_id)
    torch.manual_seed(seed)
    model = t.Florence2ForConditionalGeneration(config).eval()
    if force is not None:  # the decoder's output is one vector, the forced token's embedding, longest of all
        token = tokenizer.convert_tokens_to_ids(force)
        embeddings = model.get_input_embeddings().weight
        with torch.no_grad():
            embeddings[token] *= 20.0
            norm = model.model.language_model.decoder.layers[-1].final_layer_norm
            norm.weight.zero_()
            norm.bias.copy_(embeddings[token])
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


TAGGER_TAGS = [("general", 9), ("sensitive", 9), ("red_theme", 0), ("blue_theme", 0), ("long_hair", 0), ("^_^", 0),
               ("hatsune_miku", 4)]


def tiny_tagger(folder: Path, size: int = 32, batched: bool = True) -> Path:
    """Scores from the image's mean colour ``(b, g, r)`` in 0..1, as WD14 reads it (BGR): red_theme
    sigmoid(12 (r - b) - 3), blue_theme sigmoid(12 (b - r) - 3), long_hair sigmoid(1) and ^_^ sigmoid(0.5) (every
    image), hatsune_miku sigmoid(12 g - 9), the ratings general sigmoid(2) and sensitive sigmoid(-2)."""
    onnx = sd.cli.import_extra("onnx", "caption", "the tiny tagger")
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    weights = np.zeros((3, len(TAGGER_TAGS)), np.float32)  # rows: b, g, r
    bias = np.zeros(len(TAGGER_TAGS), np.float32)
    weights[2, 2], weights[0, 2], bias[2] = 12, -12, -3  # red_theme
    weights[0, 3], weights[2, 3], bias[3] = 12, -12, -3  # blue_theme
    weights[1, 6], bias[6] = 12, -9  # hatsune_miku
    bias[0], bias[1], bias[4], bias[5] = 2, -2, 1, 0.5
    nodes = [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1, 2], keepdims=0),
             helper.make_node("Div", ["mean", "scale"], ["unit"]),
             helper.make_node("MatMul", ["unit", "weights"], ["logits"]),
             helper.make_node("Add", ["logits", "bias"], ["shifted"]),
             helper.make_node("Sigmoid", ["shifted"], ["output"])]
    batch = "batch" if batched else 1
    graph = helper.make_graph(
        nodes, "tiny_tagger",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, size, size, 3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, len(TAGGER_TAGS)])],
        initializer=[numpy_helper.from_array(np.array([255.0], np.float32), "scale"),
                     numpy_helper.from_array(weights, "weights"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))
    rows = ["tag_id,name,category,count"] + [f"{i},{name},{category},100" for i, (name, category) in enumerate(TAGGER_TAGS)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n")
    return folder
