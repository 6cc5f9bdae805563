"""Structured output (engine/constraints.py) on the default model: every output checked by an
independent judge (the ``jsonschema`` package, Python's ``re``), under a tight pool that preempts,
with prefix caching and chunked prefill on, with n > 1 forks and logprobs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tinyllm_cli import LLM, SamplingParams
from tinyllm_cli import params
from tinyllm_cli.engine import constraints
from tinyllm_cli.engine.request import Request

from test_cli import cli, jsonl

# Eight schemas (objects, enums, arrays, nesting, an optional field, a pattern, a nullable type,
# const), shared with scripts/structured_bench.py.
SCHEMAS = [json.loads(line) for line in (Path(__file__).parent / "data" / "schemas.jsonl").read_text().splitlines()]
SHARED = "You are a data extraction tool. Answer with one JSON object only, nothing else. " * 3


@pytest.fixture(scope="module")
def llm():
    # A tight pool (preemption) with prefix caching and a small prefill budget (chunked prefill).
    with LLM(num_blocks=40, block_size=16, max_num_seqs=16, max_prefill_tokens=256, prefix_cache=True,
             progress=False) as llm:
        yield llm


def test_64_requests_8_schemas_all_validate(llm):
    prompts, params = [], []
    for i in range(64):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(f"{SHARED}Record {i}: describe item number {i}.")
        params.append(SamplingParams(max_new_tokens=96, json_schema=schema))
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = llm.stats
    for o, p in zip(outs, params):
        assert o.finish_reason == "stop", (o.finish_reason, o.error, o.text)
        jsonschema.validate(json.loads(o.text), p.json_schema)
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0, s
    assert s["constrained_tokens"] > 0 and s["grammar_cache_hits"] >= 64 - len(SCHEMAS)


def test_regex_choice_grammar_object_forks_and_logprobs(llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    gbnf = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    ps = [SamplingParams(max_new_tokens=24, regex=regex),
          SamplingParams(max_new_tokens=8, choice=["positive", "negative", "neutral"]),
          SamplingParams(max_new_tokens=24, grammar=gbnf),
          SamplingParams(max_new_tokens=64, json_object=True),
          SamplingParams(max_new_tokens=40, json_schema=SCHEMAS[0], n=3, temperature=1.0, seed=5),
          SamplingParams(max_new_tokens=24, regex=regex, logprobs=2)]
    prompts = ["Name a city and a number.", "Sentiment of: I love it!", "Write an arithmetic expression.",
               'Reply with the JSON object {"ok": true} and nothing else.', "A person as JSON:",
               "Name a city and a number."]
    outs = llm.generate(prompts, ps, use_tqdm=False)
    # Any JSON object is unbounded: it ends complete, or is marked unfinished (never claimed valid).
    if outs[3].finish_reason == "constraint_unfinished":
        assert len(outs[3].token_ids) == 64
        with pytest.raises(json.JSONDecodeError):
            json.loads(outs[3].text)
    else:
        assert isinstance(json.loads(outs[3].text), dict)
    outs = outs[:3] + outs[4:]
    assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.text) for o in outs]
    assert re.fullmatch(regex, outs[0].text) and re.fullmatch(regex, outs[4].text)
    assert outs[1].text in ("positive", "negative", "neutral")
    assert re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", outs[2].text)
    comps = outs[3].completions
    assert len(comps) == 3 and len({c.text for c in comps}) > 1  # each fork its own state and sample
    for c in comps:
        jsonschema.validate(json.loads(c.text), SCHEMAS[0])
    # Logprobs are of the masked distribution: every reported alternative is a finite logprob.
    assert len(outs[4].logprobs) == len(outs[4].token_ids)
    assert all(a["logprob"] > float("-inf") for e in outs[4].logprobs for a in e["top_logprobs"])


def test_greedy_constrained_equal_alone_and_in_a_preempting_batch(llm):
    """The grammar state survives preemption by recompute: the same greedy outputs alone."""
    prompts = [f"Record {i}: describe item {i} in JSON." for i in range(3)]
    ps = [SamplingParams(max_new_tokens=96, json_schema=SCHEMAS[i]) for i in range(3)]
    llm.reconfigure(num_blocks=16)  # tighter still, no shared prefix: 16 sequences must preempt
    try:
        batch = llm.generate(prompts * 6, ps * 6, use_tqdm=False)
        assert llm.stats["preemptions"] > 0
        alone = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, ps)]
    finally:
        llm.reconfigure(num_blocks=40)
    for i, o in enumerate(batch):
        assert o.token_ids == alone[i % 3].token_ids


def test_masks_filled_during_or_after_the_forward_give_the_same_outputs(llm):
    """The mask thread (the GPU path) and the in-line fill (the CPU default) mask alike."""
    prompts = [f"Record {i}: describe item {i} in JSON." for i in range(4)]
    ps = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(4)]
    outs = {}
    for overlap in (False, True):
        llm.reconfigure()  # a fresh engine each time (no prefix cache from the other run)
        llm.engine.runner.overlap_masks = overlap
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, ps, use_tqdm=False)]
        assert llm.stats["constrained_tokens"] > 0
    assert outs[False] == outs[True]


def test_unfinished_invalid_and_mixed(llm):
    ps = [SamplingParams(max_new_tokens=3, json_schema=SCHEMAS[0]),
          SamplingParams(max_new_tokens=8, json_schema={"type": "nonsense"}),
          SamplingParams(max_new_tokens=8, regex="(unclosed"),
          SamplingParams(max_new_tokens=8, grammar="root ::= undefined_rule"),
          SamplingParams(max_new_tokens=6, ignore_eos=True)]
    outs = llm.generate(["A person:", "x", "x", "x", "Hello"], ps, use_tqdm=False)
    assert outs[0].finish_reason == "constraint_unfinished" and len(outs[0].token_ids) == 3
    for o, kind in zip(outs[1:4], ("json schema", "regex", "grammar")):
        assert o.finish_reason == "error" and o.error.startswith(f"the {kind} constraint is invalid"), o.error
    assert outs[4].finish_reason == "length" and len(outs[4].token_ids) == 6


def test_params_validation_and_response_format():
    p = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                                "schema": SCHEMAS[1]}})
    assert p.json_schema == SCHEMAS[1] and p.response_format is None
    assert SamplingParams(response_format={"type": "json_object"}).json_object is True
    assert SamplingParams(response_format={"type": "text"}).constraint is None
    with pytest.raises(ValueError, match="only one of"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be"):
        SamplingParams(choice=[])
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(response_format={"type": "xml"})
    # Property order is the schema's (it is the order the output writes them in), so it is in the key.
    a = SamplingParams(json_schema={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    b = SamplingParams(json_schema={"properties": {"a": {"type": "integer"}}, "type": "object", "required": ["a"]})
    assert a.constraint != b.constraint and a.constraint == SamplingParams(json_schema=a.json_schema).constraint


def test_compile_cache(default_checkpoint):
    tok = default_checkpoint.tokenizer
    c = constraints.compiler_for(tok, default_checkpoint.config.vocab_size, tok.eos_ids)
    assert constraints.compiler_for(tok, default_checkpoint.config.vocab_size, tok.eos_ids) is c
    key = SamplingParams(json_schema=SCHEMAS[3]).constraint
    first = c.get(key)
    compiles, hits = c.compiles, c.hits
    assert c.get(key) is first and c.compiles == compiles and c.hits == hits + 1


def test_missing_extra_is_one_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(params, "structured_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs the xgrammar package: pip install 'tinyllm\[structured\]'"):
        SamplingParams(regex="a+")
    # Flags: exit 2 before any model loads (the model path does not even exist).
    code, out, err = cli(capsys, "generate", "-p", "-", "--model", tmp_path / "nope.gguf", "--regex", "a+")
    assert code == 2 and "pip install 'tinyllm[structured]'" in err and not out
    # A constrained line is that request's error line; the others still run.
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "regex": "a+"}) + "\n"
                 + json.dumps({"prompt_token_ids": [1, 2, 3], "max_new_tokens": 2}) + "\n")
    from tinyllm_cli.io import RequestBuilder
    b = RequestBuilder(None, False, SamplingParams())
    reqs = [b.build(i, i + 1, json.loads(x), i) for i, x in enumerate(p.read_text().splitlines())]
    assert "tinyllm[structured]" in reqs[0].error and reqs[1].error is None


def test_cli_flags_jsonl_fields_and_serve_batch(tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[1]))
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "prompt": "A colour and a score as JSON."},
        {"id": "b", "prompt": "Yes or no?", "choice": ["yes", "no"]},
        {"id": "c", "prompt": "A zip code.", "regex": "[0-9]{5}"},
        {"id": "d", "prompt": "JSON:", "response_format": {"type": "json_object"}, "max_new_tokens": 48}]) + "\n")
    code, out, err = cli(capsys, "generate", "-p", p, "--json-schema", schema, "--max-new-tokens", 64, "-q",
                         "--kv-memory", "64MiB")
    assert code == 0, err
    rows = {r["id"]: r for r in jsonl(out)}
    jsonschema.validate(json.loads(rows["a"]["text"]), SCHEMAS[1])
    assert rows["b"]["text"] in ("yes", "no") and re.fullmatch("[0-9]{5}", rows["c"]["text"])
    d = rows["d"]  # any JSON object: unbounded, so complete or marked unfinished
    assert d["text"].startswith("{") and d["finish_reason"] in ("stop", "constraint_unfinished")
    if d["finish_reason"] == "stop":
        assert isinstance(json.loads(d["text"]), dict)
    code, out, err = cli(capsys, "generate", "-p", p, "--json-schema", tmp_path / "missing.json")
    assert code == 2 and "--json-schema file" in err
    # serve-batch: OpenAI response_format with strict
    body = {"messages": [{"role": "user", "content": "A colour and a score."}], "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": True,
                                                                        "schema": SCHEMAS[1]}}}
    bad = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
           "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                         "body": b}) for cid, b in (("ok", body), ("bad", bad))) + "\n")
    code, out, err = cli(capsys, "serve-batch", "-i", inp, "-o", "-", "-q", "--kv-memory", "64MiB")
    lines = {r["custom_id"]: r for r in jsonl(out)}
    msg = lines["ok"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(msg), SCHEMAS[1])
    assert lines["bad"]["error"] is not None and "json schema constraint is invalid" in json.dumps(lines["bad"])


def test_slot_cache_stop_strings_and_resume_under_constraints(tmp_path, capsys):
    """Constrained greedy outputs: the slot cache equals the paged one; a stop string still
    ends a constrained output; a run cut after 2 lines and resumed equals the uninterrupted run."""
    p = tmp_path / "p.jsonl"
    recs = [{"id": f"r{i}", "prompt": f"Record {i}: describe item {i} in JSON.", "json_schema": SCHEMAS[i]}
            for i in range(4)] + [{"id": "s", "prompt": "Say yes or no.", "regex": "(yes|no)!+", "stop": ["!"]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    flags = ["--max-new-tokens", 48, "-q", "--kv-memory", "64MiB", "--max-model-len", 512]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    code, _, err = cli(capsys, "generate", "-p", p, *flags, "-o", full)
    assert code == 0, err
    code, slot, err = cli(capsys, "generate", "-p", p, *flags, "--cache", "slot")
    assert code == 0, err
    paged = jsonl(full.read_text())
    assert [r["token_ids"] for r in jsonl(slot)] == [r["token_ids"] for r in paged]
    stop = paged[-1]
    assert stop["finish_reason"] == "stop" and stop["stop_reason"] == "!" and stop["text"] in ("yes", "no")
    part.write_text("".join(full.read_text().splitlines(keepends=True)[:2]))
    code, _, err = cli(capsys, "generate", "-p", p, *flags, "-o", part, "--resume")
    assert code == 0, err
    strip = lambda rows: [{k: v for k, v in r.items() if k != "metrics"} for r in rows]
    assert strip(jsonl(part.read_text())) == strip(paged)
