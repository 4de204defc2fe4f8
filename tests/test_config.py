import pytest

from speedrun.config import ModelConfig, RunConfig, Stage, apply_overrides, preset
from speedrun.errors import ConfigError


def test_presets_are_fresh_copies():
    a, b = preset("tiny"), preset("tiny")
    a.train.steps = 1
    assert b.train.steps != 1


def test_unknown_preset_lists_known():
    with pytest.raises(KeyError, match="tiny"):
        preset("nope")


def test_overrides_convert_types():
    cfg = apply_overrides(preset("tiny"), ["train.steps=12", "train.lr=1e-3", "train.compile=true",
                                            "model.attn_scale=0.1", "name=abc", "train.batch_tokens=8_192"])
    assert cfg.train.steps == 12 and cfg.train.lr == 1e-3 and cfg.train.compile is True
    assert cfg.model.attn_scale == 0.1 and cfg.name == "abc" and cfg.train.batch_tokens == 8192
    cfg = apply_overrides(cfg, ["model.attn_scale=none"])
    assert cfg.model.attn_scale is None


@pytest.mark.parametrize("bad,match", [
    ("train.nope=1", "unknown setting"),
    ("train.steps=abc", "cannot read"),
    ("train.compile=maybe", "cannot read"),
    ("steps", "section.field=value"),
    ("model=3", "unknown setting"),
])
def test_bad_overrides(bad, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(preset("tiny"), [bad])


def test_model_validation():
    with pytest.raises(ConfigError, match="num_heads"):
        ModelConfig(model_dim=100, num_heads=4, v_head_dim=32).validate()
    with pytest.raises(ConfigError, match="multiple of 4"):
        ModelConfig(qk_head_dim=30).validate()
    with pytest.raises(ConfigError, match="fp8_input_scaling='late'; known: current, delayed"):
        ModelConfig(fp8_input_scaling="late").validate()
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304


def test_round_trip_through_dict():
    cfg = preset("small")
    cfg.train.stages = [Stage(0, 1024, 128, 64, 128, (1.0, 0.5)), Stage(10, 2048, 256, 64, 128)]
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_stages_override_builds_stage_objects():
    cfg = apply_overrides(preset("tiny"), ['train.stages=[[0, 1024, 128, 32, 64], {"start_step": 5, '
                                           '"batch_tokens": 2048, "max_seq_len": 256, "window_short": 64, '
                                           '"window_long": 128, "mtp_weights": [1.0, [0.5, 0.0]]}]'])
    assert cfg.train.stages[0] == Stage(0, 1024, 128, 32, 64)
    assert cfg.train.stages[1].mtp_weights == (1.0, [0.5, 0.0])
    with pytest.raises(ConfigError, match="bad stage"):
        apply_overrides(preset("tiny"), ['train.stages=[{"nope": 1}]'])


def test_every_field_has_a_rule_and_every_preset_passes():
    """A field added without a rule in speedrun.config_check would go unchecked: refuse that."""
    from speedrun.config import PRESETS
    from speedrun.config_check import RULES, field_names, validate_config

    assert set(field_names()) == set(RULES)
    for name, make in PRESETS.items():
        validate_config(make())


def test_config_problems_name_every_bad_field_with_its_range():
    from speedrun.config_check import config_problems, validate_config
    from speedrun.errors import ConfigError

    cfg = preset("tiny")
    apply_overrides(cfg, ["train.steps=0", "train.lr=-1", "model.attn_scale=none", "train.beta1=1"])
    cfg.train.log_every = True  # a bool is not an int
    problems = config_problems(cfg)
    assert problems == ["train.steps=0 is out of range: must be an int >= 1",
                        "train.lr=-1.0 is out of range: must be a finite number > 0",
                        "train.beta1=1.0 is out of range: must be a finite number in [0, 1)",
                        "train.log_every=True has type bool: must be an int >= 1"]
    with pytest.raises(ConfigError, match="bad configuration values: train.steps=0"):
        validate_config(cfg)


def test_every_attention_backend_is_a_valid_config_value():
    """``model.attention_backend`` accepts exactly "auto" and the backends speedrun.attention knows
    (a rule naming fewer would leave a backend reachable only through "auto")."""
    from speedrun.attention import BACKENDS
    from speedrun.config import ATTENTION_BACKEND_CHOICES
    from speedrun.config_check import validate_config

    assert set(ATTENTION_BACKEND_CHOICES) == {"auto", *BACKENDS}
    for name in ATTENTION_BACKEND_CHOICES:
        cfg = preset("record")
        apply_overrides(cfg, [f"model.attention_backend={name}"])
        validate_config(cfg)
    cfg = preset("record")
    apply_overrides(cfg, ["model.attention_backend=cuDNN"])
    with pytest.raises(ConfigError, match="cudnn"):
        validate_config(cfg)
