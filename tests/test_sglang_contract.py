"""Our SGLang integration against the released ``sglang==0.5.23`` wheel's own source.

The wheel is read as a zip (AST and text), never imported: it needs CUDA
packages. Every hook target the native plugin patches must exist with the
attributes the hook reads, every flag the launcher passes must exist, and the
behaviours the stand-in mimics (meta_info accumulation, early flushes, the
layer-id offset, the aux-capture refusal, spec_verify_ct omitted at zero steps)
must be what SGLang does. When SGLang moves, a test here fails and names what
moved.

The wheel comes from ``python -m specforge_opd.sglang.wheel`` (``make test`` runs
it first); CI (``SPECFORGE_OPD_CI=1``) fails without it, elsewhere these tests skip.
"""

from __future__ import annotations

import ast
import re
import zipfile
from functools import lru_cache
from typing import Optional

import pytest

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang import contract, launcher, native
from specforge_opd.sglang import wheel as sgl_wheel
from specforge_opd.testing import standin

SRT = "sglang/srt/"


@pytest.fixture(scope="module")
def src():
    try:
        path = sgl_wheel.local_wheel()
    except sgl_wheel.WheelError as e:
        pytest.fail(str(e))
    if path is None:
        if sgl_wheel.in_ci():
            pytest.fail(f"CI: the sglang {sgl_wheel.VERSION} wheel is not at {sgl_wheel.cache_path()}; `make test` fetches "
                        "it first (python -m specforge_opd.sglang.wheel), check that step's error")
        pytest.skip(f"the sglang {sgl_wheel.VERSION} wheel is not downloaded (python -m specforge_opd.sglang.wheel, or "
                    f"{sgl_wheel.WHEEL_ENV}=/path/to/{sgl_wheel.FILE}); CI runs these tests")
    return Source(zipfile.ZipFile(path))


class Source:
    """SGLang's modules inside the wheel, by dotted name."""

    def __init__(self, zf: zipfile.ZipFile):
        self.zf = zf
        self.names = set(zf.namelist())

    def path(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        return next((p for p in (base + ".py", base + "/__init__.py") if p in self.names), None)

    @lru_cache(maxsize=None)
    def text(self, module: str) -> str:
        p = self.path(module)
        assert p is not None, f"sglang {sgl_wheel.VERSION}: module {module} is not in the wheel"
        return self.zf.read(p).decode()

    @lru_cache(maxsize=None)
    def tree(self, module: str) -> ast.Module:
        return ast.parse(self.text(module))

    def cls(self, module: str, name: str) -> ast.ClassDef:
        for node in self.tree(module).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"sglang {sgl_wheel.VERSION}: {module} has no class {name}")

    def func(self, module: str, name: str, cls: Optional[str] = None) -> ast.FunctionDef:
        body = self.cls(module, cls).body if cls else self.tree(module).body
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        have = sorted(n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        where = f"{module}.{cls}" if cls else module
        raise AssertionError(f"sglang {sgl_wheel.VERSION}: {where} has no function {name} (it has: {', '.join(have)})")

    def func_src(self, module: str, name: str, cls: Optional[str] = None) -> str:
        return ast.get_source_segment(self.text(module), self.func(module, name, cls))

    def resolve(self, target: str):
        """A HookRegistry target ``pkg.module.Class.method``: (module, class, method) as they exist."""
        parts = target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            if self.path(module):
                rest = parts[i:]
                assert len(rest) == 2, f"{target}: expected module.Class.method, found module {module} and {rest}"
                return module, rest[0], rest[1]
        raise AssertionError(f"{target}: no module of this path in sglang {sgl_wheel.VERSION}")


def _fields(cls: ast.ClassDef) -> dict:
    """Annotated class-level fields -> their default's AST (None when there is none)."""
    return {n.target.id: n.value for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _self_attrs(cls: ast.ClassDef) -> set:
    """Attributes assigned on ``self`` anywhere in the class, plus its class-level fields."""
    out = set(_fields(cls))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _compact(s: str) -> str:
    return re.sub(r"\s+", "", s)


# ---------------------------------------------------------------------------
# the plugin's hook targets and what the hooks read


def test_hook_targets_exist_with_the_signatures_we_wrap(src):
    sig = {"verify_step": ["self", "batch"], "request_level": ["self", "key"]}
    for name, target in native.HOOK_TARGETS.items():
        module, cls, meth = src.resolve(target)
        f = src.func(module, meth, cls)
        args = [a.arg for a in f.args.args]
        assert args[: len(sig[name])] == sig[name], f"{target}: parameters {args}, the hook expects {sig[name]} first"
    # DFLASH runs only this worker, overlap or not (no other verify path to hook)
    spec = src.func_src("sglang.srt.speculative.spec_info", "create_worker", "SpeculativeAlgorithm")
    assert "from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2" in spec and "return DFlashWorkerV2" in spec
    # the class the old plugin hooked has no verify method in 0.5.23
    methods = {n.name for n in src.cls("sglang.srt.speculative.dflash_info", "DFlashVerifyInput").body if isinstance(n, ast.FunctionDef)}
    assert "verify" not in methods


def test_the_worker_holds_what_the_verify_hook_reads(src):
    m = "sglang.srt.speculative.dflash_worker_v2"
    worker = src.cls(m, "DFlashWorkerV2")
    attrs = _self_attrs(worker)
    for a in ("block_size", "_draft_block_tokens_buf"):
        assert a in attrs, f"DFlashWorkerV2 no longer sets self.{a}"
    body = _compact(src.func_src(m, "forward_batch_generation", "DFlashWorkerV2"))
    expect = {
        "prefill and mixed batches take the extend path": "ifbatch.forward_mode.is_extend()orbatch.is_extend_in_batch:",
        "idle batches return early": "ifbatch.forward_mode.is_idle():",
        "the anchor is the committed length before the step": "prefix_lens=batch.seq_lens",
        "the drafted block lives in the buffer": "draft_tokens=self._draft_block_tokens_buf[:bs]",
        "slot 0 of the block is the previous bonus token": "draft_tokens[:,0].copy_(block_ids[:,0])",
        "the drafts fill slots 1..bs-1": "draft_tokens[:,1:].copy_(draft_next)",
        "the result carries the commit lengths": "accept_lens=commit_lens",
        "the result carries the verify logits": "logits_output=logits_output",
        "the vocabulary size the hook slices to": "self.model_runner.model_config.vocab_size",
    }
    for why, text in expect.items():
        assert text in body, f"DFlashWorkerV2.forward_batch_generation: {why} (`{text}`) is gone"
    # commit lengths are accepted + 1 (the hook reports accept_lens - 1)
    assert "accept_len.to(torch.int32)+1" in _compact(src.func_src(m, "_commit_accept"))
    utils = src.cls("sglang.srt.managers.utils", "GenerationBatchResult")
    assert {"logits_output", "accept_lens"} <= set(_fields(utils))
    lpo = src.cls("sglang.srt.layers.logits_processor", "LogitsProcessorOutput")
    assert {"next_token_logits", "customized_info"} <= set(_fields(lpo))
    sb = _fields(src.cls("sglang.srt.managers.schedule_batch", "ScheduleBatch"))
    for a in ("seq_lens", "forward_mode", "is_extend_in_batch", "return_logprob", "has_grammar", "sampling_info"):
        assert a in sb, f"ScheduleBatch has no field {a}"
    fm = {n.name for n in src.cls("sglang.srt.model_executor.forward_batch_info", "ForwardMode").body if isinstance(n, ast.FunctionDef)}
    assert {"is_extend", "is_idle"} <= fm


def test_verify_logits_hazards_are_the_ones_we_handle(src):
    m = "sglang.srt.speculative.dflash_worker_v2"
    body = _compact(src.func_src(m, "forward_batch_generation", "DFlashWorkerV2"))
    # adjustments edit the logits the result carries, in place, before acceptance
    i_adj = body.index("apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits")
    i_grammar = body.index("grammar_mask.apply(logits_output.next_token_logits)")
    i_accept = body.index("self._accept_block(")
    assert i_adj < i_accept and i_grammar < i_accept
    # the logits may be dropped only on the deferred-shard path, else gathered over the vocabulary
    assert "ifself._can_skip_verify_logits(batch,sampling_info):" in body
    assert "logits_output.next_token_logits=None" in body
    assert "logits_output.next_token_logits=target_lp.finish_deferred_gather(" in body
    # return_logprob (which native_request sets) keeps them
    skip = src.func(m, "_can_skip_verify_logits", "DFlashWorkerV2")
    first_if = next(n for n in skip.body if isinstance(n, ast.If))
    assert "batch.return_logprob" in ast.unparse(first_if.test) and isinstance(first_if.body[0], ast.Return) \
        and getattr(first_if.body[0].value, "value", None) is False, "_can_skip_verify_logits no longer returns False on return_logprob"
    # every sampling_info attribute the adjustment reads is one native.logits_adjusted checks
    adj = src.func("sglang.srt.speculative.dflash_utils", "apply_dflash_verify_logits_adjustments")
    read = set()
    for n in ast.walk(adj):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "sampling_info":
            read.add(n.attr)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) >= 2 \
                and getattr(n.args[0], "id", None) == "sampling_info" and isinstance(n.args[1], ast.Constant):
            read.add(n.args[1].value)
    ours = {"has_custom_logit_processor", "acc_linear_penalties", "penalizer_orchestrator", "logit_bias", "grammar_mask"}
    helpers = {"apply_logits_bias"}
    assert read - ours - helpers == set(), f"apply_dflash_verify_logits_adjustments now also reads {read - ours - helpers}"
    assert "temperature" not in ast.unparse(adj), "the verify logits are now temperature-scaled in place"
    # the sampling parameters native_request refuses exist, with the defaults we compare against
    sp = _fields(src.cls("sglang.srt.sampling.sampling_params", "SamplingParams"))
    for k, default in contract.LOGIT_EDITING_SAMPLING_PARAMS.items():
        assert k in sp, f"SamplingParams has no {k}"
        assert ast.literal_eval(sp[k]) == default, f"SamplingParams.{k} defaults to {ast.unparse(sp[k])}, not {default!r}"


def test_plugin_loading_and_its_failure_messages(src):
    p = src.text("sglang.srt.plugins")
    assert f'GENERAL_PLUGINS_GROUP = "{launcher.PLUGIN_GROUP}"' in p and "SGLANG_PLUGINS" in p
    assert "discovered = entry_points(group=group)" in p  # what launcher.check_plugin_installed probes
    hr = src.text("sglang.srt.plugins.hook_registry")
    assert 'AROUND = "around"' in hr
    reg = src.func("sglang.srt.plugins.hook_registry", "register", "HookRegistry")
    assert [a.arg for a in reg.args.args][:4] == ["cls", "target", "hook", "hook_type"]
    logged = " ".join([hr, p])
    for marker in launcher.PLUGIN_FAILURE_MARKERS:
        prefix = re.sub(r" (specforge_opd_native|sglang\.srt\..*)$", "", marker)
        assert prefix in logged.replace(" %s", ""), f"SGLang no longer logs `{prefix}`: launcher.check_plugin_log would miss it"
    # only logged: a failed hook does not stop the server (why the launcher scans the log)
    apply = src.func_src("sglang.srt.plugins.hook_registry", "apply_hooks", "HookRegistry")
    assert "except Exception:" in apply and "logger.exception" in apply
    assert "load_plugins()" in src.text("sglang.srt.managers.scheduler")


# ---------------------------------------------------------------------------
# what the stand-in mimics


def test_customized_info_reaches_the_top_level_of_meta_info(src):
    acc = src.func("sglang.srt.managers.tokenizer_manager", "_accumulate_request_meta_info", "TokenizerManager")
    code = _compact(ast.get_source_segment(src.text("sglang.srt.managers.tokenizer_manager"), acc))
    assert "accumulated.extend(values)" in code and "meta_info[key]=accumulated" in code
    # per request, one value per processed step
    collect = _compact(src.func_src("sglang.srt.managers.scheduler_components.batch_result_processor",
                                    "_maybe_collect_customized_info", "SchedulerBatchResultProcessor"))
    assert "fork,vinlogits_output.customized_info.items():" in collect
    assert "elem=v[i]" in collect and "req.customized_info[k].append(elem)" in collect
    # overlap scheduling: a finished or retracted request's extra step is skipped before collection
    decode = _compact(src.func_src("sglang.srt.managers.scheduler_components.batch_result_processor",
                                   "process_batch_result_decode", "SchedulerBatchResultProcessor"))
    assert "(req.finished()orreq.is_retracted)" in decode and decode.index("continue") < decode.index("_handle_finish_state_updated_req")


def test_early_flush_and_slicing_as_the_standin_does(src):
    m = "sglang.srt.managers.scheduler_components.output_streamer"
    acc = _compact(src.func_src(m, "accept", "_GenerationStreamAccumulator"))
    assert "len(req.output_ids)%self.default_force_stream_interval==0" in acc
    assert "values=req_values[send_token_offset:len(output_ids_)]" in acc
    # request-level keys: sent whole, and for a non-streaming request only at its finish
    assert "elifnotreq.finished():continue" in acc and "elifis_request_level:values=req_values" in acc
    assert "is_request_level_customized_info_key=(self.is_request_level_customized_info_key)" in _compact(src.text(m))
    val = next(n.value for n in ast.walk(src.tree("sglang.srt.environ")) if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "SGLANG_FORCE_STREAM_INTERVAL" for t in n.targets))
    assert ast.literal_eval(val.args[0]) == standin.DEFAULT_FORCE_STREAM_INTERVAL
    assert "DEFAULT_FORCE_STREAM_INTERVAL = envs.SGLANG_FORCE_STREAM_INTERVAL.get()" in src.text(m)


def test_spec_verify_ct_omitted_at_zero_steps_and_retraction_count_reported(src):
    tm = src.text("sglang.srt.managers.tokenizer_manager")
    c = _compact(tm)
    i_guard = c.index("recv_obj.spec_verify_ct[i]>0")
    i_set = c.index('meta_info["spec_verify_ct"]=recv_obj.spec_verify_ct[i]')
    assert i_guard < i_set
    assert '"num_retractions":recv_obj.retraction_counts[i]' in c
    for key in ("cached_tokens", "input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "hidden_states", "finish_reason"):
        assert f'"{key}"' in tm, f"meta_info.{key} is no longer built by the tokenizer manager"
    # a retraction keeps output_ids, the collected values and the step count; the re-prefill then emits a token
    retract = src.func_src("sglang.srt.managers.schedule_batch", "reset_for_retract", "Req")
    assert "customized_info" not in retract and "spec_verify_ct" not in retract
    assert "if self.input_embeds is not None:" in retract  # output_ids dropped only for input_embeds requests
    # DFLASH reserves two blocks ahead per decoding request (native.request_tokens)
    assert "reserve = 2 * block_size" in src.text("sglang.srt.speculative.dflash_info_v2")


def test_hidden_states_of_middle_prefill_chunks_are_dropped_as_the_standin_does(src):
    """A request's prefill hidden states are stored only when its output commits, which a middle chunk's does not
    (``inflight_middle_chunks > 0``): the stand-in's ``chunked_prefill_size`` returns the last chunk's rows only."""
    m = "sglang.srt.managers.scheduler_components.batch_result_processor"
    pre = _compact(src.func_src(m, "process_batch_result_prefill", "SchedulerBatchResultProcessor"))
    assert "should_commit_output=(notreq.finished()andnotreq.is_retractedandreq.inflight_middle_chunks<=0)" in pre
    assert "store=(should_commit_outputanddiscard_finish_reasonisNone)," in pre
    assert "self.chunked_req.inflight_middle_chunks+=1" in _compact(src.text("sglang.srt.managers.scheduler"))


def test_layer_ids_get_the_plus_one_in_sglangs_models(src):
    for module, cls in (("sglang.srt.models.qwen3", "Qwen3ForCausalLM"), ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
                        ("sglang.srt.models.llama", "LlamaForCausalLM")):
        f = src.func(module, "set_dflash_layers_to_capture", cls)
        comps = [n for n in ast.walk(f) if isinstance(n, ast.ListComp)]
        offsets = [n.elt.right.value for n in comps if isinstance(n.elt, ast.BinOp) and isinstance(n.elt.op, ast.Add)
                   and isinstance(n.elt.right, ast.Constant)]
        assert offsets == [contract.SGLANG_CAPTURE_OFFSET], f"{cls}.set_dflash_layers_to_capture adds {offsets}, the stand-in adds {contract.SGLANG_CAPTURE_OFFSET}"
    # captured inside the layer loop: the concatenation is in ascending layer order (server_layer_ids sorts)
    for module in ("sglang.srt.models.qwen3", "sglang.srt.models.llama"):
        c = _compact(src.text(module))
        assert "foriinrange(self.start_layer,self.end_layer):" in c and \
            "capture_output=aux_hidden_states.captureifiinself.layers_to_captureelseNone" in c, f"{module}: capture moved"
    moe = _compact(src.text("sglang.srt.models.qwen2_moe"))  # Qwen3MoeModel's forward
    assert "captured_last_layer_outputs=aux_hidden_statesifgetattr(layer,\"_is_layer_to_capture\",False)" in moe
    assert "classQwen3MoeModel(Qwen2MoeModel):" in _compact(src.text("sglang.srt.models.qwen3_moe"))
    # capture-only mode hands the ids to the DFLASH convention unchanged
    aux = src.text("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state")
    assert "config.dflash_target_layer_ids = list(layer_ids)" in aux


def test_aux_capture_refusals_as_the_standin_does(src):
    m = "sglang.srt.arg_groups.validation_hook"
    f = src.func_src(m, "handle_aux_hidden_state_capture")
    methods = next(n.value for n in src.tree(m).body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "_AUX_HIDDEN_STATE_CAPTURE_METHODS" for t in n.targets))
    assert tuple(ast.literal_eval(methods)) == standin.AUX_CAPTURE_ALGORITHMS
    assert "needs --speculative-algorithm EAGLE3, DFLASH or DSPARK" in _join_strings(f)
    assert "drop --speculative-draft-model-path" in _join_strings(f)
    assert "must not repeat a layer" in _join_strings(f)
    assert "speculative_algorithm=None" in _compact(f), "aux capture no longer resets the algorithm: verify mode would load a draft"
    # the stand-in refuses with 0.5.23's own messages (tests match on them)
    import argparse

    def refusal(**kw):
        base = dict(enable_return_aux_hidden_states=True, return_aux_hidden_state_layer_ids=[0, 2],
                    speculative_algorithm="DFLASH", speculative_draft_model_path=None)
        base.update(kw)
        with pytest.raises(ValueError) as e:
            standin.check_flags(argparse.Namespace(**base))
        return str(e.value)

    sglang_text = _join_strings(f)
    for kw in (dict(speculative_algorithm=None), dict(speculative_draft_model_path="/d"), dict(return_aux_hidden_state_layer_ids=None),
               dict(return_aux_hidden_state_layer_ids=[], speculative_algorithm="EAGLE3"),
               dict(return_aux_hidden_state_layer_ids=[-1]), dict(return_aux_hidden_state_layer_ids=[1, 1]),
               dict(enable_return_aux_hidden_states=False)):
        msg = refusal(**kw).split(", got ")[0].replace("with DFLASH requires", "with {method} requires")
        assert msg in sglang_text, f"the stand-in refuses {kw} with `{msg}`, which 0.5.23 does not say"
    # DFLASH without aux capture is a drafting server and needs its draft (speculative_hook._handle_dflash)
    msg = refusal(enable_return_aux_hidden_states=False, return_aux_hidden_state_layer_ids=None)
    assert msg in _join_strings(src.func_src("sglang.srt.arg_groups.speculative_hook", "_handle_dflash"))


def _join_strings(code: str) -> str:
    """Adjacent string literals joined (SGLang splits its messages over lines)."""
    return re.sub(r'"\s*\n\s*(f?)"', "", code)


# ---------------------------------------------------------------------------
# the flags, request fields and endpoints we use


def _cli_flags(src) -> set:
    flags = set()
    for name in sorted(src.names):
        if not name.startswith(SRT + "arg_groups/fields/") or not name.endswith(".py"):
            continue
        tree = ast.parse(src.zf.read(name).decode())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                kw = {}
                for call in ast.walk(node.annotation):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Arg":
                        kw = {k.arg: k.value for k in call.keywords}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    continue
                flags.add(ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else "--" + node.target.id.replace("_", "-"))
                if "aliases" in kw:
                    flags.update(ast.literal_eval(kw["aliases"]))
    return flags


def test_every_flag_the_launcher_passes_exists(src):
    flags = _cli_flags(src)
    assert len(flags) > 100, "the flag parser found almost nothing: arg_groups/fields moved"
    cfg = SGLangConfig(max_total_tokens=4096, mem_fraction_static=0.7)
    passed = set()
    for mode, kw in (("verify", dict(target_layer_ids=[1, 5])), ("native", dict(draft_path="/d", block_size=16)), ("plain", {})):
        args = launcher.server_args(cfg, model_path="/m", port=1, mode=mode, dtype="bfloat16", **kw)
        passed.update(a for a in args if a.startswith("--"))
    missing = sorted(passed - flags)
    assert not missing, f"sglang {sgl_wheel.VERSION} has no flag {missing}"
    assert "DFLASH" in ast.unparse(_fields(src.cls("sglang.srt.arg_groups.fields.spec", "Spec"))["speculative_algorithm"]) \
        or "DFLASH" in src.text("sglang.srt.arg_groups.fields.spec")


def test_request_fields_and_endpoints_exist(src):
    gen = set(_fields(src.cls("sglang.srt.managers.io_struct", "GenerateReqInput")))
    sent = set()
    for body in (contract.prefill_request([1, 2], want_hidden=True), contract.verify_request([1, 2], [3], top_k=2, want_hidden=True),
                 contract.native_request([1], max_new_tokens=2, temperature=0.0, stop_token_ids=[1])):
        sent.update(body)
    assert sent - gen == set(), f"GenerateReqInput has no field {sorted(sent - gen)}"
    sp = set(_fields(src.cls("sglang.srt.sampling.sampling_params", "SamplingParams")))
    used = {"max_new_tokens", "temperature", "stop_token_ids", "sampling_seed"}
    assert used - sp == set(), f"SamplingParams has no field {sorted(used - sp)}"
    # logprob_start_len -1 is SGLang's own default (output log-probs only)
    assert "self.logprob_start_len = -1" in src.text("sglang.srt.managers.io_struct")
    http = src.text("sglang.srt.entrypoints.http_server")
    for route in ("/generate", "/health", "/server_info", "/get_server_info", "/release_memory_occupation"):
        assert f'"{route}"' in http, f"no route {route}"
    assert '"version": __version__' in http
    assert '"max_total_num_tokens": self.max_total_num_tokens' in src.text("sglang.srt.managers.scheduler")
    # the running-request limit contract.parse_running_slots reads (native in-flight bound), and DFLASH's default
    assert '"internal_states": internal_states' in http and "**build_server_info(server_args" in http
    assert 'state["effective_max_running_requests_per_dp"] = scheduler.max_running_requests' in \
        src.text("sglang.srt.managers.scheduler_components.internal_state")
    dflash = _compact(src.func_src("sglang.srt.arg_groups.speculative_hook", "_handle_dflash"))
    assert "ifcfg.max_running_requestsisNone:" in dflash and "max_running_requests=48" in dflash
    assert "result=server_args.resolved_dict()" in _compact(src.func_src("sglang.srt.utils.common", "build_server_info"))


def test_the_wheel_is_the_version_the_contract_names(src):
    meta = next(n for n in src.names if n.endswith(".dist-info/METADATA"))
    assert f"Version: {contract.MIN_SGLANG_VERSION}" in src.zf.read(meta).decode()


def test_our_install_requirements_admit_sglangs_own_pins(src):
    """The plugin goes into SGLang's environment: our setup.py must not fight the wheel's pinned torch and
    transformers (pip would downgrade SGLang's), whatever `pip install --no-deps` avoids anyway."""
    import pathlib

    from packaging.requirements import Requirement

    meta_name = next(n for n in src.names if n.endswith(".dist-info/METADATA"))
    theirs = {}
    for line in src.zf.read(meta_name).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None and r.name in ("torch", "transformers"):
                theirs[r.name] = r
    assert set(theirs) == {"torch", "transformers"}, f"sglang {sgl_wheel.VERSION} no longer pins {theirs}"
    setup_py = (pathlib.Path(__file__).resolve().parents[1] / "setup.py").read_text()
    ours = {Requirement(m).name: Requirement(m) for m in re.findall(r'"((?:torch|transformers)[^"]*)"', setup_py)}
    for name, r in theirs.items():
        pinned = [s.version for s in r.specifier if s.operator == "=="]
        assert pinned, f"sglang pins {r}"
        assert ours[name].specifier.contains(pinned[0]), f"setup.py {ours[name]} refuses sglang's {r}"


# ---------------------------------------------------------------------------
# at the paper's scale: stop sets, seeds, refused flags, memory (tests/test_sglang_scale.py holds our side)


def test_sglang_stops_on_config_and_generation_config_eos_as_our_stop_set_does(src):
    """0.5.23 stops on ``config.json`` eos | ``generation_config.json`` eos besides the request's ids: our set is built alike."""
    from types import SimpleNamespace

    from specforge_opd.models.target import stop_token_ids

    f = _compact(src.func_src("sglang.srt.configs.model_config", "_get_hf_eos_token_id", "ModelConfig"))
    assert 'getattr(self.hf_config,"eos_token_id",None)' in f and 'getattr(self.hf_generation_config,"eos_token_id",None)' in f
    assert "eos_ids=eos_ids|generation_eos_ids" in f
    finish = _compact(src.func_src("sglang.srt.managers.schedule_batch", "_check_token_based_finish", "Req"))
    assert "ifself.sampling_params.ignore_eos:returnFalse" in finish
    assert "matched_eos|=token_idinself.sampling_params.stop_token_ids" in finish
    assert "matched_eos|=token_idinself.eos_token_ids" in finish, "SGLang no longer stops on the model's eos ids"
    assert "eos_token_ids=self.model_config.hf_eos_token_id" in _compact(src.text("sglang.srt.managers.scheduler"))

    # replay SGLang's rule on Qwen3's files: the request's stop ids (ours) | the model's eos = ours
    config, gen = SimpleNamespace(eos_token_id=151645), SimpleNamespace(eos_token_id=[151645, 151643])
    tok = SimpleNamespace(eos_token_id=151645, unk_token_id=None, convert_tokens_to_ids=lambda t: 151645)
    ours = set(stop_token_ids(tok, config, [], gen))
    sglang = {config.eos_token_id} | set(gen.eos_token_id)
    assert ours | sglang == ours


def test_seeds_reach_sampling_only_in_deterministic_mode_and_never_dflash_acceptance(src):
    sb = _compact(src.func_src("sglang.srt.sampling.sampling_batch_info", "from_schedule_batch", "SamplingBatchInfo"))
    assert "enable_deterministic=get_exec().deterministic.enable_deterministic_inference" in sb
    assert "ifenable_deterministicelseNone" in sb, "sampling_seed is no longer gated by --enable-deterministic-inference"
    worker = _compact(src.text("sglang.srt.speculative.dflash_worker_v2"))
    call = worker[worker.index("accept_len,bonus=compute_dflash_sampling_correct_drafts_and_bonus("):]
    call = call[: call.index(")")]
    assert "uniform_samples" not in call and "seed" not in call, "DFLASH's sampling verify now takes coins: revisit NOT_REPRODUCIBLE"
    coins = _compact(src.func_src("sglang.srt.speculative.dflash_utils", "compute_dflash_sampling_correct_drafts_and_bonus"))
    assert "ifuniform_samplesisNone:coins=torch.rand(" in coins
    assert "enable_deterministic_inference" in set(_fields(src.cls("sglang.srt.arg_groups.fields.exec_", "ExecDeterministic")))


def test_the_flags_we_refuse_exist_and_mixed_chunks_stay_on_with_dflash(src):
    flags = _cli_flags(src)
    missing = sorted(f for f in launcher.REFUSED_FLAGS if f not in flags and f != "--enable-dp-attention")
    assert not missing, f"sglang {sgl_wheel.VERSION} has no flag {missing}: launcher.REFUSED_FLAGS is stale"
    assert '"--enable-dp-attention"' in src.text("sglang.srt.server_args")  # deprecated spelling, registered by hand
    # SGLang itself keeps mixed chunks with DFLASH: only our refusal protects the anchor recurrence
    mixed = _compact(src.func_src("sglang.srt.speculative.spec_info", "supports_mixed_chunk", "SpeculativeAlgorithm"))
    assert "SpeculativeAlgorithm.DFLASH" in mixed
    # /server_info carries the resolved fields check_server_flags and HTTPClient.check_seed read
    assert "resolved[\"enable_dp_attention\"]=resolving_view(self).attn_dp_size>1" in _compact(
        src.func_src("sglang.srt.server_args", "resolved_dict", "ServerArgs"))
    sched = set(_fields(src.cls("sglang.srt.arg_groups.fields.schedule", "Schedule")))
    assert "enable_mixed_chunk" in sched


def test_the_kv_pool_leaves_one_minus_the_fraction_of_the_memory_free_at_start(src):
    """``sizing.mem_fraction_for`` solves 0.5.23's rule: pool = free after loading - (1 - f) x free before loading."""
    f = _compact(src.func_src("sglang.srt.mem_cache.kv_cache_configurator", "_profile_available_bytes", "KVCacheConfigurator"))
    assert "slack_gb=pre_model_load_memory*(1-get_schedule().mem_fraction_static)" in f
    assert "rest_memory=available_gpu_memory-slack_gb-mm_reservation_gb" in f
    hs = src.text("sglang.srt.managers.scheduler_components.batch_result_processor")
    # verify-mode prefills: every row goes to a Python list (hence verify_max_feature_floats)
    assert "req.hidden_states.append(req_hidden_states.cpu().clone().tolist())" in hs


def test_the_standins_answers_are_0_5_23s(src):
    """Entry 0 of the input log-probs, the hidden-state refusal, the layer range, queue-full 503, the model eos stop."""
    from specforge_opd.testing import standin_model

    lp = _compact(src.text("sglang.srt.managers.scheduler_components.logprob_result_processor"))
    assert "req.logprob.input_token_logprobs_val=[None]+input_token_logprobs[:-1]" in lp
    assert "ifreq.logprob.top_logprobs_num<=0:return" in lp and "req.logprob.input_top_logprobs_val=[]ifuses_scoring_positionselse[None]" in lp
    assert "iftop_logprobs_num>0:" in _compact(src.text("sglang.srt.managers.tokenizer_manager"))
    tm = _join_strings(src.text("sglang.srt.managers.tokenizer_manager"))
    assert _compact(standin_model.NO_HIDDEN_STATES) in _compact(tm.replace('"\n', '"'))
    # aux capture alone resolves the hidden-state mode to full (the stand-in lets aux servers return them)
    hs = _compact(src.func_src("sglang.srt.arg_groups.serving_hook", "handle_return_hidden_states_mode"))
    assert "ifcfg.enable_return_hidden_statesorcfg.enable_return_aux_hidden_states:" in hs
    rng = _join_strings(src.func_src("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
                                     "_check_capture_layer_ids_in_range"))
    assert "out of range for a " in rng and "target with {num_layers} layers." in rng
    with pytest.raises(ValueError) as e:
        standin.check_layer_range([7], 4)
    assert str(e.value).replace("[7]", "{out_of_range}").replace(" 4 ", " {num_layers} ") in rng.replace('"\n', "").replace('f"', "")
    sched = src.text("sglang.srt.managers.scheduler")
    assert 'message = "The request queue is full."' in sched and '"status_code": HTTPStatus.SERVICE_UNAVAILABLE' in sched
