"""Structured output (trajserve/structured.py) on the embedded model: every
reply fits its constraint, greedy or sampled, n > 1 and forked; requests
without one come out as they do alone; a constraint that does not compile
fails by name before anything is queued."""
from __future__ import annotations

import json
import re

import pytest
from engine_util import run_requests as run

from trajserve.sampling import SamplingParams
from trajserve.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
PROMPT = "Plan a trip. Answer in JSON with the city and the number of days:"


def fits(text: str) -> bool:
    d = json.loads(text)
    return (set(d) == {"city", "days"} and isinstance(d["city"], str) and len(d["city"]) <= 20
            and type(d["days"]) is int and 1 <= d["days"] <= 9)


def test_json_schema_greedy_sampled_and_n3_beside_a_free_request(engine_f32):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (alone,) = run(engine_f32, [(PROMPT, free)])
    so = StructuredOutput(json_schema=SCHEMA)
    greedy, sampled, free_again = run(engine_f32, [
        (PROMPT, SamplingParams(max_tokens=80, temperature=0, structured=so)),
        (PROMPT, SamplingParams(max_tokens=80, temperature=1.0, seed=7, n=3, structured=so)),
        (PROMPT, free)])
    assert free_again.outputs[0].token_ids == alone.outputs[0].token_ids  # the batch did not touch it
    for c in greedy.outputs + sampled.outputs:
        assert c.finish_reason == "stop" and fits(c.text), c.text
    assert len({c.text for c in sampled.outputs}) > 1  # three samples, not one repeated


def test_a_complete_constraint_ends_the_reply_even_with_ignore_eos(engine_f32):
    (out,) = run(engine_f32, [("Pick one:", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                                          structured=StructuredOutput(choice=["red", "green"])))])
    assert out.outputs[0].text in ("red", "green") and out.outputs[0].finish_reason == "stop"
    (out,) = run(engine_f32, [("Phone:", SamplingParams(max_tokens=50, temperature=0,
                                                       structured=StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}")))])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.outputs[0].text)


def test_forked_branches_keep_the_parents_place_in_the_constraint(engine_f32):
    """Fork mid-reply: each branch continues from the parent's partial JSON
    and must still close it validly."""
    eng = engine_f32
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=80, temperature=0,
                                                 structured=StructuredOutput(json_schema=SCHEMA)))
    for _ in range(4):  # prefill + a few tokens of the JSON
        eng.step()
    kids = eng.fork(rid, 2, SamplingParams(max_tokens=80, temperature=1.0, seed=3,
                                           structured=StructuredOutput(json_schema=SCHEMA)))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    for r in [rid, *kids]:
        assert fits(outs[r].text), outs[r].text
    prefix = outs[rid].token_ids[:3]
    assert all(outs[k].token_ids[:3] == prefix for k in kids)
    # A child whose constraint the parent's output so far already breaks is refused.
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    with pytest.raises(ValueError, match="does not fit the child's structured output"):
        eng.fork(rid, 1, SamplingParams(structured=StructuredOutput(regex="[0-9]+")))
    eng.abort_request(rid)


@pytest.mark.parametrize("so, words", [
    (dict(json_schema={"type": "nonsense"}), "does not compile: Invalid type: nonsense"),
    (dict(regex="("), "does not compile"),
    (dict(grammar="start: undefined_rule"), "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_queuing(engine_f32, so, words):
    with pytest.raises(ValueError, match=words):
        engine_f32.add_request("x", SamplingParams(structured=StructuredOutput(**so)))
    assert not engine_f32.has_unfinished_requests()


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of .* got regex, choice"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{")


def test_a_schema_compiles_once_and_every_request_gets_its_own_matcher(engine_f32):
    """An agent's schema comes back every turn: the second request copies the
    compiled matcher. Two requests on copies of one compiled matcher run
    side by side and each fits (a shared matcher would be advanced twice per
    step and break). prepare_structured compiles from another thread."""
    import threading

    eng, g = engine_f32, engine_f32.grammars
    schema = {**SCHEMA, "description": "cache test"}  # a grammar no other test compiled
    sp = SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput(json_schema=schema))
    compiled, hits = g.compiled, g.cache_hits
    t = threading.Thread(target=eng.prepare_structured, args=(sp,))
    t.start()
    t.join()
    assert (g.compiled, g.cache_hits) == (compiled + 1, hits)
    outs = run(eng, [(PROMPT, sp), ("Another trip. JSON:", sp)])
    assert (g.compiled, g.cache_hits) == (compiled + 1, hits + 2)
    assert all(fits(o.outputs[0].text) for o in outs)


def test_the_compiled_grammars_are_kept_lru(engine_f32):
    from trajserve.structured import GrammarCompiler

    g = GrammarCompiler(engine_f32.tokenizer, engine_f32.model_config.vocab_size, cache_size=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    for spec in (a, b, a, c, b):  # c pushes out b (a was used after b), so b compiles again
        g.matcher(spec)
    assert (g.compiled, g.cache_hits) == (4, 1)


def test_objects_are_closed_unless_the_schema_opens_them(engine_f32):
    """closed_objects: what xgrammar's strict mode (vLLM's default) holds a
    schema to. Checked on the schema and on the matcher the engine compiles."""
    from trajserve.structured import closed_objects

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},  # a property so named
        "open": {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": True},
        "pick": {"enum": [{"properties": 1}]},  # data, not a schema
        "both": {"allOf": [{"type": "object", "properties": {"c": {"type": "integer"}}}]}},
        "$defs": {"p": {"type": "object", "properties": {"d": {"type": "string"}}}}}
    got = closed_objects(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]  # the map of names was not taken for a schema
    assert got["properties"]["open"]["additionalProperties"] is True
    assert got["properties"]["pick"] == schema["properties"]["pick"]
    assert got["properties"]["both"] == schema["properties"]["both"]
    assert got["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed

    tok = engine_f32.tokenizer
    city = {"type": "object", "properties": {"city": {"type": "string"}}}

    def accepts(schema, text):
        m = engine_f32.grammars.matcher(StructuredOutput(json_schema=schema))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and not m.is_error()

    assert accepts(city, '{"city": "Paris"}')
    assert not accepts(city, '{"city": "Paris", "unit": "c"}')
    assert accepts({**city, "additionalProperties": True}, '{"city": "Paris", "unit": "c"}')


def test_a_forced_tool_call_ends_with_the_declared_arguments(engine_f32):
    """The embedded model under tool_choice naming a function: with objects
    open it invented keys until max_tokens ("unit_description_type_name",
    ...) and the reply came back as text; closed, it ends the call."""
    from trajserve.server.tool_calls import forced_schema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}]
    tok = engine_f32.tokenizer
    ids = tok.encode(tok.apply_chat_template([
        {"role": "system", "content": "You can call get_weather(city, unit)."},
        {"role": "user", "content": "What's the weather in Paris?"}]), add_special_tokens=False)
    so = StructuredOutput(json_schema=forced_schema(tools, "get_weather"))
    (out,) = run(engine_f32, [(ids, SamplingParams(max_tokens=100, temperature=0, structured=so))])
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    args = json.loads(c.text)
    assert "city" in args and set(args) <= {"city", "unit"}
