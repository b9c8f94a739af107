"""Report and the generic routing context manager on a tiny model."""
import warnings

import pytest
import torch

import sage_patch
from sage_patch.report import LayerStats, Report
from sage_patch.resolve import Decision

TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention  # torch's own, captured before any routing


class TinyAttention(torch.nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(b, s, d)


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(TinyAttention() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_report_dict_and_table():
    st = LayerStats("blocks.0.attn")
    st.record(Decision("8b", "8b", "reference", "reference simulation (tensors on CPU)", path="reference"))
    st.record(Decision("8b", "full", "sdpa", "sequence length 1 < policy min_seq_len 128", path="sdpa"))
    d = Report({"blocks.0.attn": st}).to_dict()
    assert d["blocks.0.attn"]["calls"] == 2
    assert d["blocks.0.attn"]["used"] == {"8b": 1, "full": 1}
    assert d["blocks.0.attn"]["fallbacks"]["sequence length 1 < policy min_seq_len 128"] == 1
    text = str(Report({"blocks.0.attn": st}))
    assert "blocks.0.attn" in text and "min_seq_len" in text and "calls" in text.splitlines()[0]


def test_route_sdpa_per_layer_rules_and_report():
    torch.manual_seed(0)
    net = TinyNet().eval()
    x = torch.randn(2, 160, 32)
    base = net(x)
    policy = {"default": "8b", "layers": [{"index": 1, "precision": "full"}], "fallback": {"min_seq_len": 0}}
    with torch.no_grad(), sage_patch.route_sdpa(net, policy) as bindings:
        out = net(x)
        assert sorted(bindings) == ["layers.0", "layers.1", "layers.2"]
    assert sage_patch.cosine(out, base) >= 0.999
    rep = sage_patch.report(net).to_dict()
    assert rep["layers.0"]["used"] == {"8b": 1}
    assert rep["layers.1"]["used"] == {"full": 1}
    assert rep["layers.2"]["calls"] == 1
    # after the context, SDPA is torch's own again and nothing is routed
    assert torch.nn.functional.scaled_dot_product_attention is TORCH_SDPA
    with torch.no_grad():
        torch.testing.assert_close(net(x), base)
    assert sage_patch.report(net).to_dict()["layers.0"]["calls"] == 1


def test_policy_min_seq_len_is_reported_as_fallback():
    net = TinyNet().eval()
    with torch.no_grad(), sage_patch.route_sdpa(net, "sage_patch/configs/llama.yaml"):
        net(torch.randn(1, 16, 32))
    fb = sage_patch.report(net).to_dict()["layers.0"]["fallbacks"]
    assert any("min_seq_len 128" in r for r in fb)


def test_report_rejects_other_objects():
    with pytest.raises(TypeError, match="nn.Module or a diffusers pipeline"):
        sage_patch.report(42)



def test_route_sdpa_warns_naming_the_patterns_when_nothing_matches(caplog):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = torch.nn.Linear(32, 32)
            self.attn_proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.attn_proj(self.mixer(x))

    model = Block()
    x = torch.randn(1, 8, 32)
    with caplog.at_level("WARNING", logger="sage_patch"):
        with pytest.warns(RuntimeWarning) as rec:
            with sage_patch.route_sdpa(model, "8b") as bindings:
                model(x)
    assert bindings == {}
    msg = str(rec[0].message)
    assert "no module of Block matched" in msg
    assert "'Attention' or 'SelfAttention'" in msg          # the patterns it looked for
    assert "attn_proj (Linear)" in msg and "select=" in msg   # candidates by name, and the way out
    assert len(rec) == 1  # one channel: the warning, not also the log
    assert not any("no module of Block matched" in r.getMessage() for r in caplog.records)


def test_layer_rule_matching_no_layer_warns_once_naming_the_rule_and_layers():
    policy = sage_patch.Policy.from_dict({"default": "8b", "layers": [{"match": "layer.1", "precision": "full"},
                                                                      {"index": 0, "precision": "4b"}]})
    with pytest.warns(RuntimeWarning) as rec:
        with sage_patch.route_sdpa(TinyNet(), policy):
            pass
    msgs = [str(w.message) for w in rec if "matches none" in str(w.message)]
    assert len(msgs) == 1  # the index rule matches layers.0
    assert "rule layers[0] {'match': 'layer.1', 'precision': 'full'}" in msgs[0]
    assert "names such as layers.0, layers.1, layers.2" in msgs[0] and "layer indices 0-2" in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sage_patch.route_sdpa(TinyNet(), policy):  # once
            pass


def test_route_sdpa_custom_select_routes_and_does_not_warn(recwarn):
    net = TinyNet()
    with sage_patch.route_sdpa(net, "8b") as bindings:
        net(torch.randn(1, 8, 32))
    assert len(bindings) == 3
    custom = torch.nn.Sequential(torch.nn.Identity(), TinyAttention())
    with sage_patch.route_sdpa(custom, "8b", select=lambda n, m: n == "1") as bindings:
        custom(torch.randn(1, 8, 32))
    assert list(bindings) == ["1"] and bindings["1"].stats.calls == 1
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning) and "route_sdpa" in str(w.message)]


def test_route_sdpa_select_globs_narrow_the_attention_modules():
    net = TinyNet()
    with sage_patch.route_sdpa(net, "8b", select=["layers.0", "layers.2"]) as bindings:
        net(torch.randn(1, 8, 32))
    assert list(bindings) == ["layers.0", "layers.2"] and all(b.stats.calls == 1 for b in bindings.values())
    assert set(sage_patch.report(net).to_dict()) == {"layers.0", "layers.2"}
    with pytest.warns(RuntimeWarning, match="attention modules named 'layers.9'"):
        with sage_patch.route_sdpa(net, "8b", select="layers.9") as bindings:
            pass
    assert bindings == {}


def test_route_sdpa_warning_names_a_custom_select():
    def only_mixers(name, module):
        return name.endswith("mixer")

    with pytest.warns(RuntimeWarning, match="modules accepted by select=.*only_mixers"):
        with sage_patch.route_sdpa(TinyNet(), "8b", select=only_mixers):
            pass
