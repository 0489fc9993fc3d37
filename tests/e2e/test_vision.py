"""Image input end to end: the vision tower and whole image prompts against the transformers
reference (exact numerics, CPU), and the preprocessing against transformers' own processor.

The tiny vision checkpoint is configured as the real model is: `use_bidirectional_attention:
"vision"`, so an image's tokens attend to the whole image (later tokens too); the reference
gets that from `mm_token_type_ids`, as its processor's output gives it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.engine import EngineConfig
from engine.inputs.images import ImageProcessor, PreparedImage, expand_image_tokens, image_spans
from engine.params import ParamError
from engine.scheduler import SchedulerConfig
from tests.media import encode, noise_image

# (height, width): padded to the patch budget, exactly the budget (70 soft tokens, no padding:
# the tower's attention then runs without a mask), upscaled, a long strip, downscaled.
SIZES = [(50, 90), (84, 120), (13, 17), (12, 300), (300, 240)]
# One 16-token canvas, a few denoising steps (the decoder's side is the text path's, tested at
# length elsewhere; here the prompt's encoding is what the images change).
MAX_TOKENS, STEPS = 16, 6


@pytest.fixture(scope="module")
def vision(vision_checkpoint, reference_model):
    """(LLM in exact numerics, the reference, the processor, the prepared images of SIZES)."""
    llm = LLM.from_pretrained(vision_checkpoint, exact=True)
    processor = ImageProcessor(vision_checkpoint)
    images = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    prepared = [processor.prepare(encode(image), f"image {i}") for i, image in enumerate(images)]
    return SimpleNamespace(
        path=vision_checkpoint,
        llm=llm,
        ref=reference_model(vision_checkpoint),
        processor=processor,
        images=images,
        prepared=prepared,
    )


def stacked(images: list[PreparedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = torch.from_numpy(np.stack([i.pixel_values for i in images]))
    return pixels, torch.from_numpy(np.stack([i.position_ids for i in images]))


def test_preprocessing_is_transformers_processor_output(vision):
    """All images through transformers' processor at once = each through Canvas' alone; the
    placeholder expansion = the processor's own text replacement, tokenized."""
    # Imported here: it imports triton, which must first see the kernel tests'
    # TRITON_INTERPRET (tests/kernels/conftest.py) when this module is collected before them.
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    hf = vision.processor._proc(images=vision.images, return_tensors="np")
    pixels, positions = stacked(vision.prepared)
    assert torch.equal(pixels, torch.from_numpy(hf["pixel_values"]))
    assert torch.equal(positions, torch.from_numpy(hf["image_position_ids"]))
    assert [i.num_tokens for i in vision.prepared] == list(hf["num_soft_tokens_per_image"])
    assert [i.num_tokens for i in vision.prepared][1] == 70  # the whole budget, unpadded
    tok = vision.llm.tokenizer
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    messages = [{"role": "user", "content": parts}]
    ids = tok.apply_chat_template(messages)
    ours = expand_image_tokens(ids, vision.prepared[:2], vision.processor.vision)
    text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    fake = SimpleNamespace(boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>")
    pieces = text.split("<|image|>")
    for i in range(2):
        pieces[i] += Gemma4Processor.replace_image_token(fake, hf, i)  # type: ignore[arg-type]
    assert ours == tok.encode("".join(pieces), add_special_tokens=False, markup=True)


@torch.inference_mode()
def test_vision_tower_is_the_reference_bit_for_bit_alone_and_batched(vision):
    pixels, positions = stacked(vision.prepared)
    want = vision.ref.model.encoder.get_image_features(pixels, positions).pooler_output
    tower = vision.llm.model.vision
    assert torch.equal(tower(pixels, positions), want)
    alone = [tower(pixels[i : i + 1], positions[i : i + 1]) for i in range(len(SIZES))]
    assert torch.equal(torch.cat(alone), want)  # what caching and cross-request batching need


def chat_ids(vision, layout: list[str | int]) -> tuple[list[int], list[PreparedImage]]:
    """A user turn of text parts (str) and images (indices into SIZES), expanded."""
    parts = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in layout
    ]
    images = [vision.prepared[p] for p in layout if isinstance(p, int)]
    ids = vision.llm.tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    return expand_image_tokens(ids, images, vision.processor.vision), images


# 1-3 images, first in the turn or between text, every size at least once.
LAYOUTS = [
    [0, "What is this?"],
    ["Compare", 1, "with", 2, "please"],
    [3, "then", 4, 0, "?"],
]


@pytest.fixture(scope="module")
def references(vision) -> list[tuple[list[int], list[PreparedImage], list[int]]]:
    """(prompt ids, images, the reference generate()'s tokens cut at EOS) of each layout, with
    the layout's index as the seed."""
    eos = set(vision.llm.defaults.eos_token_ids)
    out = []
    for seed, layout in enumerate(LAYOUTS):
        ids, images = chat_ids(vision, layout)
        pixels, positions = stacked(images)
        out.append((ids, images, reference_generate(vision, ids, images, seed, eos)))
    return out


def reference_generate(
    vision, ids: list[int], images: list[PreparedImage], seed: int, eos: set[int], both_ways=True
) -> list[int]:
    """The reference generate()'s tokens cut at EOS; `both_ways`: with `mm_token_type_ids`
    (image tokens = 1), which its bidirectional-within-images mask is built from."""
    pixels, positions = stacked(images)
    prompt = torch.tensor([ids])
    types = {"mm_token_type_ids": image_types(vision, prompt)} if both_ways else {}
    torch.manual_seed(seed)
    generated = vision.ref.generate(
        prompt,
        pixel_values=pixels,
        image_position_ids=positions,
        max_new_tokens=MAX_TOKENS,
        max_denoising_steps=STEPS,
        **types,
    )
    ref_ids = generated.sequences[0, len(ids) :].tolist()[:MAX_TOKENS]
    cut = next((i + 1 for i, t in enumerate(ref_ids) if t in eos), len(ref_ids))
    return ref_ids[:cut]


def image_types(vision, prompt: torch.Tensor) -> torch.Tensor:
    """`mm_token_type_ids` as Gemma4Processor makes them: 1 at image tokens, else 0."""
    return (prompt == vision.processor.vision.image_token_id).long()


def test_image_prompts_match_reference_generate_alone_and_batched(vision, references):
    for seed, (ids, images, wanted) in enumerate(references):
        (alone,) = vision.llm.generate(ids, params(seed), images=[images])
        assert alone.output_ids == wanted, f"layout {seed}"
    ids, _, wanted = references[0]
    (blind,) = vision.llm.generate(ids, params(0))
    assert blind.output_ids != wanted  # the images do reach the model
    batched = vision.llm.generate(
        [ids for ids, _, _ in references],
        [params(seed) for seed in range(len(references))],
        images=[images for _, images, _ in references],
    )
    assert [out.output_ids for out in batched] == [wanted for _, _, wanted in references]


def test_image_tokens_attend_to_their_whole_image_as_the_reference_does(vision, references):
    """The bidirectional mask changes the reference's tokens: the parity above needs it."""
    eos = set(vision.llm.defaults.eos_token_ids)
    ids, images, wanted = references[1]
    assert reference_generate(vision, ids, images, 1, eos, both_ways=False) != wanted


def test_a_checkpoint_with_causal_images_matches_its_reference_generate(
    vision, reference_model, tmp_path
):
    """`make-tiny --vision --causal-images`: no use_bidirectional_attention, so image tokens
    attend causally, in the reference and in Canvas (no spans: the plain causal path)."""
    from server.cli import main

    path = tmp_path / "causal"
    assert main(["make-tiny", str(path), "--vision", "--causal-images"]) == 0
    causal = SimpleNamespace(**{**vars(vision), "ref": reference_model(path)})
    llm = LLM.from_pretrained(path, exact=True)
    assert not llm.model.config.vision.bidirectional
    ids, images = chat_ids(vision, LAYOUTS[1])
    eos = set(llm.defaults.eos_token_ids)
    (out,) = llm.generate(ids, params(1), images=[images])
    assert out.output_ids == reference_generate(causal, ids, images, 1, eos)


def test_prompt_chunks_of_a_small_budget_never_split_an_image(vision, references):
    """A 29-token budget per step: a chunk ends before an image that would not fit, and one
    that starts with an image takes it whole (an image's tokens need all its keys). The
    tower's output for an image is computed once and kept for the next chunks."""
    llm = vision.llm
    sched = SchedulerConfig(max_prefill_chunk=72, max_num_batched_tokens=29)
    chunked = LLM(llm.model, llm.tokenizer, llm.defaults, EngineConfig(scheduler=sched))
    for seed in (1, 2):
        ids, images, wanted = references[seed]
        (out,) = chunked.generate(ids, params(seed), images=[images])
        assert out.output_ids == wanted, f"layout {seed}"
        assert out.encoder_passes > 3  # the prompt did go in several chunks


def test_an_image_longer_than_a_prefill_chunk_is_refused(vision, references):
    llm = vision.llm
    sched = SchedulerConfig(max_prefill_chunk=69)
    small = LLM(llm.model, llm.tokenizer, llm.defaults, EngineConfig(scheduler=sched))
    ids, images, _ = references[1]  # image 1: 70 tokens
    with pytest.raises(ParamError, match="70 tokens is more than the 69 tokens of one prefill"):
        small.generate(ids, params(0), images=[images])


@torch.inference_mode()
def reference_greedy_ar(vision, ids: list[int], images: list[PreparedImage]) -> list[int]:
    """Greedy AR over the reference encoder's soft-capped logits, the prompt encoded with its
    images and the masks generate() builds (`create_masks_for_generate` with
    `mm_token_type_ids`; the encoder's forward would drop them)."""
    from transformers import DynamicCache

    ref, (pixels, positions) = vision.ref, stacked(images)
    encoder, config = ref.model.encoder, ref.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    prompt, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
    masks = encoder.create_masks_for_generate(
        config=ref.config,
        inputs_embeds=torch.empty(1, len(ids), 0, dtype=ref.dtype),
        attention_mask=torch.ones(1, len(ids), dtype=torch.bool),
        cache=cache,
        position_ids=pos,
        mm_token_type_ids=image_types(vision, prompt),
    )
    inputs = dict(pixel_values=pixels, image_position_ids=positions, attention_mask=masks)
    out: list[int] = []
    eos = set(vision.llm.defaults.eos_token_ids)
    while len(out) < MAX_TOKENS and not (out and out[-1] in eos):
        hidden = encoder(input_ids=prompt, cache=cache, position_ids=pos, **inputs)
        logits = ref.lm_head(hidden.last_hidden_state[:, -1]).float()
        cap = config.final_logit_softcapping
        out.append(int((torch.tanh(logits / cap) * cap if cap else logits).argmax()))
        prompt, pos, inputs = torch.tensor([out[-1:]]), pos[:, -1:] + 1, {}
    return out


def test_ar_mode_with_images_matches_a_greedy_loop_over_reference_encoder_logits(
    vision, references
):
    ids, images, _ = references[2]
    params = SamplingParams(mode=DecodeMode.AR, max_tokens=MAX_TOKENS)
    (out,) = vision.llm.generate(ids, params, images=[images])
    assert out.output_ids == reference_greedy_ar(vision, ids, images)


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, seed=seed, max_denoising_steps=STEPS)


def test_image_tokens_that_do_not_match_the_images_are_refused(vision):
    ids, images = chat_ids(vision, [0, "x"])
    image_token = vision.processor.vision.image_token_id
    first = ids.index(image_token)
    one_short = ids[:first] + ids[first + 1 :]
    with pytest.raises(ParamError, match="image tokens for 1 images"):
        vision.llm.generate(one_short, SamplingParams(max_tokens=4), images=[images])
    with pytest.raises(ParamError, match="for 2 images"):
        vision.llm.generate(ids, SamplingParams(max_tokens=4), images=[images * 2])
    with pytest.raises(ParamError, match="placeholders for 2 images"):
        expand_image_tokens([5, image_token], images * 2, vision.processor.vision)


def test_generate_cli_with_an_image_matches_reference_generate(
    vision, references, tmp_path, capsys
):
    from server.cli import main

    image = tmp_path / "image.png"
    vision.images[LAYOUTS[0][0]].save(image)
    args = ["generate", "--model", str(vision.path), "--image", str(image)]
    flags = ["--seed", "0", "--max-tokens", str(MAX_TOKENS), "--max-denoising-steps", str(STEPS)]
    assert main([*args, "--prompt", LAYOUTS[0][1], *flags, "--json", "--exact"]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == references[0][2]
    missing = ["--image", str(tmp_path / "missing.png")]
    assert main([*args[:3], *missing, "--prompt", "x"]) == 2  # before loading the model
    assert "missing.png" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fast(vision):
    """The checkpoint in fast numerics (prefix caching on); `fast(config)`: a fresh engine."""
    llm = LLM.from_pretrained(vision.path)
    return lambda config=None: LLM(llm.model, llm.tokenizer, llm.defaults, config)


def test_the_same_ids_with_other_images_never_share_cached_pages(vision, fast):
    """Image tokens are placeholders: the images' content hashes are part of the prefix
    cache's key, so a prompt reuses cached pages only with the very same images."""
    fast = fast()
    ids, images = chat_ids(vision, [1, "What is this? " * 8])
    h, w = SIZES[1]
    other = [vision.processor.prepare(encode(noise_image(h, w, seed=99)), "other image")]
    assert len(ids) > 2 * EngineConfig().page_size  # full pages to share
    runs = [images, images, other, images]
    cached = [fast.generate(ids, params(0), images=[run])[0].num_cached_tokens for run in runs]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == cached[1]


def test_a_cache_hit_never_ends_inside_an_image_and_gives_the_tokens_of_caching_off(vision, fast):
    """Two prompts share an image and diverge right after it, inside the page its last tokens
    are on: the second's hit stops before the image (its tokens are computed in one pass, with
    the whole image), the first's repeat hits past the image; both give caching off's tokens
    (AR mode: fast numerics' diffusion tokens may differ with a pass's cut; see
    docs/prefix-caching.md)."""
    cached, uncached = fast(), fast(EngineConfig(prefix_caching=False))
    ar = SamplingParams(mode=DecodeMode.AR, max_tokens=6)
    a, images = chat_ids(vision, [1, "Say what it is. " * 8])
    b, _ = chat_ids(vision, [1, "Tell me more. " * 8])
    image_token = vision.processor.vision.image_token_id
    ((first, last),) = image_spans(tuple(i for i, t in enumerate(a) if t == image_token), 99)
    page = EngineConfig().page_size
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert first < shared // page * page <= last  # b's shared full pages end inside the image
    outs = [cached.generate(ids, ar, images=[images])[0] for ids in (a, a, b)]
    assert [o.num_cached_tokens for o in outs][0] == 0
    assert outs[1].num_cached_tokens > last and outs[2].num_cached_tokens <= first
    want = [uncached.generate(ids, ar, images=[images])[0].output_ids for ids in (a, b)]
    assert [o.output_ids for o in outs] == [want[0], want[0], want[1]]


def test_fast_numerics_with_images_stay_within_1e4_of_exact(vision, fast, references):
    """The three image prompts batched (ragged ENCODE rows, each with its images' spans), AR
    mode: fast numerics take exact's greedy tokens, every log-probability within 1e-4."""
    ar = SamplingParams(mode=DecodeMode.AR, max_tokens=8, logprobs=0)
    prompts = [ids for ids, _, _ in references]
    images = [list(imgs) for _, imgs, _ in references]
    want = vision.llm.generate(prompts, [ar] * len(prompts), images=images)
    got = fast().generate(prompts, [ar] * len(prompts), images=images)
    for ours, exact in zip(got, want, strict=True):
        assert ours.output_ids == exact.output_ids
        assert ours.logprobs is not None and exact.logprobs is not None
        pairs = zip(ours.logprobs, exact.logprobs, strict=True)
        assert max(abs(a.logprob - b.logprob) for a, b in pairs) <= 1e-4
