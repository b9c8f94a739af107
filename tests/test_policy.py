"""Policies: parsing, precedence, fallbacks, error messages, shipped configs."""
import glob
import os

import pytest
import torch

from sage_patch import Policy, PolicyError, load_policy
from sage_patch.policy import shipped_policy_path

EXAMPLE = """\
default: 8b
layers:
  - match: "single_transformer_blocks.*"
    precision: full
  - index: "0-1"
    precision: 4b
steps:
  - first: 2
    precision: full
  - last: 2
    precision: full
  - range: "10-20"
    precision: 4b
fallback:
  min_seq_len: 128
  head_dims: [256]
  dtypes: [float32]
options:
  smooth_v: true
"""


def test_example_schema_parses_and_matches():
    p = Policy.from_yaml(EXAMPLE)
    assert p.default == "8b" and p.smooth_v is True and p.min_seq_len == 128
    assert p.precision_for("single_transformer_blocks.3.attn", 40) == "full"
    assert p.precision_for("transformer_blocks.1.attn", 1) == "4b"
    assert p.precision_for("transformer_blocks.5.attn", 5) == "8b"


def test_step_rules_and_precedence():
    p = Policy.from_yaml(EXAMPLE)
    name = "transformer_blocks.5.attn"
    got = [p.precision_for(name, 5, step=s, num_steps=28) for s in range(28)]
    assert got[:2] == ["full", "full"] and got[-2:] == ["full", "full"]
    assert got[10:21] == ["4b"] * 11 and got[2] == "8b" and got[21] == "8b"
    # a layer pinned to full by a layer rule is never lowered by a step rule
    assert p.precision_for("single_transformer_blocks.0.attn", 40, step=15, num_steps=28) == "full"
    # without step information (not a diffusion loop), step rules do not apply
    assert p.precision_for(name, 5) == "8b"
    # 'last' needs the number of steps; without it the rule cannot match
    assert p.precision_for(name, 5, step=27, num_steps=None) == "8b"


def test_fallback_rules():
    p = Policy.from_yaml(EXAMPLE)
    assert "min_seq_len" in p.fallback_reason(1, 4096, 128, torch.float16)
    assert "head dim 256" in p.fallback_reason(4096, 4096, 256, torch.float16)
    assert "float32" in p.fallback_reason(4096, 4096, 128, torch.float32)
    assert p.fallback_reason(4096, 4096, 128, torch.bfloat16) is None


def test_roundtrip_yaml_and_dict():
    p = Policy.from_yaml(EXAMPLE)
    again = Policy.from_yaml(p.to_yaml())
    assert again == p
    assert Policy.from_dict(p.to_dict()) == p


def test_training_key_parses_round_trips_and_defaults_to_none():
    assert Policy.from_yaml("default: 8b\n").training is None
    for value in ("8b", "full"):
        p = Policy.from_yaml(f"default: 4b\ntraining: {value}\n")
        assert p.training == value and Policy.from_yaml(p.to_yaml()) == p
    assert "training" not in Policy().to_dict()


def test_training_speed_routing_option_parses_round_trips_and_defaults_to_true():
    assert Policy().training_speed_routing is True and Policy.from_yaml("default: 8b\n").training_speed_routing
    assert "training_speed_routing" not in Policy().to_dict()["options"]
    p = Policy.from_yaml("options:\n  training_speed_routing: false\n")
    assert p.training_speed_routing is False and p.to_dict()["options"]["training_speed_routing"] is False
    assert Policy.from_yaml(p.to_yaml()) == p and Policy.from_dict(p.to_dict()) == p
    assert Policy.from_dict({"options": {"training_speed_routing": True}}).training_speed_routing is True
    with pytest.raises(PolicyError, match=r"'options.training_speed_routing'.*got 1"):
        Policy.from_dict({"options": {"training_speed_routing": 1}})


def test_from_any_accepts_every_form(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(EXAMPLE)
    assert Policy.from_any(str(path)) == Policy.from_any(path) == load_policy(path)
    assert Policy.from_any({"default": "4b"}).default == "4b"
    assert Policy.from_any("fp4").default == "fp4"
    assert Policy.from_any(None).default == "8b"
    with pytest.raises(PolicyError):
        Policy.from_any(3)


@pytest.mark.parametrize("text,key,line,allowed", [
    ("default: int8\n", "default", 1, "8b, 4b, fp4, full"),
    ("default: 8b\nlayers:\n  - match: 'a.*'\n    precision: fast\n", "layers[0].precision", 4, "8b, 4b, fp4, full"),
    ("default: 8b\nlayerz: []\n", "layerz", 2, "allowed: default"),
    ("layers:\n  - precision: full\n", "layers[0]", 2, "'match'"),
    ("steps:\n  - first: 2\n    last: 2\n    precision: full\n", "steps[0]", 2, "exactly one of"),
    ("steps:\n  - range: '5-2'\n    precision: full\n", "steps[0].range", 2, "range 'a-b'"),
    ("fallback:\n  min_seq_len: -3\n", "fallback.min_seq_len", 2, "non-negative integer"),
    ("fallback:\n  dtypes: [float64]\n", "fallback.dtypes", 2, "float16, bfloat16, float32"),
    ("options:\n  smooth_v: maybe\n", "options.smooth_v", 2, "true or false"),
    ("options:\n  smooth_q: true\n", "options.smooth_q", 2, "allowed: exact_4b, smooth_v, training_speed_routing"),
    ("options:\n  exact_4b: 1\n", "options.exact_4b", 2, "true or false"),
    ("options:\n  smooth_v: false\n  training_speed_routing: 'off'\n", "options.training_speed_routing", 3,
     "must be true (training calls run SDPA where it is faster than the training kernel) or false (the training "
     "kernel wherever it can run); got 'off'"),
    ("default: 8b\ntraining: 4b\n", "training", 2, "8b, full"),
])
def test_validation_errors_name_file_key_line_and_allowed(tmp_path, text, key, line, allowed):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    msg = str(e.value)
    assert str(path) in msg and f"'{key}'" in msg and f"line {line}" in msg and allowed in msg, msg


def test_malformed_yaml_reports_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("default: 8b\nlayers:\n  - match: [unclosed\n")
    with pytest.raises(PolicyError, match=r"broken.yaml: malformed YAML \(line \d+"):
        load_policy(path)


def test_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "nope.yaml")


SHIPPED = ["llama", "flux", "sd35", "cogvideox", "hunyuanvideo"]


@pytest.mark.parametrize("family", SHIPPED)
def test_shipped_configs_validate_and_explain_themselves(family):
    path = shipped_policy_path(family)
    p = load_policy(path)
    assert p.name == family
    first = open(path).readline()
    assert first.startswith("# ") and len(first) > 40  # says what its choices rest on


def test_every_config_in_repo_is_shipped():
    here = os.path.join(os.path.dirname(__file__), "..", "sage_patch", "configs")
    names = sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(here, "*.yaml")))
    assert names == sorted([*SHIPPED, "families"])  # families.yaml: the family -> default policy table (data)


def test_family_table_names_shipped_policies():
    import yaml

    with open(os.path.join(os.path.dirname(__file__), "..", "sage_patch", "configs", "families.yaml")) as f:
        table = yaml.safe_load(f)
    named = {*table["transformers"]["model_type"].values(), table["transformers"]["default"],
             *table["diffusers"]["class_contains"].values()}
    assert named <= set(SHIPPED)
    Policy.from_dict(table["diffusers"]["default"])


def test_unknown_string_policy_says_not_a_file_not_a_precision_and_lists_precisions():
    with pytest.raises(PolicyError) as e:
        Policy.from_any("8bit")
    msg = str(e.value)
    assert "'8bit'" in msg and "not a file" in msg and "not a precision name" in msg
    assert "8b, 4b, fp4, full" in msg and "key ''" not in msg


@pytest.mark.parametrize("family", SHIPPED)
def test_shipped_policies_by_name_from_any_directory(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: "sage_patch/configs/flux.yaml" is no path here
    assert Policy.from_any(family) == load_policy(shipped_policy_path(family))
    assert Policy.from_any(family).name == family


def test_unknown_name_lists_the_shipped_policies_and_the_precisions():
    with pytest.raises(PolicyError) as e:
        Policy.from_any("fluxx")
    msg = str(e.value)
    assert "not a shipped policy (allowed: cogvideox, flux, hunyuanvideo, llama, sd35)" in msg
    assert "not a precision name (allowed: 8b, 4b, fp4, full)" in msg


def test_set_policy_on_a_model_reports_the_bad_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    import sage_patch

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sage")
    with pytest.raises(PolicyError, match=r"policy '8bit': not a file .*allowed: 8b, 4b, fp4, full"):
        sage_patch.set_policy(model, "8bit")


@pytest.mark.parametrize("text,key,line,first", [
    ("default: 8b\nfallback:\n  min_seq_len: 64\ndefault: 4b\n", "default", 4, 1),
    ("default: 8b\nfallback:\n  min_seq_len: 64\n  min_seq_len: 128\n", "fallback.min_seq_len", 4, 3),
    ("layers:\n  - match: 'a.*'\n    precision: full\n    precision: 8b\n", "layers[0].precision", 4, 3),
])
def test_duplicate_yaml_keys_are_rejected_naming_file_key_and_lines(tmp_path, text, key, line, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    msg = str(e.value)
    assert str(path) in msg and f"key '{key}' (line {line})" in msg and f"already given at line {first}" in msg


def test_top_level_list_is_reported_as_the_top_level(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- default: 8b\n- precision: full\n")
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    msg = str(e.value)
    assert msg.startswith(f"policy {path}: the top level (line 1): must be a mapping")
    assert "got a list" in msg and "default" in msg and "key ''" not in msg


def test_cli_validate_reports_duplicate_key(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "dup.yaml"
    path.write_text("default: 8b\ndefault: full\n")
    r = subprocess.run([sys.executable, "-m", "sage_patch.cli", "validate", str(path)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "duplicate key" in (r.stdout + r.stderr)
