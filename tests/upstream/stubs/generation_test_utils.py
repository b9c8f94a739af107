"""Stand-in for transformers' tests/generation/test_utils.py, which the PyPI sdist does not ship.

tests/test_modeling_common.py imports GenerationTesterMixin from it at module level; the common model tests run
without it. Generation with the plugin on is checked by tests/upstream/sage_upstream_models.py instead."""


class GenerationTesterMixin:
    pass
