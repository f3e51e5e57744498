"""The "mamba_sequence_parallel" ds_config section: parsing from every source, and every error."""

import json
import types

import pydantic
import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig, load_mamba_sp_config

FIELDS = (
    "enabled",
    "mode",
    "load_balancing",
    "input_layout",
    "sequence_parallel_size",
    "overlap_comm",
    "summary_exchange",
    "backend",
    "check_shapes",
    "recompute_output",
    "tile_length",
    "block_tile_tokens",
    "long_context",
    "cuda_graphs",
)

# Every field differs from its default, and the combination is valid.
NON_DEFAULT = {
    "enabled": True,
    "mode": "state_passing",
    "load_balancing": "virtual",
    "input_layout": "zigzag",
    "sequence_parallel_size": 4,
    "overlap_comm": False,
    "summary_exchange": "scan",
    "backend": "reference",
    "check_shapes": False,
    "recompute_output": True,
    "tile_length": 4096,
    "block_tile_tokens": 8192,
    "long_context": {
        "tile_tokens": 1024,
        "tiled_layers": False,
        "tiled_mlp": False,
        "fused_loss": False,
        "loss_tile_tokens": 512,
        "offload_gpu_budget_gib": 4.0,
    },
    "cuda_graphs": True,
}


def ds_config(section=None, **top_level):
    cfg = {"train_micro_batch_size_per_gpu": 1, **top_level}
    if section is not None:
        cfg[SECTION] = section
    return cfg


def assert_fields(cfg, expected):
    assert isinstance(cfg, MambaSequenceParallelConfig)
    assert cfg.model_dump() == expected


def test_section_name():
    assert SECTION == "mamba_sequence_parallel"


def test_defaults():
    expected = {
        "enabled": False,
        "mode": "state_passing",
        "load_balancing": "none",
        "input_layout": "contiguous",
        "sequence_parallel_size": None,
        "overlap_comm": True,
        "summary_exchange": "auto",
        "backend": "auto",
        "check_shapes": True,
        "recompute_output": False,
        "tile_length": None,
        "block_tile_tokens": None,
        "long_context": None,
        "cuda_graphs": False,
    }
    assert_fields(MambaSequenceParallelConfig(), expected)
    assert_fields(load_mamba_sp_config(ds_config()), expected)
    assert_fields(load_mamba_sp_config(ds_config({})), expected)
    assert_fields(load_mamba_sp_config({SECTION: None}), expected)
    assert MambaSequenceParallelConfig().resolved_sequence_parallel_size == 1


def test_every_field_has_a_docstring():
    assert tuple(MambaSequenceParallelConfig.model_fields) == FIELDS
    for name, field in MambaSequenceParallelConfig.model_fields.items():
        assert field.description and len(field.description) > 20, name


def test_from_dict():
    assert set(NON_DEFAULT) == set(FIELDS)
    cfg = load_mamba_sp_config(ds_config(NON_DEFAULT))
    assert_fields(cfg, NON_DEFAULT)
    assert cfg.resolved_sequence_parallel_size == 4


@pytest.mark.parametrize("as_str", [True, False])
def test_from_json_file(tmp_path, as_str):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config(NON_DEFAULT)))
    assert_fields(load_mamba_sp_config(str(path) if as_str else path), NON_DEFAULT)


def test_from_deepspeed_config():
    # Building a DeepSpeedConfig needs no process group: without one it assumes world size 1.
    ds_cfg = DeepSpeedConfig(ds_config(NON_DEFAULT))
    assert_fields(load_mamba_sp_config(ds_cfg), NON_DEFAULT)


def test_from_engine_like_objects():
    # deepspeed 0.19.8's DeepSpeedEngine keeps the DeepSpeedConfig in `_config` and the dict in `config`.
    parsed = DeepSpeedConfig(ds_config(NON_DEFAULT))
    engine = types.SimpleNamespace(_config=parsed, config=ds_config())
    assert_fields(load_mamba_sp_config(engine), NON_DEFAULT)  # `_config` wins
    dict_only = types.SimpleNamespace(config=ds_config(NON_DEFAULT))
    assert_fields(load_mamba_sp_config(dict_only), NON_DEFAULT)


def test_built_config_is_returned_as_is():
    cfg = MambaSequenceParallelConfig(enabled=True)
    assert load_mamba_sp_config(cfg) is cfg


def test_config_is_frozen():
    cfg = MambaSequenceParallelConfig(load_balancing="virtual", input_layout="zigzag")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.mode = "ulysses"
    assert cfg.mode == "state_passing"


def test_top_level_sequence_parallel_size_fallback():
    cfg = load_mamba_sp_config(ds_config({"enabled": True}, sequence_parallel_size=2))
    assert cfg.sequence_parallel_size == 2
    assert cfg.resolved_sequence_parallel_size == 2
    # An explicit null in the section also falls back.
    cfg = load_mamba_sp_config(ds_config({"sequence_parallel_size": None}, sequence_parallel_size=8))
    assert cfg.sequence_parallel_size == 8
    # A missing section still picks up the top-level size.
    assert load_mamba_sp_config(ds_config(sequence_parallel_size=2)).sequence_parallel_size == 2
    # Both set and equal is fine.
    cfg = load_mamba_sp_config(ds_config({"sequence_parallel_size": 2}, sequence_parallel_size=2))
    assert cfg.sequence_parallel_size == 2


def test_sizes_in_section_and_top_level_must_agree():
    with pytest.raises(ValueError, match=r"sequence_parallel_size\" is 4 .* top-level .* is 2"):
        load_mamba_sp_config(ds_config({"sequence_parallel_size": 4}, sequence_parallel_size=2))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_bad_top_level_size(bad):
    with pytest.raises(ValueError, match=rf"top-level .*sequence_parallel_size.* got {bad!r}"):
        load_mamba_sp_config(ds_config(sequence_parallel_size=bad))


@pytest.mark.parametrize("key", ["enable", "strict", "load_balance"])
def test_unknown_key_names_it_and_lists_allowed(key):
    for build in (
        lambda: load_mamba_sp_config(ds_config({key: 1})),
        lambda: MambaSequenceParallelConfig(**{key: 1}),
        lambda: MambaSequenceParallelConfig.model_validate({key: 1}),
    ):
        with pytest.raises(ValueError) as info:
            build()
        msg = str(info.value)
        assert repr(key) in msg
        assert all(field in msg for field in FIELDS), msg


@pytest.mark.parametrize(
    "field, bad, allowed",
    [
        ("mode", "ring", ("state_passing", "ulysses")),
        ("mode", "auto", ("state_passing", "ulysses")),  # "auto" is not silently dropped
        ("load_balancing", "zigzag", ("none", "permute_p2p", "permute_a2a", "virtual")),
        ("input_layout", "striped", ("contiguous", "zigzag")),
        ("backend", "cuda", ("auto", "reference", "triton")),
    ],
)
def test_bad_literal_names_value_and_choices(field, bad, allowed):
    with pytest.raises(pydantic.ValidationError) as info:
        load_mamba_sp_config(ds_config({field: bad}))
    msg = str(info.value)
    assert field in msg and repr(bad) in msg
    assert all(repr(choice) in msg for choice in allowed), msg


@pytest.mark.parametrize("bad", [0, -2])
def test_size_below_one(bad):
    with pytest.raises(pydantic.ValidationError, match=r"(?s)sequence_parallel_size.*greater than or equal to 1"):
        MambaSequenceParallelConfig(sequence_parallel_size=bad)


@pytest.mark.parametrize("bad", [True, 2.0, "2"])
def test_size_must_be_an_int(bad):
    with pytest.raises(pydantic.ValidationError, match=r"(?s)sequence_parallel_size.*valid integer"):
        MambaSequenceParallelConfig(sequence_parallel_size=bad)


@pytest.mark.parametrize(
    "mode, load_balancing, input_layout, pattern",
    [
        (
            "state_passing",
            "none",
            "zigzag",
            r'"none" with input_layout "zigzag".*set input_layout to "contig',
        ),
        (
            "state_passing",
            "virtual",
            "contiguous",
            r'load_balancing "virtual" expects input_layout "zigzag" but got "contiguous"',
        ),
        (
            "state_passing",
            "permute_p2p",
            "contiguous",
            r'load_balancing "permute_p2p" expects input_layout "zigzag"',
        ),
        (
            "state_passing",
            "permute_a2a",
            "contiguous",
            r'load_balancing "permute_a2a" expects input_layout "zigzag"',
        ),
        ("ulysses", "virtual", "zigzag", r'mode "ulysses" does not take load_balancing "virtual".*"none"'),
        ("ulysses", "permute_p2p", "zigzag", r'mode "ulysses" does not take load_balancing "permute_p2p"'),
        ("ulysses", "permute_a2a", "contiguous", r'"ulysses" does not take load_balancing "permute_a2a"'),
    ],
)
def test_contradictions(mode, load_balancing, input_layout, pattern):
    section = {"mode": mode, "load_balancing": load_balancing, "input_layout": input_layout}
    with pytest.raises(pydantic.ValidationError, match=pattern):
        load_mamba_sp_config(ds_config(section))


@pytest.mark.parametrize(
    "field, value, pattern",
    [("recompute_output", True, 'cannot honour "recompute_output"'), ("overlap_comm", False, "nothing for")],
)
def test_ulysses_refuses_options_it_cannot_honour(field, value, pattern):
    with pytest.raises(pydantic.ValidationError, match=pattern):
        load_mamba_sp_config(ds_config({"mode": "ulysses", field: value}))


@pytest.mark.parametrize(
    "mode, load_balancing, input_layout",
    [
        ("state_passing", "none", "contiguous"),
        ("state_passing", "virtual", "zigzag"),
        ("state_passing", "permute_p2p", "zigzag"),
        ("state_passing", "permute_a2a", "zigzag"),
        ("ulysses", "none", "contiguous"),
        ("ulysses", "none", "zigzag"),
    ],
)
def test_allowed_combinations(mode, load_balancing, input_layout):
    cfg = MambaSequenceParallelConfig(mode=mode, load_balancing=load_balancing, input_layout=input_layout)
    assert (cfg.mode, cfg.load_balancing, cfg.input_layout) == (mode, load_balancing, input_layout)


def test_section_must_be_an_object():
    with pytest.raises(TypeError, match=rf'"{SECTION}" section must be a JSON object, got list'):
        load_mamba_sp_config({SECTION: [1, 2]})


@pytest.mark.parametrize("bad", [42, None, object(), types.SimpleNamespace(config="ds.json")])
def test_unsupported_source_type(bad):
    with pytest.raises(TypeError) as info:
        load_mamba_sp_config(bad)
    msg = str(info.value)
    assert type(bad).__qualname__ in msg
    assert "ds_config dict" in msg and "DeepSpeedConfig" in msg and "engine" in msg


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_mamba_sp_config(missing)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_mamba_sp_config(str(missing))


def test_bad_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"mamba_sequence_parallel": {')
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_mamba_sp_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, expected a JSON object"):
        load_mamba_sp_config(path)


def test_errors_in_a_file_are_reported(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config({"mode": "ulysses", "load_balancing": "virtual"})))
    with pytest.raises(ValueError, match='mode "ulysses" does not take load_balancing "virtual"'):
        load_mamba_sp_config(path)


class TestValidateForMixer:
    def test_state_passing_takes_any_head_count(self):
        cfg = MambaSequenceParallelConfig()
        cfg.validate_for_mixer(nheads=3, ngroups=3, cp=4)
        cfg.validate_for_mixer(nheads=24, ngroups=1, cp=1)

    def test_configured_size_must_match_group(self):
        cfg = MambaSequenceParallelConfig(sequence_parallel_size=4)
        cfg.validate_for_mixer(nheads=8, ngroups=1, cp=4)
        with pytest.raises(ValueError, match="group has 2 ranks but the config sets sequence_parallel_size 4"):
            cfg.validate_for_mixer(nheads=8, ngroups=1, cp=2)

    def test_fallback_size_must_match_group(self):
        cfg = load_mamba_sp_config(ds_config({"enabled": True}, sequence_parallel_size=2))
        with pytest.raises(ValueError, match="group has 4 ranks .* sequence_parallel_size 2"):
            cfg.validate_for_mixer(nheads=8, ngroups=1, cp=4)

    @pytest.mark.parametrize("ngroups, cp", [(8, 2), (8, 8), (2, 8), (1, 4), (4, 4)])
    def test_ulysses_accepts(self, ngroups, cp):
        MambaSequenceParallelConfig(mode="ulysses").validate_for_mixer(nheads=16, ngroups=ngroups, cp=cp)

    def test_ulysses_needs_heads_divisible(self):
        cfg = MambaSequenceParallelConfig(mode="ulysses")
        with pytest.raises(ValueError, match="nheads=6 is not divisible by cp=4"):
            cfg.validate_for_mixer(nheads=6, ngroups=1, cp=4)

    @pytest.mark.parametrize("ngroups, cp", [(3, 2), (6, 4), (4, 6)])
    def test_ulysses_needs_groups_and_size_to_divide(self, ngroups, cp):
        cfg = MambaSequenceParallelConfig(mode="ulysses")
        with pytest.raises(ValueError, match=rf"ngroups={ngroups} and cp={cp} to divide one another"):
            cfg.validate_for_mixer(nheads=12 * cp, ngroups=ngroups, cp=cp)

    @pytest.mark.parametrize("name", ["nheads", "ngroups", "cp"])
    @pytest.mark.parametrize("bad", [0, -1, 2.0, True])
    def test_rejects_non_positive_ints(self, name, bad):
        kwargs = {"nheads": 8, "ngroups": 2, "cp": 2, name: bad}
        with pytest.raises(ValueError, match=rf"{name} must be a positive int, got {bad!r}"):
            MambaSequenceParallelConfig().validate_for_mixer(**kwargs)

    def test_arguments_are_keyword_only(self):
        with pytest.raises(TypeError):
            MambaSequenceParallelConfig().validate_for_mixer(8, 2, 2)


def test_long_context_forms():
    """``true`` is every default, ``false`` / ``null`` off; unknown or bad keys name themselves."""
    on = load_mamba_sp_config(ds_config({"long_context": True})).long_context
    assert on is not None and on.tile_tokens == 32768 and on.tiled_layers and on.fused_loss
    assert on.offload_gpu_budget_gib is None and on.loss_tile_tokens is None
    for off in (False, None):
        assert load_mamba_sp_config(ds_config({"long_context": off})).long_context is None
    with pytest.raises(pydantic.ValidationError, match="tile_tokens"):
        load_mamba_sp_config(ds_config({"long_context": {"tile_tokens": 0}}))
    with pytest.raises(pydantic.ValidationError, match="unknown key"):
        load_mamba_sp_config(ds_config({"long_context": {"offload": True}}))


@pytest.mark.parametrize("bad", [0, -4, 2.0, "8192", True])
def test_bad_block_tile_tokens(bad):
    with pytest.raises(pydantic.ValidationError, match="block_tile_tokens"):
        load_mamba_sp_config(ds_config({"block_tile_tokens": bad}))


def test_rest_of_the_ds_config_read_with_the_section():
    """load_mamba_sp_config reads what the package needs from the rest of the ds_config into ``deepspeed`` (issue 43
    item 4: one parse, no later read of the dict); a config built from the section alone has DeepSpeed's defaults,
    and ``deepspeed`` is no key of the section."""
    from ds_mamba_spcp.config import DeepSpeedSettings
    from ds_mamba_spcp.data import selects_bf16_optimizer

    rest = {"zero_optimization": {"stage": 1, "reduce_scatter": False, "offload_optimizer": {"device": "none"}},
            "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}  # fmt: skip
    cfg = load_mamba_sp_config(ds_config({"enabled": True}, **rest))
    assert cfg.deepspeed == DeepSpeedSettings(1, False, True, "fp32", "none")
    assert cfg.deepspeed.selects_bf16_optimizer and selects_bf16_optimizer(cfg) and selects_bf16_optimizer(rest)
    assert cfg.model_dump() == load_mamba_sp_config(ds_config({"enabled": True})).model_dump()  # not in the section
    assert MambaSequenceParallelConfig(enabled=True).deepspeed == DeepSpeedSettings()
    assert not DeepSpeedSettings().selects_bf16_optimizer
    # accelerate's unfilled "auto" is no stage; an older "bfloat16" key counts as bf16
    auto = load_mamba_sp_config({"zero_optimization": {"stage": "auto"}, "bfloat16": {"enabled": True}})
    assert auto.deepspeed.zero_stage is None and auto.deepspeed.bf16
    with pytest.raises(ValueError, match="unknown key"):
        load_mamba_sp_config(ds_config({"deepspeed": {"zero_stage": 2}}))
