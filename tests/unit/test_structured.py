"""The grammar constraint on its own (engine.structured): repair, the closing policy, the JSON
lexer, with the tiny checkpoints' byte-level tokenizer (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoints.tiny import build_tokenizer
from engine.structured import GrammarCompiler, JsonLex

EOS = 1
VOCAB = 512
TOKENIZER = build_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB, (EOS,))


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


def text_of(tokens: list[int]) -> str:
    return str(TOKENIZER.decode(tokens))


def flat_logits(n: int) -> torch.Tensor:
    return torch.zeros(n, VOCAB)


def test_a_valid_draft_is_kept_as_it_is(compiler: GrammarCompiler) -> None:
    c = compiler.constraint(json.dumps({"type": "object"}))
    draft = ids('{"k":1}') + [EOS]
    assert c.repair(draft, flat_logits(len(draft)), budget=100) == draft


def test_an_invalid_token_is_replaced_by_the_best_allowed_one(compiler: GrammarCompiler) -> None:
    c = compiler.constraint(json.dumps({"enum": ["ab", "ac"]}))
    draft = ids('"zz"') + [EOS]
    logits = flat_logits(len(draft))
    logits[1, ids("c")[0]] = 5.0  # position 1 prefers "c" among the allowed "a"/... then "c"
    logits[1, ids("a")[0]] = 4.0
    logits[2, ids("c")[0]] = 3.0
    out = c.repair(draft, logits, budget=100)
    assert out[: out.index(EOS)] == ids('"ac"')


def test_a_document_completed_in_an_earlier_canvas_ends_the_next(compiler: GrammarCompiler) -> None:
    c = compiler.constraint(json.dumps({"const": "x"}))
    first = ids('"x"')
    assert c.repair(first, flat_logits(3), budget=100) == first  # fills the canvas exactly
    second = c.repair(ids("abc"), flat_logits(3), budget=97)
    assert second[0] == EOS


def test_the_document_closes_within_the_budget(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    for budget in (12, 20, 40):
        c = compiler.constraint(json.dumps(schema))
        draft = ids('{"s":"') + ids("x" * 60)  # a string that would never end
        out = c.repair(draft, flat_logits(len(draft)), budget=budget)
        text = text_of(out[: out.index(EOS)])
        assert len(text) + 1 <= budget and json.loads(text)["s"].startswith("x")


def test_too_small_a_budget_leaves_an_unfinished_document(compiler: GrammarCompiler) -> None:
    c = compiler.constraint(json.dumps({"const": "a long constant"}))
    out = c.repair(ids('"a'), flat_logits(2), budget=2)
    assert EOS not in out


def test_ar_masks_and_commits(compiler: GrammarCompiler) -> None:
    c = compiler.constraint(json.dumps({"type": "boolean"}))
    logits = torch.zeros(VOCAB)
    c.mask_logits(logits)
    allowed = {int(i) for i in torch.isfinite(logits).nonzero()}
    assert allowed == {ids("t")[0], ids("f")[0]}
    assert c.commit_ar(ids("t")[0], remaining=10) == ids("t")[0]
    assert c.commit_ar(ids("x")[0], remaining=9) == -1  # the grammar refuses: the row fails


def test_invalid_schema_names_the_parameter(compiler: GrammarCompiler) -> None:
    from engine.params import ParamError

    with pytest.raises(ParamError) as info:
        compiler.constraint('{"type": 3}', param="tools")
    assert info.value.param == "tools"


def test_the_lexer_knows_strings_and_escapes() -> None:
    lex = JsonLex()
    lex.feed(b'{"a\\"b')
    assert lex.in_string
    lex.feed(b'"')
    assert not lex.in_string
    lex.feed(b':"\\\\')
    assert lex.in_string and not lex.escaped
