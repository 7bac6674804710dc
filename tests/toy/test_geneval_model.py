"""The second toy model, which reads both grammars (`grammar="geneval"`): its vocabulary and token ids, the shipped
file (checked against the manifest), sampling pair prompts, and loading through `model.family_kwargs`."""

import pytest
import torch

from flowrl.models import load_flow_model, toy
from flowrl.models.toy import ToyFlowModel, build_text_encoder, build_unet, load_toy_model
from flowrl.toy.manifest import WEIGHTS_DIR, verified_weights


def test_geneval_vocabulary_extends_the_first_one_and_spells_pair_prompts():
    assert list(toy.GENEVAL_VOCAB)[: len(toy.VOCAB)] == list(toy.VOCAB)
    assert all(toy.GENEVAL_VOCAB[w] == i for w, i in toy.VOCAB.items())
    assert len(toy.GENEVAL_VOCAB) == len(toy.VOCAB) + 7  # a, and, left, right, of, above, below
    v = toy.GENEVAL_VOCAB
    ids = toy.tokenize(["a red circle left of a blue square", "a green triangle and a yellow circle"], "geneval")
    assert ids.tolist() == [
        [v["<bos>"], v["a"], v["red"], v["circle"], v["left"], v["of"], v["a"], v["blue"], v["square"], v["<eos>"]],
        [v["<bos>"], v["a"], v["green"], v["triangle"], v["and"], v["a"], v["yellow"], v["circle"], v["<eos>"], 0],
    ]
    # the first grammar's prompts keep their ids, padded to the longer length; "" is the unconditional prompt
    first = toy.tokenize(["two red circles", ""], "geneval")
    assert first[:, : toy.MAX_LENGTH].tolist() == toy.tokenize(["two red circles", ""]).tolist()
    assert first.shape == (2, toy.GENEVAL_MAX_LENGTH) and (first[:, toy.MAX_LENGTH :] == 0).all()


def test_each_grammar_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="outside the Shapes grammar"):
        toy.tokenize(["a red circle above a blue square"])  # the shipped model's grammar has no pair prompts
    with pytest.raises(ValueError, match="GenEval families.*also reads the first grammar"):
        toy.tokenize(["a red circle near a blue square"], "geneval")
    with pytest.raises(ValueError, match="grammar='pairs' is unknown; use one of shapes, geneval"):
        toy.tokenize(["two red circles"], "pairs")
    with pytest.raises(ValueError, match="family_kwargs.grammar='pairs' is unknown"):
        load_toy_model(grammar="pairs")


def test_a_random_geneval_model_encodes_both_grammars_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = ToyFlowModel(build_unet(), build_text_encoder("geneval"), grammar="geneval")
    prompts = ["a red circle below a blue square", "three green squares"]
    cond = model.encode(prompts)
    assert cond["prompt_embeds"].shape == (2, toy.GENEVAL_MAX_LENGTH, 64)
    alone = model.embed([prompts[0]])[0]
    torch.testing.assert_close(cond["prompt_embeds"][0], alone, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the Shapes world's GenEval families"):
        model.encode(["four red circles"])


def test_shipped_geneval_model_is_checked_and_samples_pair_prompts():
    from flowrl.heldout import sample_images
    from flowrl.registry import REWARDS

    assert verified_weights(toy.GENEVAL_MODEL_FILE) == WEIGHTS_DIR / toy.GENEVAL_MODEL_FILE
    model = load_flow_model("toy", grammar="geneval")
    assert isinstance(model, ToyFlowModel) and model.grammar == "geneval"
    assert model.text_encoder.config.max_position_embeddings == toy.GENEVAL_MAX_LENGTH
    prompts = ["a red circle left of a blue square", "a green triangle and a yellow square", "two red circles"]
    images = sample_images(model, prompts * 4, list(range(12)), num_steps=10, guidance_scale=1.0)
    assert images.shape == (12, 3, 32, 32) and 0.0 <= images.min() and images.max() <= 1.0
    # it draws pairs the world's GenEval gives partial credit (0.34 at these seeds), and the first grammar's scenes
    pairs = [i for i in range(12) if i % 3 != 2]
    partial = REWARDS.build("toy_geneval")(images[pairs], [prompts[i % 3] for i in pairs], None).scores
    assert partial.mean() > 0.2
    assert REWARDS.build("toy_exact")(images[2::3], [prompts[2]] * 4, None).scores.sum() >= 1  # 3 of 4 at these seeds
    # the shipped first model is untouched: its own file, its own 5-token grammar
    assert load_flow_model("toy").text_encoder.config.max_position_embeddings == toy.MAX_LENGTH
    with pytest.raises(ValueError, match="does not apply to the toy model; its settings are source_weight and grammar"):
        load_flow_model("toy", vocabulary="geneval")


def test_geneval_like_config_trains_a_step_on_pair_prompts_and_grades_by_the_exact_verdict(tmp_path):
    """configs/toy/geneval_like.yaml shrunk to 1 step of 2 prompts x 4 (4 sampler steps) and a 2-step evaluation of 8
    held-out prompts: the world's GenEval scores the rollouts, GenEval's verdict over the exact checker grades them."""
    import json

    from flowrl.toy.world import split_prompts
    from flowrl.trainers import build_trainer, kit, load_config

    cfg = load_config(
        "configs/toy/geneval_like.yaml",
        [f"output_dir={tmp_path}", "num_steps=1", "data.num_prompts_per_step=2", "data.group_size=4"]
        + ["sampler.num_steps=4", "eval.seeds=[0]", "eval.num_steps=2", "eval.num_prompts=8"],
    )
    assert (cfg.data.toy_split, cfg.eval.toy_split) == ("geneval_train", "geneval_heldout")
    assert cfg.model.family_kwargs == {"grammar": "geneval"} and [r.name for r in cfg.rewards] == ["toy_geneval"]
    assert [r.name for r in cfg.eval.gold_rewards] == ["toy_geneval_exact"]
    trainer = build_trainer(cfg)
    before = [p.detach().clone() for p in trainer.parts.opt.params]
    kit.train(trainer)
    assert any((a - b).abs().max() > 0 for a, b in zip(before, trainer.parts.opt.params))
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= metrics[-1]["reward/toy_geneval/mean"] <= 1.0
    scores = json.loads((cfg.run_dir / "eval" / "step_000001" / "scores.json").read_text())
    assert set(scores["means"]) == {"toy_geneval", "toy_geneval_exact"}
    assert scores["prompts"] == split_prompts("geneval_heldout")[:8] and len(scores["samples"]) == 8


def test_the_race_leaves_the_geneval_world_out():
    """`flowrl bench trainers` races recipes from the first toy model; configs/toy/geneval_*.yaml use the second."""
    from flowrl.bench import trainers as race

    assert race.world("geneval_like") == "geneval" and "geneval_like" not in race.toy_recipes()
    with pytest.raises(ValueError, match="'geneval_like' trains in the toy geneval world but --baseline 'grpo'"):
        race.recipe_order(["grpo", "geneval_like"])
