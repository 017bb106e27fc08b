"""The SGLang stand-in server for tests (``standin``, its model side in ``standin_model``).

It answers SGLang 0.5.23's JSON from an in-process target, so the SGLang backends run on a CPU. The package
never imports it: only tests and ``python -m specforge_opd.testing.standin`` (a test's ``sglang.launch_module``) do.
"""
