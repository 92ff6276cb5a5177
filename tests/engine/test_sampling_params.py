"""SamplingParams at its edges: every bound accepted on its valid side and refused just past it, with the
parameter named; the coercions callers rely on (a single stop string, lists become tuples)."""

import pytest

from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import GREEDY_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(temperature=0.0), dict(temperature=2.5),
    dict(top_p=1.0), dict(top_p=1e-6),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=50),
    dict(max_tokens=1), dict(seed=0), dict(seed=-3), dict(seed=2**40),
    dict(logprobs=0), dict(logprobs=20), dict(n=1), dict(n=4),
    dict(stop_token_ids=[0]), dict(stop=["x"]),
])
def test_values_on_the_valid_side_of_each_bound_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == (tuple(value) if isinstance(value, list) else value)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1e-9), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=-0.5), "top_p"), (dict(top_p=1.0000001), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(seed=1.5), "seed"), (dict(seed="7"), "seed"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(logprobs=1.0), "logprobs"),
    (dict(n=0), "n"), (dict(n=1.0), "n"),
    (dict(stop=[""]), "stop"), (dict(stop=["ok", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[1.0]), "stop_token_ids"),
])
def test_values_just_past_each_bound_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert str(list(kwargs.values())[0]) in str(e.value) or param in ("stop", "stop_token_ids")


def test_stop_messages_say_what_is_allowed():
    with pytest.raises(InvalidRequestError, match=r"^stop strings must be non-empty strings$"):
        SamplingParams(stop=[""])
    with pytest.raises(InvalidRequestError, match=r"^stop_token_ids must be non-negative integers$"):
        SamplingParams(stop_token_ids=[-1])


def test_stop_and_stop_token_ids_are_coerced_to_tuples():
    assert SamplingParams(stop="END").stop == ("END",)  # one string is one stop string, not its characters
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))  # frozen and hashable


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n) == (1.0, 1.0, -1, 16, 1)
    assert (p.seed, p.logprobs, p.ignore_eos, p.include_stop_str_in_output) == (None, None, False, False)
    assert p.skip_special_tokens is True and p.stop == () and p.stop_token_ids == ()


def test_greedy_is_the_one_rule_the_sampler_applies():
    # One rule (sampling_params.is_greedy): a temperature below GREEDY_TEMPERATURE samples the argmax, as the
    # runner always did for it (1e-6 was greedy there, while this property said otherwise).
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize("kwargs, param, match", [
    (dict(temperature=1e39), "temperature", r"^temperature 1e\+39 overflows float32; use a value below 1e38$"),
    (dict(temperature=3.5e38), "temperature", "overflows float32"),  # finite in float64, rounds to inf in float32
    (dict(top_p=1e-46), "top_p", r"^top_p 1e-46 rounds to 0 in float32; use a value >= 1e-38$"),
    (dict(top_p="0.5"), "top_p", r"^top_p must be a finite number in \(0, 1\], got '0.5'$"),
    (dict(output_kind="delta"), "output_kind", r"^output_kind must be a RequestOutputKind, got 'delta'$"),
])
def test_float32_edges_and_wrong_types_name_the_parameter(kwargs, param, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_replace_checks_the_changed_values_only(monkeypatch):
    from ostinato import sampling_params as sp

    p = SamplingParams(temperature=0.7, seed=3, stop=["x"])
    checked = []
    for name, check in list(sp._CHECKS.items()):
        monkeypatch.setitem(sp._CHECKS, name, lambda v, name=name, check=check: checked.append(name) or check(v))
    q = p.replace(seed=4, n=1, stop="y")
    assert checked == ["seed", "n", "stop"]  # the rest was checked when p was made
    assert (q.seed, q.stop, q.temperature, p.seed) == (4, ("y",), 0.7, 3)  # normalized like the constructor
    assert q == SamplingParams(temperature=0.7, seed=4, stop=["y"])
    with pytest.raises(InvalidRequestError, match="^seed must be an integer") as e:
        p.replace(seed="4")
    assert e.value.param == "seed"
    with pytest.raises(TypeError, match="no field"):
        p.replace(temprature=1.0)
