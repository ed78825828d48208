"""vLLM's own refusal reaches the client once, as the OpenAI error's message (issue 29): an
error body nested in the message opened, long lists counted, `param` kept, validator reasons
kept instead of a generic text. Bodies as vLLM 0.33 and Ray Serve LLM write them."""

import json

from engram_ray.serve.edge.api_errors import clean_error, leaks

IDS = list(range(512, 576))
LOGIT_BIAS = (f"token_id(s) {IDS} in logit_bias contain out-of-vocab token ids. "
              "Vocabulary size: 512")


def cleaned(message, param=None, status=400) -> dict:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError",
                                 "param": param, "code": status}}).encode()
    error = json.loads(clean_error(status, body, "req-1")[0])["error"]
    assert not leaks(error["message"]) and error["code"] == status
    return error


def vllm_body(message, param=None) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError",
                                 "param": param, "code": 400}})


def test_an_error_body_inside_the_message_is_opened_and_its_list_counted():
    error = cleaned(vllm_body(f"Message: {LOGIT_BIAS}", "logit_bias"))
    assert error["message"] == ("token_id(s) [512, 513, 514, ... 61 more] in logit_bias contain "
                                "out-of-vocab token ids. Vocabulary size: 512")
    assert error["param"] == "logit_bias"  # vLLM named it, inside


def test_an_inner_body_cut_off_still_gives_its_message():
    error = cleaned(vllm_body(f"Message: {LOGIT_BIAS}")[:200])
    assert error["message"].startswith("token_id(s) [512, 513, 514, ... ")
    assert "more (cut)]" in error["message"] and "{" not in error["message"]


def test_short_lists_stay_whole():
    assert cleaned("token_id(s) [512, 513] in logit_bias contain out-of-vocab token ids."
                   )["message"].startswith("token_id(s) [512, 513] in")


def test_a_tool_choice_refusal_keeps_vllms_reason():
    reason = "The tool specified in `tool_choice` does not match any of the specified `tools`"
    pydantic = (f"1 validation error for ChatCompletionRequest\n  Value error, {reason} "
                "[type=value_error, input_value={'model': 'm', 'tools': []}, input_type=dict]"
                "\n    For further information visit https://errors.pydantic.dev/2.11/v/"
                "value_error")
    for message in (pydantic, f"VLLMValidationError: {reason}", vllm_body(reason)):
        assert cleaned(message, "tool_choice") == {
            "message": reason, "type": "invalid_request_error", "param": "tool_choice",
            "code": 400}, message


def test_what_still_leaks_gets_the_generic_text_and_5xx_stay_generic():
    assert cleaned('Traceback (most recent call last):\n  File "x.py", line 3, in f'
                   )["message"] == "The request was refused (HTTP 400)."
    assert "request id req-1" in cleaned(vllm_body(LOGIT_BIAS), status=500)["message"]
