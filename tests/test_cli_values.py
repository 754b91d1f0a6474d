"""``vitkit train``'s values are checked against their classes' types before jsonargparse parses them: each wrong
value ends in one line of vitkit's words, whatever jsonargparse's messages say."""

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vitkit.cli.values import check_values
from vitkit.errors import UsageError

BASE = ["fit", "-c", "vit_tiny_digits"]


def _said(argv: list[str]) -> str:
    from vitkit.cli.train import with_recipes

    with pytest.raises(UsageError) as e:
        check_values(with_recipes(argv))
    return str(e.value)


@pytest.mark.parametrize("flags, says", [
    (["--model.recipe.lr", "fast"], "--model.recipe.lr expects a float, got 'fast'"),
    (["--model.recipe.betas", "[0.9]"], "--model.recipe.betas expects a list of 2 (a float, a float), got '[0.9]'"),
    (["--model.recipe.warmup_steps", "ten"], "--model.recipe.warmup_steps expects an int or null, got 'ten'"),
    (["--model.recipe.lrr", "1e-3"], "--model.recipe.lrr: Recipe has no field 'lrr' (did you mean lr?)"),
    (["--trainer.max_epochs=x"], "--trainer.max_epochs expects an int or null, got 'x'"),
    (["--model.labels", "MultiLabel", "--model.labels.loss", "focal"],
     "--model.labels.loss expects one of 'bce', 'asl', got 'focal'"),
    (["--model.adaptation", "Partial"], "--model.adaptation: 'Partial' names no class it takes"),
    (["--model.adaptation", "vitkit.lit.ImageClassifier"],
     "--model.adaptation: 'vitkit.lit.ImageClassifier' is not a kind of Adaptation"),
    (["--model.adaptation.rank", "4"], "--model.adaptation.rank: Full takes no 'rank'"),
    (["--model.adaptation", "LoRA", "--model.adaptation.rank", "four"],
     "--model.adaptation.rank expects an int, got 'four'"),
    (["--model.recipe", '{"lr": "fast"}'], "--model.recipe.lr expects a float, got 'fast'"),
])
def test_a_wrong_flag_is_named_with_what_its_type_takes(flags, says):
    assert _said([*BASE, *flags]).startswith(says)


def test_a_wrong_value_in_a_config_file_is_named_as_its_flag(tmp_path):
    from vitkit.recipes import find

    text = yaml.safe_load(find("vit_tiny_digits").read_text())
    text["model"]["init_args"]["recipe"]["ema_decay"] = "slow"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(text))
    assert _said(["fit", "-c", str(tmp_path / "bad.yaml")]) == "--model.recipe.ema_decay expects a float or null, " \
                                                                 "got 'slow'"


@pytest.mark.parametrize("flags", [
    ["--model.recipe.lr", "1e-3"], ["--model.recipe.lr=0.5"], ["--trainer.max_epochs", "null"],
    ["--model.adaptation", "LoRA", "--model.adaptation.rank", "8"], ["--model.recipe", '{"layer_decay": null}'],
    ["--data.batch_size", "16"],
    ["--trainer.callbacks+=vitkit.lit.StepsPerEpoch", "--trainer.callbacks.min_steps", "3"],
])
def test_right_values_pass(flags):
    from vitkit.cli.train import with_recipes

    check_values(with_recipes([*BASE, *flags]))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["--model.recipe.lr", "--model.recipe.betas", "--model.adaptation", "--model.labels.loss",
                        "--trainer.max_epochs", "--data.img_size", "--model.recipe"]), st.text(max_size=12))
def test_any_text_for_a_flag_passes_or_ends_in_one_usage_error(flag, text):
    from vitkit.cli.train import with_recipes

    try:
        check_values(with_recipes([*BASE, flag, text]))
    except UsageError as e:
        assert "\n" not in str(e)
