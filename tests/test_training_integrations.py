"""Training through the integrations on CPU (the trainable 8b, SageBwd, as its reference simulation): transformers'
`Trainer` and PEFT LoRA on a tiny Llama with attn_implementation="sage", and one backward pass of the tiny SD3,
SD3.5-medium-like, CogVideoX and HunyuanVideo transformers with enable_sage_attention() (Flux: tests/test_training.py).
Each compares with the same model in full precision, so a gradient that is finite but wrong fails."""
import re

import pytest
import torch

import sage_patch
from tests.test_training import _tiny_llama

TRAINABLE_REASON = "reference simulation of the trainable 8b (SageBwd) (tensors on CPU)"


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _llama_pair():
    """A tiny Llama on "sage" (policy 8b: the shipped llama policy runs sequences under 128 tokens full) and the
    same weights on torch SDPA."""
    sage = _tiny_llama("sage")
    sage_patch.set_policy(sage, "8b")
    full = _tiny_llama("sdpa")
    full.load_state_dict(sage.state_dict())
    return sage, full


def _assert_all_layers_trainable(model, calls):
    rep = sage_patch.report(model).to_dict()
    assert len(rep) == 2, rep.keys()
    for layer, st in rep.items():
        assert st["impl"] == {"reference-sagebwd": calls} and st["used"] == {"8b": calls}, (layer, st)
        assert list(st["fallbacks"]) == [TRAINABLE_REASON], (layer, st)


# ---- transformers -----------------------------------------------------------------------------------------------

def _trainer_losses(model, out_dir, steps):
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(20)
    data = []
    for pad in (0, 8):  # the second sequence left-padded: a key-padding mask reaches the attention
        ids = torch.randint(1, 128, (40,), generator=g)
        am = torch.ones_like(ids)
        am[:pad] = 0
        data.append({"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)})
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=steps,
                             learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_a_sage_llama_through_the_trainable_8b(tmp_path):
    sage, full = _llama_pair()
    sage_losses = _trainer_losses(sage, tmp_path / "sage", 5)
    full_losses = _trainer_losses(full, tmp_path / "full", 5)
    assert len(sage_losses) == 5 and all(map(torch.isfinite, torch.tensor(sage_losses)))
    assert sage_losses[-1] < sage_losses[0] - 0.5, sage_losses
    # same weights, data and order in full precision: the curves agree (measured: at most 2.0e-3 apart)
    assert max(abs(a - b) for a, b in zip(sage_losses, full_losses)) < 0.01, (sage_losses, full_losses)
    _assert_all_layers_trainable(sage, 5)


def test_peft_lora_trains_through_the_trainable_8b():
    from peft import LoraConfig, get_peft_model

    sage, full = _llama_pair()
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    sage = get_peft_model(sage, LoraConfig(**lora))
    full = get_peft_model(full, LoraConfig(**lora))
    full.load_state_dict(sage.state_dict())  # the same random lora_A
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(21))
    trainable = {n: p for n, p in sage.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    # the first step's LoRA gradients equal full precision's up to the 8-bit error (lora_B starts at zero, so
    # only lora_B has a gradient yet)
    full(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in full.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    losses = []
    for step in range(5):
        loss = sage(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is None for n, p in sage.named_parameters() if not p.requires_grad)
        grads = {n: p.grad for n, p in trainable.items()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        if step == 0:
            b = [n for n in grads if "lora_B" in n]
            assert len(b) == 4 and all(grads[n].abs().sum() > 0 for n in b)
            assert all(cos(grads[n], want[n]) > 0.999 for n in b), {n: cos(grads[n], want[n]) for n in b}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert all(g.abs().sum() > 0 for g in grads.values())  # lora_A too, once lora_B moved
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    _assert_all_layers_trainable(sage, 5)


# ---- diffusers ----------------------------------------------------------------------------------------------------

QKV_PROJ = re.compile(r"\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.weight$")


def _grads(model, inputs, precision):
    model.zero_grad(set_to_none=True)
    model.train().enable_sage_attention(precision)
    try:
        model(**inputs)[0].pow(2).mean().backward()
        rep = sage_patch.report(model).to_dict()
    finally:
        model.disable_sage_attention()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, rep


@pytest.mark.parametrize("name", ["sd3", "sd35_medium", "cogvideox", "hunyuanvideo"])
def test_diffusers_transformer_backward_through_the_trainable_8b(name, mask_kinds):
    """Every attention layer trains as the trainable 8b, whatever it is given: SD3's joint attention and SD3.5's
    attn2 (one processor object for two layers), CogVideoX's text + video self-attention, HunyuanVideo's main blocks
    with the text key-padding mask (B, 1, 1, N) and its token refiner with a dense bool mask (B, 1, S, S): the
    trainable path takes bool masks of both kinds, so no layer falls back."""
    from tests.test_diffusers_integration import MODELS

    builder, n_layers, _ = MODELS[name]
    model, inputs = builder()
    grads, rep = _grads(model, inputs, "8b")
    assert len(rep) == n_layers
    for layer, st in rep.items():
        assert st["impl"] == {"reference-sagebwd": 1} and st["used"] == {"8b": 1}, (layer, st)
        assert list(st["fallbacks"]) == [TRAINABLE_REASON], (layer, st)
    if name == "hunyuanvideo":
        assert mask_kinds.count("key_padding") == 4 and mask_kinds.count("dense") == 1, mask_kinds
    full, _ = _grads(model, inputs, "full")
    assert grads.keys() == full.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # the Q/K/V projections' gradients pass through dQ, dK, dV: close to full precision's (measured 1 - cos at
    # most 2.5e-5), and not equal to them (the 8-bit path really ran)
    keys = [n for n in grads if QKV_PROJ.search(n)]
    ours, want = (torch.cat([g[n].flatten() for n in keys]) for g in (grads, full))
    assert len(keys) >= 3 * n_layers and cos(ours, want) > 0.9999, cos(ours, want)
    assert not torch.equal(ours, want)
