"""A tiny random vision-language model saved as a Hugging Face folder, and test pictures.

No vision-language weights install on these machines, so tests build one: a Llava whose
vision tower is a two-layer CLIP over 28×28 pictures (patch 14: 2×2 patches, so four image
tokens per picture once the CLS position is dropped) and whose text model is a two-layer
Llama, with a byte-level BPE tokenizer trained here, a CLIP image processor and a chat
template that writes ``<image>`` for each ``{"type": "image"}`` part. Everything is
``save_pretrained`` into one folder, which reloads offline (``HF_HUB_OFFLINE=1``) through
``AutoProcessor`` and ``AutoModelForImageTextToText`` as a downloaded model would.

Importable by name from any test (``from vlm_fixtures import write_tiny_vlm, png_bytes``)
once ``plugins/transformers/tests`` is on ``sys.path``.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

#: The token the template writes for a picture and the processor expands (Llava's).
IMAGE_TOKEN = "<image>"
#: The side of the vision tower's input and of its patches: (28 // 14) ** 2 = 4 image tokens.
IMAGE_SIZE = 28
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

#: A Llava-style template: content may be a string or a list of text and image parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_CORPUS = ["the sea is calm tonight", "a picture of a red square", "hello world, the waves",
           "what is in this image?", "describe the picture in one word"]


def _tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, with ``<image>`` as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 40, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": IMAGE_TOKEN})


def _processor(tokenizer):
    """Llava's processor over a CLIP image processor that resizes and crops to IMAGE_SIZE."""
    import transformers
    from transformers import LlavaProcessor

    # the PIL backend: torchvision (the default backend's) does not install here
    kind = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    images = kind(size={"shortest_edge": IMAGE_SIZE},
                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN)


def _model(tokenizer, seed: int):
    """A random Llava: a two-layer CLIP vision tower and a two-layer Llama."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         projector_hidden_act="gelu")
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).eval()


def write_tiny_vlm(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Llava (model, tokenizer, image processor, processor with its chat
    template) into ``folder``; the same seed writes the same weights. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    _model(tokenizer, seed).save_pretrained(folder)
    _processor(tokenizer).save_pretrained(folder)
    return folder


def write_tiny_llm(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random text-only Llama with the same tokenizer and chat template into
    ``folder`` (a chat model that does not see, for refusals of media). Returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def png_bytes(seed: int, size: int = 40) -> bytes:
    """A PNG of random coloured blocks (``size`` pixels square): different seeds give pictures
    that differ everywhere, so the vision tower sees them apart after the crop to IMAGE_SIZE."""
    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size))
    block = max(1, size // 8)
    for x in range(0, size, block):
        for y in range(0, size, block):
            colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            image.paste(colour, (x, y, x + block, y + block))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
