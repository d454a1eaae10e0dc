import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e-40), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {5: 200.0}), ("logit_bias", {-1: 1.0}), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
])
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_normalisation():
    p = SamplingParams(stop="x", top_k=-1, logit_bias={"3": 1})
    assert p.stop == ["x"] and p.top_k == 0 and p.logit_bias == {3: 1.0}
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy


def test_vocab_checks():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_model(vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate_for_model(vocab_size=100)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 100]).validate_for_model(vocab_size=100)
    assert SamplingParams(allowed_token_ids=[7, 3, 7]).allowed_token_ids == [3, 7]


def test_allowed_token_ids_leave_the_choice_to_a_grammar():
    """A grammar and allowed_token_ids could leave no token at all (a 500 the fuzzer found): refused together."""
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        SamplingParams(allowed_token_ids=[5], structured_outputs={"regex": "0"})
