"""One vision-tower call per micro-batch: the plugin's ``get_input_embeds`` against verl's ``_get_input_embeds`` in
one process (the patch's ``selftest``), then two FSDP2 ranks holding different media through verl's
own forward (``mixed_media_fsdp2.py``, beside this file), with the patch and, as the negative control, without it.
Qwen3.5 (verl >= 0.8, transformers >= 5.2) gets the same checks, through verl's ``qwen3_5`` module."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import VERL, child_json, decide_text, last_json, run_child, source_text
from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call import selftest as vision_call
from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call import spec
from verl_qwen3vl_plugin.registry import Verdict

HERE = Path(__file__).parent  # this patch's child scripts

FSDP_CASES = ["image_video_vs_images", "image_video_vs_text", "video_vs_image"]
HANG_CASES = FSDP_CASES[:2]  # where verl's own forward makes two tower calls on rank 0 and one on rank 1
OFF = {"VERL_QWEN3VL_PLUGIN_DISABLE": "qwen3_vl_single_vision_call"}
LOG_PROB_ATOL, GRAD_RTOL = 1e-5, 1e-5
# The negative control's bounds: gloo's collective timeout, and the wall-clock limit of the two ranks.
COLLECTIVE_TIMEOUT_S, WALL_TIMEOUT_S = 10, 60


MODULES = {family: f"verl.models.transformers.{family}" for family in ("qwen3_vl", "qwen3_5")}  # the targets
SOURCE = source_text(MODULES["qwen3_vl"])
QWEN3_5_SOURCE = source_text(MODULES["qwen3_5"])  # None: verl < 0.8
VIDEO_CALL = "model.visual(pixel_values_videos, grid_thw=video_grid_thw)"
FAMILIES = ["qwen3_vl", *(["qwen3_5"] if QWEN3_5_SOURCE is not None else [])]
KINDS = {"qwen3_vl": ["dense", "moe"], "qwen3_5": ["qwen3_5", "qwen3_5_moe"]}


def verdict(source: str | None, family: str = "qwen3_vl") -> Verdict:
    return decide_text(spec.PATCH, spec.PATCH.target(MODULES[family]), source).verdict


def test_installed_verl_applies():
    assert verdict(SOURCE) is Verdict.APPLY
    assert verdict(QWEN3_5_SOURCE, "qwen3_5") is (Verdict.APPLY if QWEN3_5_SOURCE is not None else Verdict.NOT_USED)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (VIDEO_CALL, "model.video_tower(pixel_values_videos, grid_thw=video_grid_thw)"),  # a second tower
        ("    video_grid_thw: Optional[torch.LongTensor] = None,\n):", "    video_grid_thw=None,\n    **kwargs,\n):"),
        ("input_kwargs = _get_input_embeds(", "input_kwargs = embed_inputs("),  # the caller goes elsewhere
        ('"visual_pos_masks": visual_pos_masks,', '"visual_mask": visual_pos_masks,'),
    ],
    ids=["video_not_through_model_visual", "signature", "caller", "outputs"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_edited_verl_is_unrecognized(family, old, new):
    source = SOURCE if family == "qwen3_vl" else QWEN3_5_SOURCE
    if family == "qwen3_5" and "visual_pos_masks" in old:  # Qwen3.5 returns two outputs: one more is unknown
        old, new = '"attention_mask": attention_mask}', '"attention_mask": attention_mask, "extra": None}'
    edited = source.replace(old, new)
    assert edited != source
    assert verdict(edited, family) is Verdict.UNRECOGNIZED


def test_qwen3_vl_shape_in_the_qwen3_5_module_is_unrecognized():
    """Each module is judged by its own family's shape: Qwen3-VL's four outputs are not Qwen3.5's two."""
    assert verdict(SOURCE.replace("qwen3_vl_base_forward", "qwen3_5_base_forward"), "qwen3_5") is Verdict.UNRECOGNIZED


ONE_CALL = """
def qwen3_5_base_forward(self, input_ids, attention_mask=None, pixel_values=None, pixel_values_videos=None,
                         image_grid_thw=None, video_grid_thw=None, **kwargs):
    return _get_input_embeds(self, input_ids, attention_mask, pixel_values, pixel_values_videos, image_grid_thw,
                             video_grid_thw)

def _get_input_embeds(model, input_ids, attention_mask, pixel_values, pixel_values_videos, image_grid_thw,
                      video_grid_thw):
    inputs_embeds = model.get_input_embeddings()(input_ids)
    pairs = ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
    media = [(v, g) for v, g in pairs if v is not None]
    if media:
        TOWER
    if pixel_values is not None:
        inputs_embeds = inputs_embeds.masked_scatter(input_ids == 1, embeds[: len(pixel_values)])
    if pixel_values_videos is not None:
        inputs_embeds = inputs_embeds.masked_scatter(input_ids == 2, embeds[-len(pixel_values_videos) :])
    if pixel_values is None and pixel_values_videos is None:
        inputs_embeds = inputs_embeds + 0.0 * model.visual(input_ids, grid_thw=input_ids).pooler_output.mean()
    return {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
"""
ONE_CALL_SHAPES = {  # verl#7323's shape, and near-misses that still call the tower once per modality or skip one
    "joined": ("embeds = model.visual(torch.cat([v for v, _ in media]), grid_thw=torch.cat([g for _, g in media]))",
               Verdict.FIXED_UPSTREAM),
    "a call per modality": ("embeds = torch.cat([model.visual(v, grid_thw=g) for v, g in media])",
                            Verdict.UNRECOGNIZED),
    "a loop of calls": ("for v, g in media:\n            embeds = torch.cat([model.visual(v, grid_thw=g)])",
                        Verdict.UNRECOGNIZED),
    "joined through a name": ("pixels = torch.cat([v for v, _ in media])\n        "
                              "embeds = model.visual(pixels, grid_thw=torch.cat([g for _, g in media]))",
                              Verdict.FIXED_UPSTREAM),
    "the first medium only": ("embeds = model.visual(media[0][0], grid_thw=media[0][1])", Verdict.UNRECOGNIZED),
    "the first medium, then a cat": ("embeds = torch.cat([model.visual(media[0][0], grid_thw=media[0][1])])",
                                     Verdict.UNRECOGNIZED),
}  # fmt: skip


@pytest.mark.parametrize("name", ONE_CALL_SHAPES)
def test_one_tower_call_upstream_is_fixed_and_its_near_misses_are_not(name):
    tower, expected = ONE_CALL_SHAPES[name]
    assert verdict(ONE_CALL.replace("TOWER", tower), "qwen3_5") is expected


def test_two_tower_calls_in_one_statement_are_unrecognized():
    """Two calls in the one statement, with no dummy to make up the count, must read as a near-miss, not crash."""
    dummy = "inputs_embeds + 0.0 * model.visual(input_ids, grid_thw=input_ids).pooler_output.mean()"
    both = "embeds = torch.cat([model.visual(*media[0]), model.visual(*media[-1])])"
    assert verdict(ONE_CALL.replace("TOWER", both).replace(dummy, "inputs_embeds"), "qwen3_5") is Verdict.UNRECOGNIZED


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(vision_call.CASES))
def test_one_call_matching_verl(family, name):
    check = vision_call.compare(name, vision_call.CASES[name], family)
    assert check.ok, check


def test_token_count_mismatch_still_raises():
    check = vision_call.token_mismatch()
    assert check.ok, check


@pytest.mark.parametrize("kind", [kind for family in FAMILIES for kind in KINDS[family]])
def test_fsdp2_ranks_with_different_media_make_equal_calls_and_match_alone(kind):
    results = child_json(HERE / "mixed_media_fsdp2.py", kind, ",".join(FSDP_CASES), "fsdp", timeout=900)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    target = MODULES["qwen3_5" if kind.startswith("qwen3_5") else "qwen3_vl"]
    for r in results:
        assert r["statuses"][f"qwen3_vl_single_vision_call {target}"] == "applied", r
        for case in FSDP_CASES:
            assert r[case]["visual_calls_alone"] == r[case]["visual_calls_fsdp"] == 1, (case, r)
            assert r[case]["log_prob_diff"] <= LOG_PROB_ATOL and r[case]["grad_rel_diff"] <= GRAD_RTOL, (case, r)


def _unpatched(case: str) -> list[dict]:
    limits = (str(COLLECTIVE_TIMEOUT_S), str(WALL_TIMEOUT_S))
    proc = run_child(
        HERE / "mixed_media_fsdp2.py", "dense", case, "fsdp", *limits, env=OFF, timeout=WALL_TIMEOUT_S + 120
    )
    return last_json(proc)


@pytest.mark.skipif(
    VERL.release not in ((0, 7, 1), (0, 9, 1)), reason="the two verl code paths (0.7's actor, 0.9's engine) suffice"
)
def test_negative_control_without_the_patch_ranks_make_different_calls_and_fail():
    """verl's own forward, bounded, all at once (the ranks mostly wait): the two hang cases, their passes alone, and
    video against image, where verl too makes one call per rank and the FSDP pass finishes."""
    with ThreadPoolExecutor(len(HANG_CASES) + 2) as pool:
        alone = pool.submit(child_json, HERE / "mixed_media_fsdp2.py", "dense", ",".join(HANG_CASES), "alone", env=OFF)
        single = pool.submit(child_json, HERE / "mixed_media_fsdp2.py", "dense", "video_vs_image", "fsdp", env=OFF)
        outcomes = dict(zip(HANG_CASES, pool.map(_unpatched, HANG_CASES), strict=True))
        alone, single = alone.result(timeout=600), single.result(timeout=600)
    for case, results in outcomes.items():
        assert [r[case]["visual_calls_alone"] for r in alone] == [2, 1], (case, alone)
        assert all("error" in r for r in results), (case, results)  # one rank aborts, its peer loses it
    for r in single:
        assert r["statuses"][f"qwen3_vl_single_vision_call {MODULES['qwen3_vl']}"] == "disabled", r
        assert r["video_vs_image"]["visual_calls_fsdp"] == 1, r
