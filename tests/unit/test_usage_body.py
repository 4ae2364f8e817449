"""OpenAI usage bodies: prediction tokens keep OpenAI's meaning; Pulse's speculation counters go apart."""
from gateway.responses import usage_body
from workers.protocol import Usage


def test_prediction_tokens_are_the_given_predictions_not_the_drafts():
    body = usage_body(Usage(prompt_tokens=10, completion_tokens=64, drafted_tokens=70, accepted_tokens=60,
                            accepted_prediction_tokens=64, rejected_prediction_tokens=0))
    assert body["completion_tokens_details"] == {"accepted_prediction_tokens": 64, "rejected_prediction_tokens": 0}
    assert body["pulse_speculation"] == {"drafted_tokens": 70, "accepted_tokens": 60}


def test_prompt_lookup_drafts_never_count_as_prediction_tokens():
    body = usage_body(Usage(prompt_tokens=10, completion_tokens=20, drafted_tokens=12, accepted_tokens=9))
    assert body["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    assert "pulse_speculation" in body
    assert "pulse_speculation" not in usage_body(Usage(prompt_tokens=1, completion_tokens=1))
