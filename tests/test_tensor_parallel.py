"""attn_implementation="sage" under transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`), on CPU.

transformers' TP runs on CPU with the gloo backend (its DISTRIBUTED_BACKEND_MAP maps "cpu" to "gloo"), so the whole
model is tested here: two processes (torch.multiprocessing spawn, gloo on 127.0.0.1) load the same tiny Llama with
`tp_plan="auto"`, each rank then holds Hq/2 query heads and Hkv/2 KV heads (checked), and its logits, generated
tokens and per-rank report are compared with one process running the same model unsharded.

Every quantization statistic of every precision (Q scale groups, K smoothing and scales, V scales, fp4's
per-tensor scale) is taken per (batch, head) or per (batch, KV head), never across heads: a rank's heads give the
same attention as those heads of the unsharded call (bitwise, `test_shard_attention_equals_unsharded_heads`). The
sharded model still differs by fp32 rounding (sharded GEMMs, the all-reduce of o_proj/down_proj), which may move a
quantized value by one step: the quantized logits are compared within QUANT_ATOL, full within FULL_ATOL.

Each worker has a timeout on the process group and the parent waits at most TIMEOUT_S, then kills what it started:
a failure never hangs CI.
"""
import datetime
import os
import traceback

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import sage_patch
from sage_patch.integrations import transformers as hf
from sage_patch.lifecycle import bindings_of
from tests.multiproc import run_ranks

WORLD = 2
TIMEOUT_S = 90
FULL_ATOL = 1e-5    # fp32 rounding of sharded GEMMs and the all-reduce, on logits of magnitude ~1
QUANT_ATOL = 5e-4   # the same, after a rounding-level input change moved a quantized value by one step
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
QUANT = {"default": "8b", "fallback": {"min_seq_len": 1}}
# Layer 0 pinned full; layer 1 4b for prefill; decode steps (Sq = 1 < 2) fall back to full with a reason.
MIXED = {"default": "4b", "layers": [{"index": "0", "precision": "full"}], "fallback": {"min_seq_len": 2}}
# A plan that shards q_proj but leaves k_proj/v_proj whole: each rank has 2 query heads and 2 KV heads, while the
# module's num_key_value_groups (2) says 4 query heads per 2 KV heads.
MISSHARDED_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "replicate",
                   "model.layers.*.self_attn.v_proj": "replicate", "model.layers.*.self_attn.o_proj": "rowwise"}


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, CFG["vocab_size"], (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the mask reaches "sage" as a 4-D bool
    return ids, mask


def _scenarios(model) -> dict:
    """The same calls on the sharded and the unsharded model: logits, generated tokens, each scenario's report and
    the (query, key) shapes the attention layers received."""
    ids, mask = _inputs()
    bindings = bindings_of(model)
    shapes = []
    for b in bindings.values():
        b.observer = lambda layer, q, k, v, call: shapes.append((layer.name, tuple(q.shape), tuple(k.shape)))
    out = {}

    def run(name, policy, fn):
        sage_patch.set_policy(model, policy)
        for b in bindings.values():
            b.stats.reset()
        with torch.no_grad():
            out[name] = (fn(), sage_patch.report(model).to_dict())

    run("8b", QUANT, lambda: model(ids).logits)
    run("full", "full", lambda: model(ids).logits)
    run("8b_padded", QUANT, lambda: model(ids, attention_mask=mask).logits)
    run("mixed_generate", MIXED, lambda: model.generate(ids[:, :12], max_new_tokens=3, do_sample=False,
                                                        min_new_tokens=3, pad_token_id=0))
    out["shapes"] = sorted(set(shapes))
    return out


def _worker(rank, port, path, misplan_path, mqa_path, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="sage")
        res = _scenarios(model)
        res["tp_size"] = model.tp_size
        res["q_proj_local"] = tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape)
        # q_proj sharded, k_proj/v_proj whole: the head grouping is broken and every rank must say so
        bad = AutoModelForCausalLM.from_pretrained(misplan_path, tp_plan=MISSHARDED_PLAN, attn_implementation="sage")
        try:
            with torch.no_grad():
                bad(_inputs()[0])
            res["missharded"] = "ran"
        except ValueError as e:
            res["missharded"] = str(e)
        # one KV head cannot be split over two ranks: transformers' own head reshape refuses it on every rank
        mqa = AutoModelForCausalLM.from_pretrained(mqa_path, tp_plan="auto", attn_implementation="sage")
        try:
            with torch.no_grad():
                mqa(_inputs()[0])
            res["indivisible"] = "ran"
        except RuntimeError as e:
            res["indivisible"] = str(e)
        results.put((rank, "ok", res))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model = LlamaForCausalLM._from_config(LlamaConfig(**CFG), attn_implementation="sage")
    model.save_pretrained(path)
    misplan = path  # the same weights, loaded with MISSHARDED_PLAN
    mqa = tmp_path_factory.mktemp("tiny_llama_mqa")
    LlamaForCausalLM._from_config(LlamaConfig(**{**CFG, "num_key_value_heads": 1})).save_pretrained(mqa)
    single = _scenarios(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sage"))
    return single, run_ranks(_worker, WORLD, str(path), str(misplan), str(mqa), timeout_s=TIMEOUT_S)


def test_each_rank_holds_its_share_of_the_heads(tp_run):
    single, ranks = tp_run
    d = CFG["hidden_size"] // CFG["num_attention_heads"]
    hq, hkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    assert {s[1][1] for s in single["shapes"]} == {hq} and {s[2][1] for s in single["shapes"]} == {hkv}
    for rank, res in ranks.items():
        assert res["tp_size"] == WORLD and res["q_proj_local"] == (hq * d // WORLD, CFG["hidden_size"])
        assert {s[1][1] for s in res["shapes"]} == {hq // WORLD}, res["shapes"]
        assert {s[2][1] for s in res["shapes"]} == {hkv // WORLD}, res["shapes"]
        assert {s[0] for s in res["shapes"]} == {s[0] for s in single["shapes"]}


@pytest.mark.parametrize("scenario, atol", [("8b", QUANT_ATOL), ("full", FULL_ATOL), ("8b_padded", QUANT_ATOL)])
def test_sharded_logits_equal_single_process(tp_run, scenario, atol):
    single, ranks = tp_run
    ref = single[scenario][0]
    # the quantized run is measurably not full precision, so the tolerance distinguishes them
    assert (single["8b"][0] - single["full"][0]).abs().max() > 10 * QUANT_ATOL
    for rank, res in ranks.items():
        torch.testing.assert_close(res[scenario][0], ref, rtol=0, atol=atol, msg=lambda m: f"rank {rank}: {m}")


def test_sharded_generate_and_policy_match_single_process(tp_run):
    single, ranks = tp_run
    tokens, report = single["mixed_generate"]
    assert tokens.shape == (2, 15)
    layer0, layer1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
    assert report[layer0]["used"] == {"full": 3}          # prefill + 2 decode steps (the 3rd token needs none)
    assert report[layer1]["used"] == {"4b": 1, "full": 2}
    assert report[layer1]["fallbacks"] == {"reference simulation (tensors on CPU)": 1,
                                           "sequence length 1 < policy min_seq_len 2": 2}
    for rank, res in ranks.items():
        assert torch.equal(res["mixed_generate"][0], tokens), f"rank {rank}"
        assert res["mixed_generate"][1] == report, f"rank {rank}"


def test_report_per_rank_shows_the_routed_calls(tp_run):
    single, ranks = tp_run
    for scenario, used in (("8b", "8b"), ("8b_padded", "8b"), ("full", "full")):
        for rank, res in ranks.items():
            rep = res[scenario][1]
            assert set(rep) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
            for layer in rep.values():
                assert layer["calls"] == 1 and layer["used"] == {used: 1}, (rank, scenario, rep)
            assert rep == single[scenario][1], (rank, scenario)


def test_missharded_plan_raises_on_every_rank(tp_run):
    _single, ranks = tp_run
    for rank, res in ranks.items():
        assert "received 2 query heads and 2 key/value heads" in res["missharded"], (rank, res["missharded"])
        assert "num_key_value_groups=2" in res["missharded"]


def test_kv_heads_not_dividing_by_tp_size_raise_on_every_rank(tp_run):
    """1 KV head over 2 ranks: transformers shards k_proj into half heads and its own reshape raises on every rank
    before any attention function runs (sage_patch is not reached, so adds nothing); no rank hangs."""
    _single, ranks = tp_run
    for rank, res in ranks.items():
        assert res["indivisible"] != "ran" and "is invalid for input of size" in res["indivisible"], (rank, res)


# ---- the attention function with per-rank shard shapes (no process group) ----------------------------------------

class _Attn(torch.nn.Module):
    """What the adapter reads from a transformers attention module: is_causal, layer_idx, num_key_value_groups
    (transformers keeps the unsharded config; the groups ratio is the same on every rank)."""

    def __init__(self, groups):
        super().__init__()
        self.is_causal, self.layer_idx, self.num_key_value_groups = True, 0, groups


@pytest.mark.parametrize("precision", ["8b", "4b", "fp4", "full"])
def test_shard_attention_equals_unsharded_heads(qkv, precision):
    """Each rank's call (Hq/P query heads, Hkv/P KV heads) gives exactly those heads of the unsharded call."""
    hq, hkv, p = 8, 4, 2
    q, k, v = qkv(b=2, h=hq, hkv=hkv, sq=160, skv=160, d=64, seed=5)
    mask = torch.ones(2, 1, 160, 160, dtype=torch.bool).tril()
    mask[1, ..., :7] = False  # left padding, as transformers' sdpa_mask builds it
    pol = {"default": precision, "fallback": {"min_seq_len": 1}}
    full_mod = _Attn(hq // hkv)
    sage_patch.binding.attach(full_mod, "full", sage_patch.Policy.from_any(pol))
    ref, _ = hf.sage_attention_forward(full_mod, q, k, v, mask)
    for r in range(p):
        mod = _Attn(hq // hkv)
        sage_patch.binding.attach(mod, f"rank{r}", sage_patch.Policy.from_any(pol))
        qs, ks = slice(r * hq // p, (r + 1) * hq // p), slice(r * hkv // p, (r + 1) * hkv // p)
        out, _ = hf.sage_attention_forward(mod, q[:, qs], k[:, ks], v[:, ks], mask)
        assert torch.equal(out, ref[:, :, qs]), precision
        assert mod._sage_patch_binding.stats.used == {precision: 1}


def test_head_grouping_mismatch_raises(qkv):
    q, k, v = qkv(b=1, h=2, hkv=2, sq=16, d=16, seed=6)   # q sharded by 2, k/v not: 2 and 2 heads, groups 2
    with pytest.raises(ValueError, match=r"received 2 query heads and 2 key/value heads.*num_key_value_groups=2"):
        hf.sage_attention_forward(_Attn(2), q, k, v, None)
