"""Llama, Mistral and Qwen2 under transformers' own common model tests (ModelTesterMixin from the PyPI sdist's
tests/test_modeling_common.py), run by tools/run_upstream_tests.py.

The sdist does not ship tests/models/<model>/test_modeling_<model>.py nor tests/causal_lm_tester.py, so the
per-model glue is written here: a tiny config per model and the inputs the mixin asks for
(`prepare_config_and_inputs_for_common`). The tests themselves are upstream's, unchanged. The runner copies this
file to <sdist>/tests/models/sage_upstream/, where `...test_modeling_common` resolves as in upstream's layout.

Generation: upstream's GenerationTesterMixin (tests/generation/test_utils.py) is not in the sdist either; the
`Generation*` classes below check greedy and sampled generation, caches and padding against the same weights
under the implementation the model would otherwise use.
"""
import copy
import unittest

import torch
import transformers

from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

TASKS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _classes(prefix):
    return tuple(getattr(transformers, prefix + t) for t in TASKS if hasattr(transformers, prefix + t))


class TinyDecoderTester:
    def __init__(self, parent, config_class, batch_size=2, seq_length=7, **config_overrides):
        self.parent = parent
        self.config_class = config_class
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training = True
        self.vocab_size, self.hidden_size = 99, 32
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = 2, 4, 2
        self.intermediate_size = 37
        self.type_sequence_label_size, self.num_labels = 2, 3
        self.config_overrides = config_overrides

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act="gelu", max_position_embeddings=512,
            initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=self.num_labels,
            **self.config_overrides)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class _CommonTests(ModelTesterMixin):
    config_class = None
    config_overrides: dict = {}
    test_torch_exportable = False     # ExportTesterMixin is not in the sdist (stubbed)

    def setUp(self):
        self.model_tester = TinyDecoderTester(self, self.config_class, **self.config_overrides)

    def test_generation_tester_mixin_inheritance(self):
        self.skipTest("GenerationTesterMixin is not shipped in the sdist; see the Generation* classes")


class LlamaCommonTest(_CommonTests, unittest.TestCase):
    config_class = transformers.LlamaConfig
    all_model_classes = _classes("Llama")


class MistralCommonTest(_CommonTests, unittest.TestCase):
    config_class = transformers.MistralConfig
    config_overrides = {"sliding_window": 4}     # shorter than the inputs, so the window matters
    all_model_classes = _classes("Mistral")


class Qwen2CommonTest(_CommonTests, unittest.TestCase):
    config_class = transformers.Qwen2Config
    all_model_classes = _classes("Qwen2")


# ---- generation -------------------------------------------------------------------------------------------------

class _GenerationTests:
    config_class = None
    config_overrides: dict = {}
    model_class = None

    def _pair(self):
        """(model as the run builds it, twin with transformers' eager attention), same weights."""
        cfg = TinyDecoderTester(self, self.config_class, **self.config_overrides).get_config()
        torch.manual_seed(0)
        model = self.model_class(copy.deepcopy(cfg)).eval()
        twin = self.model_class._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
        twin.load_state_dict(model.state_dict())
        return model, twin

    def _inputs(self):
        torch.manual_seed(1)
        ids = torch.randint(3, 99, (2, 9))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0                          # left padding in the second row
        return ids, mask

    def test_greedy_matches_eager_with_left_padding(self):
        model, twin = self._pair()
        ids, mask = self._inputs()
        kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(model.generate(ids, **kw), twin.generate(ids, **kw), rtol=0, atol=0)

    def test_greedy_without_cache_equals_with_cache(self):
        model, _ = self._pair()
        ids, mask = self._inputs()
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(model.generate(ids, use_cache=True, **kw),
                                   model.generate(ids, use_cache=False, **kw), rtol=0, atol=0)

    def test_static_cache_greedy_matches_eager(self):
        model, twin = self._pair()
        ids, mask = self._inputs()
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
        torch.testing.assert_close(model.generate(ids, **kw), twin.generate(ids, **kw), rtol=0, atol=0)

    def test_sampling_with_seed_matches_eager(self):
        model, twin = self._pair()
        ids, mask = self._inputs()
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5, pad_token_id=0)
        torch.manual_seed(7)
        a = model.generate(ids, **kw)
        torch.manual_seed(7)
        b = twin.generate(ids, **kw)
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_forward_with_labels_and_shift_labels_matches_eager(self):
        model, twin = self._pair()
        ids, mask = self._inputs()
        labels = torch.randint(3, 99, ids.shape).masked_fill(mask == 0, -100)   # padded positions carry no loss
        kw = dict(attention_mask=mask, labels=labels, shift_labels=torch.roll(labels, -1, dims=1).masked_fill(mask == 0, -100))
        # eager and sdpa/sage differ in float rounding only; the loss must follow shift_labels, not crash
        torch.testing.assert_close(model(ids, **kw).loss, twin(ids, **kw).loss, rtol=1e-4, atol=1e-4)


class LlamaGenerationTest(_GenerationTests, unittest.TestCase):
    config_class = transformers.LlamaConfig
    model_class = transformers.LlamaForCausalLM


class MistralGenerationTest(_GenerationTests, unittest.TestCase):
    config_class = transformers.MistralConfig
    config_overrides = {"sliding_window": 4}
    model_class = transformers.MistralForCausalLM


class Qwen2GenerationTest(_GenerationTests, unittest.TestCase):
    config_class = transformers.Qwen2Config
    model_class = transformers.Qwen2ForCausalLM
