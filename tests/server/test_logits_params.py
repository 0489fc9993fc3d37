"""min_p, logit_bias and the repetition, frequency and presence penalties over HTTP: accepted
on both routes and carried into the engine's parameters; out of bounds, a 400 naming the
field. (Their effect on the tokens: tests/e2e/test_logits_processors.py.)"""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "hi"}]
FIELDS = {
    "min_p": 0.05,
    "repetition_penalty": 1.2,
    "frequency_penalty": -0.5,
    "presence_penalty": 1.5,
    "logit_bias": {"65": -100, "7": 2.5},
}


@pytest.mark.parametrize("route", ["/completions", "/chat/completions"])
def test_the_processor_fields_reach_the_engine(fake, route):
    body = {"prompt": "a"} if route == "/completions" else {"messages": CHAT}
    r = fake.post(route, **body, **FIELDS)
    assert r.status_code == 200, r.text
    params = fake.engine.submitted[-1].params
    assert params.min_p == 0.05 and params.repetition_penalty == 1.2
    assert params.frequency_penalty == -0.5 and params.presence_penalty == 1.5
    assert params.logit_bias == ((7, 2.5), (65, -100.0))


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"min_p": 1.5}, "min_p", "min_p: must be in [0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "must be in (0, 2]"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "(0, 2]"),
        ({"frequency_penalty": 2.01}, "frequency_penalty", "must be in [-2, 2]"),
        ({"presence_penalty": -3}, "presence_penalty", "must be in [-2, 2]"),
        ({"presence_penalty": "NaN"}, "presence_penalty", "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"999": 1}}, "logit_bias", "token id 999 is outside the vocabulary"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5", "number"),
        ({"logit_bias": [5]}, "logit_bias", "dictionary"),
    ],
)
def test_out_of_bounds_processor_fields_are_400_naming_the_field(fake, body, param, fragment):
    r = fake.post("/chat/completions", messages=CHAT, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_parameters_canvas_does_not_honour_stay_refused_by_name(fake):
    for field, value in (("best_of", 2), ("min_tokens", 3), ("functions", [{"name": "f"}])):
        error = fake.post("/chat/completions", messages=CHAT, **{field: value}).json()["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter"
