"""Stand-in for transformers' tests/exporters/test_export.py, which the PyPI sdist does not ship: ModelTesterMixin
derives from ExportTesterMixin (torch.export tests, not run here)."""


class ExportTesterMixin:
    pass
