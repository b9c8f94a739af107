"""Local stand-ins for the Hub repos that diffusers' tests/lora/ loads (tiny text encoders with random weights, toy
tokenizers), written in a Hugging Face cache layout, for running those tests where hf.co cannot be reached:

    python tests/upstream/hub_standins.py /tmp/hfstub/hub
    HF_HUB_CACHE=/tmp/hfstub/hub python tools/run_upstream_tests.py --only diffusers --diffusers-src DIR

Shapes match the denoisers' configs in those tests (T5 d_model 32, CLIP hidden 32, HunyuanVideo Llama 16 / CLIP 8);
the weights and vocabularies are NOT the Hub's, so tolerance-based assertions may differ from upstream's CI: compare
runs with and without the plugin against each other, not against upstream. Not used by CI."""
import sys
from pathlib import Path
import torch
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, LlamaConfig,
                          LlamaModel, LlamaTokenizerFast, T5Config, T5EncoderModel, T5Tokenizer)
from transformers.convert_slow_tokenizer import bytes_to_unicode

CACHE = Path(sys.argv[1])
REV = "0" * 40


def repo_dir(repo_id):
    d = CACHE / f"models--{repo_id.replace('/', '--')}"
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(REV)
    snap = d / "snapshots" / REV
    snap.mkdir(parents=True, exist_ok=True)
    return snap


chars = list(bytes_to_unicode().values())


def clip_tok():
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    for s in ("<|startoftext|>", "<|endoftext|>"):
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tok():
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]
    vocab += [("▁" + c, -2.5) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=vocab, extra_ids=100, model_max_length=512)


def llama_tok():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = LlamaTokenizerFast(vocab=vocab, merges=[], model_max_length=256)
    tok.pad_token = "</s>"
    return tok


torch.manual_seed(0)
clip_kw = dict(vocab_size=1000, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=77, bos_token_id=len(chars) * 2, eos_token_id=len(chars) * 2 + 1, pad_token_id=1)
t5_cfg = T5Config(vocab_size=1100, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                  decoder_start_token_id=0)

for rid in ("hf-internal-testing/tiny-random-clip", "peft-internal-testing/tiny-clip-text-2"):
    d = repo_dir(rid)
    clip_tok().save_pretrained(d)
    CLIPTextModel(CLIPTextConfig(hidden_size=32, projection_dim=32, **clip_kw)).save_pretrained(d)
for rid in ("hf-internal-testing/tiny-sd3-text_encoder", "hf-internal-testing/tiny-sd3-text_encoder-2"):
    CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=32, projection_dim=32, **clip_kw)).save_pretrained(repo_dir(rid))
d = repo_dir("hf-internal-testing/tiny-random-t5")
t5_tok().save_pretrained(d)
T5EncoderModel(t5_cfg).save_pretrained(d)
d = repo_dir("hf-internal-testing/tiny-random-hunyuanvideo")
llama_tok().save_pretrained(d / "tokenizer")
clip_tok().save_pretrained(d / "tokenizer_2")
LlamaModel(LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2)).save_pretrained(d / "text_encoder")
CLIPTextModel(CLIPTextConfig(hidden_size=8, projection_dim=8, **clip_kw)).save_pretrained(d / "text_encoder_2")
print("stubs in", CACHE)
