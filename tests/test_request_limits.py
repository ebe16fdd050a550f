"""Request limits at the door (issue 22): the server's body models, canonical sampling values, the API key rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from jaxspec.cli.common import CliError
from jaxspec.decoding import sampling
from jaxspec import request
from jaxspec.request import SamplerParams, SamplingError
from jaxspec.engine.stops import MAX_STOPS
from jaxspec.serving import protocol
from jaxspec.serving.protocol import ChatCompletionRequest, CompletionRequest
from jaxspec.serving.server import api_key

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "user")


# Bodies every bound admits: each field anywhere in its range (its edges included), the prompt as text or ids.
VALID_FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.text(max_size=256),
    "max_tokens": st.integers(1, protocol.MAX_SEED),
    "temperature": st.floats(0.0, 100.0),
    "top_p": st.floats(1e-30, 1.0),
    "top_k": st.integers(-1, protocol.MAX_TOP_K),
    "seed": st.integers(-protocol.MAX_SEED - 1, protocol.MAX_SEED),
    "stop": st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=MAX_STOPS),
    "n": st.integers(1, protocol.MAX_N),
    "stream": st.booleans(),
    "user": st.text(max_size=256),
})
VALID_PROMPTS = st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)


def _exact_int(v) -> bool:
    return type(v) is int


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), st.one_of(st.text(max_size=20), JSON))
def test_whatever_json_arrives_the_validator_refuses_it_or_every_field_is_in_bounds(fields, prompt):
    try:
        body = CompletionRequest.model_validate({"prompt": prompt, **fields})
    except ValidationError as e:  # a 400 naming the field (tests/test_serve.py checks the wording)
        assert {err["loc"][0] for err in e.errors()} <= {"prompt", *fields}, e.errors()  # one that was sent
        return
    for name in ("max_tokens", "top_k", "seed"):
        v = getattr(body, name)
        assert v is None or _exact_int(v)
    assert body.max_tokens is None or 1 <= body.max_tokens < 2**63
    assert body.top_k is None or body.top_k <= protocol.MAX_TOP_K
    assert body.seed is None or -(2**63) <= body.seed < 2**63
    assert _exact_int(body.n) and 1 <= body.n <= protocol.MAX_N
    assert type(body.stream) is bool
    for name in ("temperature", "top_p"):
        v = getattr(body, name)
        assert v is None or (type(v) is float and math.isfinite(v))
    assert body.stop is None or isinstance(body.stop, str) or (
        len(body.stop) <= protocol.MAX_STOPS and all(isinstance(s, str) for s in body.stop))
    if body.temperature is not None or body.top_p is not None or body.top_k is not None:
        try:  # what launch() builds next: canonical values or a SamplingError, never anything else
            p = SamplerParams(1.0 if body.temperature is None else body.temperature,
                               0 if body.top_k in (None, -1) else body.top_k,
                               1.0 if body.top_p is None else body.top_p)
        except SamplingError:
            return
        assert np.float32(p.temperature) == p.temperature and np.float32(p.top_p) == p.top_p
        assert sampling.row_values([p], 1000)["top_k"][0] <= 1000


@settings(max_examples=300, deadline=None)
@given(VALID_FIELDS, VALID_PROMPTS)
def test_every_in_bounds_body_is_accepted_as_sent(fields, prompt):
    """The other side of the bounds above: a validator that refused more than it must (or everything) fails here."""
    body = CompletionRequest.model_validate({"prompt": prompt, **fields})
    assert body.prompt == prompt and all(getattr(body, name) == value for name, value in fields.items())
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert all(getattr(chat, name) == value for name, value in fields.items())


def test_chat_messages_and_contents_are_bounded_and_typed():
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(ok).messages[0].content == "hi"
    for bad in ({"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user", "content": "hi"}] * (protocol.MAX_MESSAGES + 1)},
                {**ok, "max_completion_tokens": "3"}, {**ok, "n": True}, {**ok, "stop": ["a"] * 17}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    long_stop = ChatCompletionRequest.model_validate({**ok, "stop": "a stop string longer than sixteen"})
    assert long_stop.stop == "a stop string longer than sixteen"  # the count limit is not a length limit


def test_sampling_values_are_canonical_in_the_dtypes_the_device_uses():
    """What process 0 decides from these values is what a float32 / int32 device (and every process) runs."""
    assert SamplerParams(1e-50).greedy and SamplerParams(1e-50).temperature == 0.0
    assert not SamplerParams(2e-5).greedy
    nucleus = SamplerParams(0.8, top_p=1e-50)
    assert nucleus.top_p == float(np.float32(request.MIN_TOP_P)) and np.float32(nucleus.top_p) > 0
    assert SamplerParams(0.8, top_p=0.999999999).top_p == 1.0  # float32 rounds it to "off": so does the host
    assert sampling.WarpSpec.of(SamplerParams(0.8, top_p=0.999999999)) == sampling.WarpSpec.of(SamplerParams(0.8))
    huge = SamplerParams(1.0, top_k=2**40)
    assert huge.top_k == request.MAX_TOP_K and sampling.row_values([huge], 49152)["top_k"][0] == 49152
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=1e5),
                dict(top_p=float("nan")), dict(top_p=0.0), dict(top_k=-1), dict(temperature=True),
                dict(seed=1.5)):
        with pytest.raises(SamplingError):
            SamplerParams(**bad)


def test_authentication_cannot_be_switched_off_by_accident():
    assert api_key("k", None, "0.0.0.0", False) == "k"
    assert api_key(None, "env-key", "0.0.0.0", False) == "env-key"
    assert api_key("flag", "env-key", "127.0.0.1", False) == "flag"  # the flag wins
    assert api_key(None, None, "127.0.0.1", False) is None and api_key(None, None, "::1", False) is None
    assert api_key(None, None, "0.0.0.0", True) is None  # asked for explicitly
    for flag, env, host in (("", None, "127.0.0.1"), ("  ", None, "127.0.0.1"), (None, "", "127.0.0.1"),
                            (None, None, "0.0.0.0"), (None, None, "example.org"), (None, None, "10.1.2.3")):
        with pytest.raises(CliError):
            api_key(flag, env, host, False)


def test_a_union_field_error_names_what_is_wrong_with_the_value():
    """``stop`` is a string or a list: 17 strings must be reported as too many, not as "not a string"."""
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "stop": [f"s{i}" for i in range(17)]})
    err = protocol.validation_error(info.value.errors())
    assert err.param == "stop" and "'stop'" in err.message and f"at most {protocol.MAX_STOPS}" in err.message, err.message
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "stop": 42})
    err = protocol.validation_error(info.value.errors())
    assert err.param == "stop" and "'stop'" in err.message, err.message
