"""Runs inside the light SGLang environment (``light.run_probe``): SGLang's own code on our flags and our plugin.

Reads a JSON request on stdin, prints one JSON line:

* ``modes``: for each ``{mode: argv}``, the fields SGLang's ``prepare_server_args``
  parsed, then those its model-independent resolution handlers resolved in the
  pipeline's order (the hidden-state mode, aux capture; DFLASH's defaults for a
  draft server, with the device taken as CUDA);
* ``refused``: for each flag of ``launcher.REFUSED_FLAGS``, the field SGLang's parser
  gives it (``--tp`` included: argparse takes prefixes);
* ``plugins``: SGLang's ``load_plugins()`` run on our entry point: what it
  registered in ``HookRegistry``, the log lines, and the apply failures; then the
  registry's own wrapping of our AROUND hook on a look-alike method.

Not for use outside that subprocess: it installs import stubs (``light.STUBBED``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import logging
import sys
import tempfile
import types
from pathlib import Path

from specforge_opd.sglang.light import STUBBED

FIELDS = ("speculative_algorithm", "aux_hidden_state_capture", "enable_return_aux_hidden_states",
          "return_aux_hidden_state_layer_ids", "enable_return_hidden_states", "return_hidden_states_mode",
          "speculative_draft_model_path", "speculative_num_draft_tokens", "disable_overlap_schedule", "skip_tokenizer_init",
          "max_total_tokens", "mem_fraction_static", "host", "port", "dtype", "max_running_requests", "model_path",
          "enable_mixed_chunk", "tp_size", "attn_dp_size")


class _Anything(types.ModuleType):
    """A stub module: every attribute is a callable placeholder (decorators return what they decorate)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Placeholder:
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, k):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Anything(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _fields(view) -> dict:
    out = {}
    for f in FIELDS:
        try:
            v = getattr(view, f)
        except Exception:
            continue
        out[f] = v if isinstance(v, (str, int, float, bool, list, type(None))) else str(v)
    return out


def _modes(request: dict) -> dict:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.arg_groups.serving_hook import handle_return_hidden_states_mode
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash
    from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture
    from sglang.srt.server_args import prepare_server_args

    out = {}
    for mode, argv in request["modes"].items():
        sa = prepare_server_args(list(argv))
        parsed = _fields(sa)
        if mode == "native":
            sa.device = "cuda"  # a GPU server's device; this machine has none
        sa._input_frozen = True
        errors = []
        for handler in (handle_return_hidden_states_mode, handle_aux_hidden_state_capture):
            run_hook(handler, sa)
        view = resolving_view(sa)
        if view.speculative_algorithm == "DFLASH":
            try:
                run_hook(_handle_dflash, sa)
            except Exception as e:  # reported, not raised: the test names what SGLang refused
                errors.append(f"{type(e).__name__}: {e}")
        out[mode] = {"parsed": parsed, "resolved": _fields(resolving_view(sa)), "errors": errors}
    return out


def _refused(request: dict) -> dict:
    import argparse

    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    dest = {}
    for flag in request["refused"]:
        try:
            ns = p.parse_known_args(["--model-path", "m", flag, "2"])[0]
            hit = [a.dest for a in p._actions if flag in a.option_strings]
            dest[flag] = hit[0] if hit else None
            if flag == "--tp":
                dest[flag] = "tp_size" if ns.tp_size == 2 else None
        except SystemExit:
            dest[flag] = None
    return dest


def _plugins() -> dict:
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage() + (f" [{record.exc_info[1]!r}]" if record.exc_info else ""))

    logging.getLogger("sglang").addHandler(_Keep())
    logging.getLogger("sglang").setLevel(logging.INFO)
    # our entry point, as `pip install --no-deps -e .` registers it in SGLang's environment
    d = Path(tempfile.mkdtemp()) / "specforge_opd_probe-0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: specforge-opd-probe\nVersion: 0\n")
    (d / "entry_points.txt").write_text("[sglang.srt.plugins]\nspecforge_opd_native = specforge_opd.sglang.native:register\n")
    sys.path.insert(0, str(d.parent))
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugins.load_plugins()
    registered = {t: [(ht.value, getattr(h, "__qualname__", repr(h)), getattr(src, "plugin_name", None)) for ht, h, src in hooks]
                  for t, hooks in HookRegistry._hooks.items()}
    patched = sorted(HookRegistry._patched)
    # why a target was not patched: its module's own import error (the registry reports only the attribute missing)
    import_errors = {}
    for t in registered:
        if t not in patched:
            try:
                importlib.import_module(t.rsplit(".", 2)[0])
            except Exception as e:
                import_errors[t] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    # the registry's own wrapping of our AROUND hook, on a look-alike of the worker method
    # (lazy: native may load only after the ``light.STUBBED`` import stubs are installed)
    from specforge_opd.sglang.native import HOOK_TARGETS

    mod = types.ModuleType("specforge_light_probe_target")

    import torch

    class DFlashWorkerV2:
        block_size = 4
        _draft_block_tokens_buf = torch.tensor([[7, 3, 5, 9]])
        model_runner = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=11))

        def forward_batch_generation(self, batch, **kw):
            if batch.forward_mode.is_extend():
                return ("original", batch, kw)
            lo = types.SimpleNamespace(next_token_logits=torch.zeros(4, 11), customized_info=None)
            return types.SimpleNamespace(logits_output=lo, accept_lens=torch.tensor([3]))

    mod.DFlashWorkerV2 = DFlashWorkerV2
    sys.modules[mod.__name__] = mod
    ours = HookRegistry._hooks[HOOK_TARGETS["verify_step"]]
    HookRegistry._apply_target(f"{mod.__name__}.DFlashWorkerV2.forward_batch_generation", ours)

    def batch(extend: bool):
        mode = types.SimpleNamespace(is_extend=lambda: extend, is_idle=lambda: False, is_decode=lambda: not extend)
        return types.SimpleNamespace(forward_mode=mode, seq_lens=torch.tensor([10]), sampling_info=None)

    prefill = batch(True)
    passed = DFlashWorkerV2().forward_batch_generation(prefill, flag=1) == ("original", prefill, {"flag": 1})
    step = DFlashWorkerV2().forward_batch_generation(batch(False)).logits_output.customized_info
    return {"registered": registered, "patched": patched, "import_errors": import_errors, "log": records,
            "wrapped_passes_extend_through": passed,
            "wrapped_verify_step": step}


def main() -> int:
    sys.meta_path.append(_StubFinder())
    request = json.loads(sys.stdin.read())
    out = {"modes": _modes(request), "refused": _refused(request), "plugins": _plugins()}
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
